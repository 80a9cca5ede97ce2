"""kNN on vLLM's Model Runner V2 (knn.model_runner: v2), run on this CPU through Triton's
interpreter (tests/triton_cpu): the same requests as on the V1 runner give the same tokens and
logprobs, and hot-swaps, faults, explanations and bad knobs behave as they do there.

The V1 server answers first and is stopped, while the V2 server starts; the V2 server then answers
the same requests. V2's kernels are interpreted here: a step is slow, so the requests are short."""

from __future__ import annotations

import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import openai
import pytest
import requests
from conftest import TINY_SERVER, continuations, greedy, prompt_logprobs, starting, stream_while, until
from datastore_edits import calibrated, rewritten, save

from index_builder.build import build_datastore
from knnlm_core.config import BuildConfig
from knnlm_serve.server.process import RunningServer, metric_total, scrape_metrics

pytestmark = pytest.mark.slow

TRITON_CPU = Path(__file__).parent / "triton_cpu"
PREFIX = "The ferryman of the southern river told the travellers that before dawn"
TEXTS = {
    "a": PREFIX + " the water rose over the stone steps and carried the old wooden bridge down to the sea.",
    "b": PREFIX + " three herons stood in the reeds and a bell rang twice from the empty chapel on the hill.",
}
TOKEN = "v2-admin-token"
CONTINUATION = 10
SWAP_TOKENS = 4  # the streams of the hot-swap test: the two texts differ from the first token

# Each case: (what a user would call it, the request's vllm_xargs).
CASES = {
    "knn-off": {"knn": False},
    "calibrated-defaults": {"knn_datastore": "calibrated"},
    "lambda-1-pointers": {"knn_datastore": "a", "knn_lambda": 1.0, "knn_pointers": 1},
}
MIXED = [
    {"knn_datastore": "a", "knn_lambda": 1.0},
    {"knn_datastore": "b", "knn_lambda": 1.0, "knn_pointers": 1},
    {"knn": False},
    {"knn_datastore": "b", "knn_lambda": 0.3, "knn_temperature": 5.0, "knn_k": 2},
    {"knn_datastore": "calibrated", "knn_skip_threshold": 0.02},
]


