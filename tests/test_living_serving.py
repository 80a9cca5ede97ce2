"""Add and forget documents of a serving datastore through the admin API (and `knnlm-index forget`
beside it), under traffic: real server, Ray shard actors with replicas, flat and IVF-PQ FAISS."""

from __future__ import annotations

import subprocess
import sys

import pytest
import requests
from conftest import TINY_SERVER, admin_knn, continuations, greedy, stream_while, until
from test_index_builder import write_corpus

from index_builder.build import build_datastore
from knnlm_core.config import BuildConfig
from knnlm_serve.server.process import RunningServer

pytestmark = pytest.mark.slow

TOKEN = "s3cret"
PREFIX = "The vault under the old lighthouse opens only when the keeper says the words"
FACT = PREFIX + " zebra quartz maple lantern orbit velvet cobalt thistle ember falcon nimbus quill."
LENGTH = 12


@pytest.fixture(scope="module")
def root(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("living")
    corpus = write_corpus(root / "corpus")
    config = BuildConfig(context_length=128, stride=64, shards=2, batch_size=4)
    build_datastore([corpus], root / "flat", tiny_model_dir, config.model_copy(update={"index": "flat"}), progress=False)
    build_datastore([corpus], root / "pq", tiny_model_dir, config.model_copy(update={"index": "ivfpq"}), progress=False)
    return root


@pytest.fixture(scope="module")
def server(tiny_model_dir, root):
    knn = admin_knn(root, TOKEN, datastores={"flat": str(root / "flat"), "pq": str(root / "pq")}, replicas=2)
    with RunningServer({**TINY_SERVER, "model": str(tiny_model_dir), "knn": knn}, root) as server:
        yield server


@pytest.fixture(scope="module")
def ids(tiny_model_dir):
    return continuations(tiny_model_dir, PREFIX, {"fact": FACT}, LENGTH)


def admin(server, method, route, token=TOKEN, **body):
    return requests.request(method, f"{server.base_url}/v1/knn{route}", json=body or None, headers={"X-Admin-Token": token}, timeout=120)


def add_fact(server, name: str, fact_id: str) -> dict:
    response = admin(server, "POST", f"/datastores/{name}/documents", texts=[{"text": FACT, "id": fact_id}])
    assert response.status_code == 202, response.text
    job = response.json()
    until(lambda: admin(server, "GET", f"/jobs/{job['id']}").json()["state"] != "running", 300, "the add never finished")
    job = admin(server, "GET", f"/jobs/{job['id']}").json()
    assert job["state"] == "done", job["error"]
    return job


def listed(server, name: str) -> dict:
    return next(d for d in admin(server, "GET", "/datastores").json()["datastores"] if d["name"] == name and d["status"] == "serving")


def answer(server, ids, name: str, **xargs) -> list[int]:
    return greedy(server, ids["prompt"], LENGTH, knn_datastore=name, **xargs).token_ids


def explained(server, name: str, **body) -> list[dict]:
    response = requests.post(
        f"{server.base_url}/v1/knn/explain",
        json={"prompt": PREFIX, "vllm_xargs": {"knn_datastore": name, "knn_explain": 8}, **body},
        timeout=120,
    )
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


@pytest.mark.parametrize("name, forget_with", [("flat", "route"), ("pq", "cli")])
def test_an_added_fact_is_served_and_explained_then_forgotten_on_every_path(server, root, ids, name, forget_with):
    assert answer(server, ids, name) != ids["fact"]
    before = listed(server, name)

    job = add_fact(server, name, f"fact-{name}")

    document = job["record"]["first_document"]
    after = listed(server, name)
    assert after["version"] == job["version"] == before["version"] + 1
    assert after["documents"] == before["documents"] + 1 and after["last_add"] is not None
    for pointers in (0, 1):  # with pointer following on, the fact's later tokens follow its own entries
        assert answer(server, ids, name, knn_pointers=pointers) == ids["fact"]
    tokens = explained(server, name, max_tokens=LENGTH)
    assert [t["token_id"] for t in tokens] == ids["fact"]
    assert all(t["neighbours"][0]["document"] == document and t["neighbours"][0]["id"] == f"fact-{name}" for t in tokens)

    if forget_with == "route":
        response = admin(server, "DELETE", f"/datastores/{name}/documents/{document}")
        assert response.status_code == 200, response.text
    else:
        forgot = subprocess.run(
            [sys.executable, "-m", "index_builder.cli", "forget", str(root / name), "--document", str(document)],
            capture_output=True,
            text=True,
        )
        assert forgot.returncode == 0, forgot.stderr
        assert admin(server, "POST", "/datastores", name=name, path=name).status_code == 200

    gone = listed(server, name)
    assert gone["documents"] == before["documents"] and gone["forgotten"] == 1 and gone["last_forget"] is not None
    assert gone["tombstone_share"] == pytest.approx(job["record"]["entries"] / gone["entries"], abs=1e-6)
    for pointers in (0, 1):
        assert answer(server, ids, name, knn_pointers=pointers) != ids["fact"]
    scored = explained(server, name, completion=FACT[len(PREFIX) :])  # every step's neighbours, all k of them
    assert all(n.get("document") != document for t in scored for n in t["neighbours"])
    response = requests.get(f"{server.base_url}/v1/knn/documents/{name}/{document}", timeout=30)
    assert response.status_code == 410 and "was forgotten" in response.text


def test_sixteen_streaming_clients_through_an_add_and_a_forget_see_no_failure_and_no_mixed_answer(server, ids):
    plain = answer(server, ids, "flat")

    def add_then_forget():
        job = add_fact(server, "flat", "streamed")
        until(lambda: answer(server, ids, "flat") == ids["fact"], 30, "the added fact was never served")
        response = admin(server, "DELETE", f"/datastores/flat/documents/{job['record']['first_document']}")
        assert response.status_code == 200, response.text

    results, errors = stream_while(server, ids["prompt"], LENGTH, add_then_forget, xargs={"knn_datastore": "flat"})
    assert errors == []
    assert ids["fact"] in results and plain in results
    mixed = [r for r in results if r not in (ids["fact"], plain)]
    assert mixed == [], f"{len(mixed)} responses mix two datastore versions"


@pytest.mark.parametrize(
    "method, route, body, status, message",
    [
        ("DELETE", "/datastores/flat/documents/999", {}, 404, "document 999 does not exist"),
        ("DELETE", "/datastores/nope/documents/0", {}, 404, "no datastore named 'nope'"),
        ("POST", "/datastores/flat/documents", {"paths": []}, 400, "nothing to add"),
        ("POST", "/datastores/flat/documents", {"paths": ["../../etc"]}, 403, "outside the datastore root"),
        ("POST", "/datastores/flat/documents", {"paths": ["missing.txt"]}, 404, "does not exist"),
        ("POST", "/datastores/flat/documents", {"texts": [{"text": ""}]}, 400, "texts.0.text"),
    ],
    ids=["unknown-document", "unknown-datastore", "empty-add", "outside-root", "missing-file", "empty-text"],
)
def test_bad_document_requests_get_a_clear_4xx_and_change_nothing(server, ids, method, route, body, status, message):
    version = listed(server, "flat")["version"]
    response = admin(server, method, route, **body)
    assert response.status_code == status and message in response.text, response.text
    assert listed(server, "flat")["version"] == version
    assert len(answer(server, ids, "flat")) == LENGTH  # still serving
