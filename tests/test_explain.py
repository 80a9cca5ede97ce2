"""Provenance through the real server: POST /v1/knn/explain and GET /v1/knn/documents (tiny model, memorised text)."""

from __future__ import annotations

import hashlib
import json
import math

import numpy as np
import openai
import pytest
import requests
from conftest import prompt_logprobs
from local_server import LAMBDAS, folder_below_root, serving

from index_builder.build import build_datastore
from knnlm_core.config import BuildConfig
from knnlm_core.datastore import read_manifest, write_manifest

pytestmark = pytest.mark.slow

PREFIX = "The ferry log of the southern harbour says that on the last morning of spring"
CONTINUATION = " a whale the colour of slate rose beside the pier, and every bell in the town rang until noon."
TEXT = PREFIX + CONTINUATION
RECORDS = [{"id": "tide-7", "text": "High tide came at six, and the nets were mended before the boats went out again."}]
LAMBDA, GENERATE = LAMBDAS["docs"], 12


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def server(local_server, tiny_model_dir):
    (corpus := (work := folder_below_root(local_server, "explain")) / "corpus").mkdir()
    (corpus / "harbour.txt").write_text(TEXT)
    (corpus / "tides.jsonl").write_text("\n".join(json.dumps(r) for r in RECORDS))
    build_datastore(
        [corpus], work / "docs", tiny_model_dir, BuildConfig(index="flat", context_length=128, stride=64, shards=2), progress=False
    )
    # A datastore from before provenance: no document table in its manifest or on disk.
    build_datastore([corpus], work / "old", tiny_model_dir, BuildConfig(index="flat", context_length=128, stride=64), progress=False)
    write_manifest(work / "old", read_manifest(work / "old").model_copy(update={"provenance": None}))
    (work / "old" / "provenance.json").unlink()
    with serving(local_server, {"docs": work / "docs", "old": work / "old"}, default="docs"):
        yield local_server


def explain(server, **body) -> requests.Response:
    return requests.post(f"{server.base_url}/v1/knn/explain", json=body, timeout=120)


def served(server, ids: list[int], **xargs) -> np.ndarray:
    """p of ids[1:] as the server serves them (echoed prompt logprobs)."""
    return np.exp(prompt_logprobs(server, ids, **xargs))


def check_against_serving(server, tokens: list[dict], ids: list[int], first: int) -> None:
    """Each explained token (ids[first + i]): p equals the served probability, p_LM the served
    probability with kNN off, p_kNN the one the served mixture implies: (p − (1−λ)·p_LM) / λ."""
    on, off = served(server, ids)[first - 1 :], served(server, ids, knn=False)[first - 1 :]
    for t, p_on, p_off in zip(tokens, on, off, strict=True):
        assert t["lambda"] == pytest.approx(LAMBDA)
        assert math.exp(t["logprob"]) == pytest.approx(t["p"], abs=1e-4)
        assert t["p"] == pytest.approx(p_on, abs=1e-4)
        assert t["p_lm"] == pytest.approx(p_off, abs=1e-4)
        assert t["p_knn"] == pytest.approx((p_on - (1 - LAMBDA) * p_off) / LAMBDA, abs=1e-4)


def test_each_generated_token_points_at_the_document_position_it_continues(server, tokenizer):
    response = explain(server, prompt=PREFIX, max_tokens=GENERATE, vllm_xargs={"knn_explain": 3})
    assert response.status_code == 200, response.text
    body = response.json()
    document, first = tokenizer(TEXT).input_ids, len(tokenizer(PREFIX).input_ids)
    assert body["datastore"] == {"name": "docs", "version": 1}
    assert [t["token_id"] for t in body["tokens"]] == document[first : first + GENERATE]  # the memorised text
    for i, token in enumerate(body["tokens"]):
        assert token["status"] == "searched" and len(token["neighbours"]) == 3
        top = token["neighbours"][0]
        assert (top["source"], top["line"], top["position"]) == ("harbour.txt", None, first + i)
        assert top["next_token"] == token["token"] and f"[[{token['token']}]]" in top["snippet"]
        assert top["snippet"].split("[[")[0] in tokenizer.decode(document[: first + i])  # the text before it
        assert top["weight"] == max(n["weight"] for n in token["neighbours"])
    check_against_serving(server, body["tokens"], document[: first + GENERATE], first)