@pytest.fixture(scope="module")
def root(tiny_model_dir, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("v2-datastores")
    config = BuildConfig(index="flat", context_length=128, stride=64)
    for name, text in TEXTS.items():
        (root / f"{name}.txt").write_text(text)
        build_datastore([root / f"{name}.txt"], root / name, tiny_model_dir, config, progress=False)
    rewritten(root, "calibrated", "a", calibrated(**{"lambda": 0.6, "temperature": 3.0, "k": 4}))
    shutil.copytree(root / "b", root / "p")  # broken on disk by a test
    return root


def config(tiny_model_dir, root: Path, model_runner: str) -> dict:
    knn = {
        "datastores": {"main": str(root / "a"), **{n: str(root / n) for n in ("a", "b", "calibrated", "p")}},
        "k": 8,
        "lambda": 0.25,
        "adaptive_lambda": {"b": {"lambda_max": 1.0, "slope": 1.0, "center": 20.0}},
        "admin_token": TOKEN,
        "datastore_root": str(root),
        "shard_timeout_s": 5.0,
        "fail_open": True,  # the fault test's subject; a kNN error elsewhere shows as a difference from V1
        "model_runner": model_runner,
    }
    return {**TINY_SERVER, "model": str(tiny_model_dir), "knn": knn}


@pytest.fixture(scope="module")
def ids(tiny_model_dir):
    return continuations(tiny_model_dir, PREFIX, TEXTS, CONTINUATION)


def answers(server, ids) -> dict:
    """Every request the parity tests compare, as served, after one request per datastore (a
    version's first search also sets up its shard actors' channels, and may miss the step's
    deadline); none of them may fall back to the LM."""
    prompt, document = ids["prompt"], ids["prompt"] + ids["a"]
    for name in ("a", "b", "calibrated"):
        greedy(server, prompt, 2, knn_datastore=name)
    before = metric_total(scrape_metrics(server.base_url), "knnlm_fallbacks_total")
    with ThreadPoolExecutor(len(MIXED)) as pool:  # one batch, every row with its own settings
        mixed = list(pool.map(lambda xargs: greedy(server, prompt, CONTINUATION, **xargs), MIXED))
    served = {
        **{name: greedy(server, prompt, CONTINUATION, **xargs) for name, xargs in CASES.items()},
        "mixed": mixed,
        "prompt-logprobs": prompt_logprobs(server, document, knn_datastore="a", knn_lambda=0.5),
        "explain-generated": explain(server, prompt=PREFIX, max_tokens=4, vllm_xargs={"knn_explain": 2, "knn_datastore": "a"}),
        "explain-scored": explain(server, prompt=PREFIX, completion=TEXTS["a"][len(PREFIX) :], vllm_xargs={"knn_explain": 2}),
    }
    assert metric_total(scrape_metrics(server.base_url), "knnlm_fallbacks_total") == before, "a kNN row was served LM-only"
    return served


def explain(server, **body) -> dict:
    response = requests.post(f"{server.base_url}/v1/knn/explain", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.fixture(scope="module")
def v2_start(tiny_model_dir, root, tmp_path_factory):
    """The V2 server's start, begun beside the V1 server's start and answers."""
    env = {"PYTHONPATH": str(TRITON_CPU), "VLLM_CPU_KVCACHE_SPACE": "1"}
    with starting(RunningServer(config(tiny_model_dir, root, "v2"), tmp_path_factory.mktemp("v2"), env=env)) as start:
        yield start


@pytest.fixture(scope="module")
def on_v1(tiny_model_dir, root, ids, v2_start, tmp_path_factory):
    with RunningServer(config(tiny_model_dir, root, "v1"), tmp_path_factory.mktemp("v1")) as server:
        return answers(server, ids)


@pytest.fixture(scope="module")
def server(on_v1, v2_start):
    return v2_start.result()


@pytest.fixture(scope="module")
def on_v2(server, ids):
    return answers(server, ids)


def same_completion(v2, v1) -> None:
    assert v2.token_ids == v1.token_ids
    np.testing.assert_allclose(v2.logprobs.token_logprobs, v1.logprobs.token_logprobs, atol=1e-4)


def test_the_server_says_it_serves_on_model_runner_v2(server):
    log = server.log_path.read_text()
    assert "kNN serves on vLLM's model runner V2 (knn.model_runner: v2)" in log
    assert "'model_runner': 'v2'" in log  # what the worker reported when kNN attached


@pytest.mark.parametrize("case", sorted(CASES))
def test_v2_serves_the_tokens_and_logprobs_v1_serves(on_v1, on_v2, ids, case):
    same_completion(on_v2[case], on_v1[case])
    if case == "lambda-1-pointers":
        assert on_v2[case].token_ids == ids["a"]  # and kNN was on: the memorised text


def test_a_batch_mixing_datastores_and_knobs_is_served_row_by_row_as_on_v1(on_v1, on_v2, ids):
    for v2, v1 in zip(on_v2["mixed"], on_v1["mixed"], strict=True):
        same_completion(v2, v1)
    assert on_v2["mixed"][0].token_ids == ids["a"] and on_v2["mixed"][1].token_ids == ids["b"]


def test_prompt_logprobs_with_knn_equal_v1s(on_v1, on_v2):
    np.testing.assert_allclose(on_v2["prompt-logprobs"], on_v1["prompt-logprobs"], atol=1e-4)
    assert np.mean(on_v2["prompt-logprobs"]) > np.log(0.4)  # λ 0.5 of a memorised text


@pytest.mark.parametrize("kind", ["explain-generated", "explain-scored"])
def test_explanations_on_v2_are_complete_and_equal_v1s(on_v1, on_v2, kind):
    v2, v1 = on_v2[kind], on_v1[kind]
    assert len(v2["tokens"]) == len(v1["tokens"]) > 0
    for t2, t1 in zip(v2["tokens"], v1["tokens"], strict=True):
        assert (t2["token_id"], t2["status"]) == (t1["token_id"], t1["status"])
        assert [(n["source"], n["position"]) for n in t2["neighbours"]] == [(n["source"], n["position"]) for n in t1["neighbours"]]
        for field in ("p", "p_lm", "p_knn", "lambda"):
            assert (t2[field] is None) == (t1[field] is None) and (t2[field] is None or t2[field] == pytest.approx(t1[field], abs=1e-4))
    assert v2["datastore"] == v1["datastore"] and any(len(t["neighbours"]) == 2 for t in v2["tokens"])


def test_a_hot_swap_mid_stream_keeps_each_request_on_its_version(server, ids):
    a, b = ids["a"][:SWAP_TOKENS], ids["b"][:SWAP_TOKENS]

    def swap_to_b_and_back():
        for path, expected in (("b", b), ("a", a)):
            time.sleep(1)
            assert admin(server, "POST", "/datastores", name="main", path=path).status_code == 200
            until(lambda e=expected: greedy(server, ids["prompt"], SWAP_TOKENS, knn_lambda=1.0).token_ids == e, 120, "never swapped")
        time.sleep(1)

    results, errors = stream_while(server, ids["prompt"], SWAP_TOKENS, swap_to_b_and_back, clients=4, xargs={"knn_lambda": 1.0})
    assert errors == [] and results
    assert [r for r in results if r not in (a, b)] == []  # no response mixes two versions
    assert a in results and b in results


def test_an_injected_fault_is_served_lm_only_and_marks_the_datastore_unhealthy(server, root, ids):
    plain = greedy(server, ids["prompt"], CONTINUATION, knn=False)
    save(root / "p" / "documents.npy", np.array([0, "x"], dtype=object))  # read at p's first pointer step
    broken = greedy(server, ids["prompt"], CONTINUATION, knn_datastore="p", knn_lambda=1.0, knn_pointers=1)
    assert broken.token_ids == plain.token_ids
    np.testing.assert_allclose(broken.logprobs.token_logprobs, plain.logprobs.token_logprobs, atol=1e-5)
    assert scrape_metrics(server.base_url).get('knnlm_fallbacks_total{datastore="p",reason="error"}', 0) >= 1
    until(lambda: not listed(server, "p")["healthy"], 60, "p was never reported unhealthy")
    assert "documents.npy" in listed(server, "p")["error"] and listed(server, "a")["healthy"]
    assert greedy(server, ids["prompt"], CONTINUATION, knn_datastore="b", knn_lambda=1.0).token_ids == ids["b"]  # the others serve on


def test_a_bad_knob_is_a_400_naming_the_field(server, ids):
    with pytest.raises(openai.BadRequestError, match=r"vllm_xargs\.knn_lambda"):
        greedy(server, ids["prompt"], 2, knn_lambda=2.0)
    assert greedy(server, ids["prompt"], 2, knn=False).token_ids  # and it serves on


def admin(server, method, route, **body):
    return requests.request(method, f"{server.base_url}/v1/knn{route}", json=body or None, headers={"X-Admin-Token": TOKEN}, timeout=300)


def listed(server, name: str) -> dict:
    return next(d for d in admin(server, "GET", "/datastores").json()["datastores"] if d["name"] == name and d["status"] == "serving")