def test_a_scored_completion_is_explained_token_by_token(server, tokenizer):
    response = explain(server, prompt=PREFIX, completion=CONTINUATION, vllm_xargs={"knn_explain": 2, "knn_k": 4})
    assert response.status_code == 200, response.text
    body = response.json()
    prompt, scored = tokenizer(PREFIX).input_ids, tokenizer(CONTINUATION, add_special_tokens=False).input_ids
    assert [t["token_id"] for t in body["tokens"]] == scored and body["text"] == CONTINUATION
    assert all(len(t["neighbours"]) == 2 and t["neighbours"][0]["source"] == "harbour.txt" for t in body["tokens"])
    on = served(server, prompt + scored, knn_k=4)[len(prompt) - 1 :]
    assert np.allclose([math.exp(t["logprob"]) for t in body["tokens"]], on, atol=1e-4)
    assert np.allclose([t["p"] for t in body["tokens"]], on, atol=1e-4)


def test_documents_come_back_whole_with_where_they_came_from(server):
    harbour = requests.get(f"{server.base_url}/v1/knn/documents/docs/0", timeout=30).json()
    assert (harbour["source"], harbour["text"], harbour["sha256"]) == ("harbour.txt", TEXT, hashlib.sha256(TEXT.encode()).hexdigest())
    record = requests.get(f"{server.base_url}/v1/knn/documents/docs/1", timeout=30).json()
    assert (record["source"], record["line"], record["id"], record["text"]) == ("tides.jsonl", 1, "tide-7", RECORDS[0]["text"])


@pytest.mark.parametrize(
    "call, status, message",
    [
        (lambda s: requests.get(f"{s.base_url}/v1/knn/documents/docs/2", timeout=30), 404, "document 2 does not exist"),
        (lambda s: requests.get(f"{s.base_url}/v1/knn/documents/nope/0", timeout=30), 404, "no datastore 'nope'"),
        (lambda s: requests.get(f"{s.base_url}/v1/knn/documents/old/0", timeout=30), 422, "has no provenance"),
        (lambda s: explain(s, prompt=PREFIX, vllm_xargs={"knn_datastore": "old"}), 422, "rebuild it with `knnlm-index build`"),
        (lambda s: explain(s, prompt=PREFIX, vllm_xargs={"knn_explain": 0}), 400, "knn_explain=0"),
        (lambda s: explain(s, prompt=PREFIX, vllm_xargs={"knn": False}), 400, "kNN is off"),
        (lambda s: explain(s, prompt=PREFIX, vllm_xargs={"knn_lamda": 0.5}), 400, "knn_lamda"),
        (lambda s: explain(s, prompt=PREFIX, max_tokens=0), 400, "max_tokens"),
    ],
    ids=[
        "unknown document",
        "unknown datastore",
        "document without provenance",
        "explain without provenance",
        "zero neighbours",
        "knn off",
        "typo",
        "no tokens",
    ],
)
def test_bad_explain_requests_are_4xx_and_the_server_keeps_serving(server, call, status, message):
    response = call(server)
    assert response.status_code == status and message in response.text, response.text
    assert explain(server, prompt=PREFIX, max_tokens=2).status_code == 200


def test_completions_cannot_ask_for_an_explanation_they_cannot_return(server):
    with pytest.raises(openai.BadRequestError, match="POST /v1/knn/explain"):
        server.openai_client().completions.create(model="tiny", prompt=PREFIX, max_tokens=2, extra_body={"vllm_xargs": {"knn_explain": 5}})
