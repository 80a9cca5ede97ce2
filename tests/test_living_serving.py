"""Add and forget documents of a serving datastore through the admin API (and `knnlm-index forget`
beside it), under traffic: real server, Ray shard actors with replicas, flat and IVF-PQ FAISS."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import psutil
import pytest
import requests
from conftest import TINY_SERVER, admin_knn, continuations, greedy, stream_while, until
from test_index_builder import write_corpus
from test_living_datastores import document_keys, held_near, nearest

from index_builder.build import build_datastore
from knnlm_core.config import BuildConfig
from knnlm_core.datastore import manifest_sha256, read_manifest
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
    knn = admin_knn(root, TOKEN, datastores={"flat": str(root / "flat"), "pq": str(root / "pq")}, replicas=2, follow_changes_s=1.0)
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


def actor_pids(server, name: str) -> dict[tuple[str, int], int]:
    """(shard, replica) -> the pid of the actor serving it in the serving version of `name`."""
    shards = [s for s in admin(server, "GET", "/health").json()["shards"] if s["datastore"] == name]
    assert all(s["status"] == "ok" for s in shards), json.dumps(shards)
    return {(s["shard"], s["replica"]): s["pid"] for s in shards}


@pytest.mark.parametrize("name, forget_with", [("flat", "route"), ("pq", "cli-on-disk")])
def test_an_added_fact_is_served_and_explained_then_forgotten_on_every_path(server, root, ids, name, forget_with):
    assert answer(server, ids, name) != ids["fact"]
    before, pids = listed(server, name), actor_pids(server, name)

    job = add_fact(server, name, f"fact-{name}")

    document = job["record"]["first_document"]
    added = actor_pids(server, name)
    assert {shard: added[shard] for shard in pids} == pids  # the add's new version kept the old shards' actors
    assert len(added) > len(pids)
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
        assert forgot.returncode == 0, forgot.stderr  # as another server's forget would: the server follows it
        until(lambda: listed(server, name)["forgotten"] == 1, 60, "the forget on disk was never served (knn.follow_changes_s)")

    forgot = actor_pids(server, name)  # the fact is in the add's new shard: only its actors are new
    assert {shard: pid == added[shard] for shard, pid in forgot.items()} == {shard: shard in pids for shard in added}
    gone = listed(server, name)
    assert gone["documents"] == before["documents"] and gone["forgotten"] == 1 and gone["last_forget"] is not None
    assert gone["tombstone_share"] == pytest.approx(job["record"]["entries"] / gone["entries"], abs=1e-6)
    for pointers in (0, 1):
        assert answer(server, ids, name, knn_pointers=pointers) != ids["fact"]
    scored = explained(server, name, completion=FACT[len(PREFIX) :])  # every step's neighbours, all k of them
    assert all(n.get("document") != document for t in scored for n in t["neighbours"])
    response = requests.get(f"{server.base_url}/v1/knn/documents/{name}/{document}", timeout=30)
    assert response.status_code == 410 and "was forgotten" in response.text
    # the versions before are released, and the actors the serving one kept from them live on
    until(
        lambda: [d["status"] for d in admin(server, "GET", "/datastores").json()["datastores"] if d["name"] == name] == ["serving"],
        60,
        "never released",
    )
    assert actor_pids(server, name) == forgot and answer(server, ids, name) != ids["fact"]
    if forget_with == "cli-on-disk":  # a load through the admin API starts every actor afresh
        assert admin(server, "POST", "/datastores", name=name, path=name).status_code == 200
        assert set(actor_pids(server, name).values()).isdisjoint(forgot.values())


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
    "method, route, body, status, message, param",
    [
        ("DELETE", "/datastores/flat/documents/999", {}, 404, "document 999 does not exist", None),
        ("DELETE", "/datastores/nope/documents/0", {}, 404, "no datastore named 'nope'", None),
        ("POST", "/datastores/flat/documents", {"paths": []}, 400, "nothing to add", None),
        ("POST", "/datastores/flat/documents", {"paths": ["../../etc"]}, 403, "outside the datastore root", "paths"),
        ("POST", "/datastores/flat/documents", {"paths": ["missing.txt"]}, 404, "below knn.datastore_root", "paths"),
        ("POST", "/datastores/flat/documents", {"texts": [{"text": ""}]}, 400, "texts.0.text", "texts.0.text"),
    ],
    ids=["unknown-document", "unknown-datastore", "empty-add", "outside-root", "missing-file", "empty-text"],
)
def test_bad_document_requests_get_a_clear_4xx_and_change_nothing(server, ids, method, route, body, status, message, param):
    version = listed(server, "flat")["version"]
    response = admin(server, method, route, **body)
    assert response.status_code == status and message in response.text, response.text
    assert response.json()["error"]["param"] == param, response.text
    assert listed(server, "flat")["version"] == version
    assert len(answer(server, ids, "flat")) == LENGTH  # still serving


def files_holding(root: Path, data: bytes) -> list[str]:
    """Every file below `root` (hidden ones too) whose bytes contain `data`."""
    return [str(p.relative_to(root)) for p in sorted(root.rglob("*")) if p.is_file() and data in p.read_bytes()]


def job_of(server, response) -> dict:
    assert response.status_code == 202, response.text
    job = response.json()
    until(lambda: admin(server, "GET", f"/jobs/{job['id']}").json()["state"] != "running", 300, "the job never finished")
    return admin(server, "GET", f"/jobs/{job['id']}").json()


@pytest.mark.parametrize("name, erase", [("flat", True), ("pq", False)])
def test_a_forgotten_secret_leaves_no_copy_below_the_datastore_root(server, root, tiny_model_dir, name, erase):
    secret = f"The override passphrase for vault {uuid.uuid4().hex} is {uuid.uuid4().hex}."
    texts = [{"text": secret, "id": f"secret-{name}"}]
    added = admin(server, "POST", f"/datastores/{name}/documents", texts=texts)
    refused = admin(server, "POST", f"/datastores/{name}/documents", texts=texts)  # while the add holds the slot
    assert refused.status_code == 429, refused.text
    job = job_of(server, added)
    assert job["state"] == "done", job["error"]
    document = job["record"]["first_document"]
    assert files_holding(root, secret.encode()) != []  # the check below can fail: the server keeps the texts while served
    duplicate = job_of(server, admin(server, "POST", f"/datastores/{name}/documents", texts=texts))
    assert duplicate["state"] == "failed" and "already in the datastore" in duplicate["error"]
    keys = document_keys(tiny_model_dir, secret)[1:]  # the first key follows "The" alone, as other documents' do
    if erase:
        assert held_near(root / name, keys).all()

    response = admin(server, "DELETE", f"/datastores/{name}/documents/{document}?erase={str(erase).lower()}")

    assert response.status_code == 200, response.text
    record = response.json()["record"]
    assert response.json()["untouched"] == [] and len(record["erased_texts"]) == 1
    assert files_holding(root, secret.encode()) == []
    assert (record["erased_codes"] != []) == erase
    if erase:  # its key vectors (recomputed with the model) are in no shard file of the serving version
        assert not held_near(root / name, keys).any()
    assert not (root / f".{name}.partial").exists()


def add_children(server) -> list[psutil.Process]:
    """The server's running `knnlm-index add` processes (the admin route's jobs)."""
    found = []
    for child in psutil.Process(server.proc.pid).children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):  # a child that ended meanwhile
            if {"index_builder.cli", "add"} <= set(child.cmdline()):
                found.append(child)
    return found


def test_an_add_holds_the_datastore_from_its_answer_on_and_a_killed_one_leaves_no_texts_file_and_no_work_directory(server, root):
    """From the 202 on, the datastore's writer lock is held (by the job, then for its child): no
    other process's writer or start-up sweep comes in before the child has started."""
    from index_builder.versions import being_written

    folder, version = root / ".knnlm-added/flat", manifest_sha256(root / "flat")
    before = set(folder.glob("*")) if folder.exists() else set()
    long = " ".join(f"The ocelot counted stone {n} of the lighthouse wall." for n in range(60_000))  # ~3 MB: tens of seconds to encode
    texts = [{"text": FACT.replace("zebra", "ocelot"), "id": "killed"}, {"text": long}]
    response = admin(server, "POST", "/datastores/flat/documents", texts=texts)
    assert response.status_code == 202, response.text
    assert being_written(root / "flat")
    children = []
    until(lambda: children.extend(add_children(server)) or children, 60, "the add's child process never started")
    children[0].suspend()
    assert manifest_sha256(root / "flat") == version, "the child published before it was stopped: the test's text is too short"
    assert set(folder.glob("*")) - before  # its texts file was written
    children[0].kill()
    job = job_of(server, response)
    assert job["state"] == "failed"
    assert set(folder.glob("*")) == before and not (root / ".flat.partial").exists()
    assert not being_written(root / "flat")  # released with the job
    assert manifest_sha256(root / "flat") == version


def test_an_add_whose_child_fails_after_publishing_serves_its_version_and_keeps_its_texts(server, root):
    """`recalibrate` runs after the add's version is published: with the build's corpus gone it
    fails, and the documents stay added, served, and explained from the texts kept for them."""
    text = "The harbour bell of Saltmarsh rings twice at dusk, once for the boats and once for the gulls."
    before, corpus = listed(server, "flat"), root / "corpus"
    corpus.rename(root / "corpus-away")
    try:
        job = job_of(server, admin(server, "POST", "/datastores/flat/documents", texts=[{"text": text, "id": "bell"}], recalibrate=True))
    finally:
        (root / "corpus-away").rename(corpus)
    assert job["state"] == "failed"
    assert "the documents were added, but recalibrating failed" in job["error"] and "is gone" in job["error"], job["error"]
    assert f"its new version {job['version']} was written before that and serves" in job["error"], job["error"]
    served = listed(server, "flat")
    assert served["version"] == job["version"] == before["version"] + 1 and served["documents"] == before["documents"] + 1
    (source,) = job["record"]["sources"]
    assert (root / source).is_file() and not (root / ".flat.partial").exists()
    document = requests.get(f"{server.base_url}/v1/knn/documents/flat/{job['record']['first_document']}", timeout=30).json()
    assert (document["id"], document["text"]) == ("bell", text)


def test_the_compact_route_serves_what_knnlm_index_compact_makes_under_sixteen_streaming_clients(server, root, ids):
    copy = root / "pq-compacted-offline"
    shutil.copytree(root / "pq", copy)
    assert listed(server, "pq")["forgotten"] > 0  # tombstones to fold (from the forgets above)
    offline = subprocess.run([sys.executable, "-m", "index_builder.cli", "compact", str(copy), "--quiet"], capture_output=True, text=True)
    assert offline.returncode == 0, offline.stderr
    version = listed(server, "pq")["version"]
    jobs = []

    results, errors = stream_while(
        server,
        ids["prompt"],
        LENGTH,
        lambda: jobs.append(job_of(server, admin(server, "POST", "/datastores/pq/compact"))),
        xargs={"knn_datastore": "pq"},
    )

    assert errors == [] and jobs[0]["state"] == "done", jobs[0]["error"]
    served = listed(server, "pq")
    assert served["version"] == jobs[0]["version"] == version + 1 and served["forgotten"] == 0 and served["tombstone_share"] == 0
    manifest, expected = read_manifest(root / "pq"), read_manifest(copy)
    assert manifest.entries == expected.entries and [s.entries for s in manifest.shards] == [s.entries for s in expected.shards]
    queries = np.random.default_rng(0).standard_normal((32, manifest.dim)).astype(np.float32)
    for a, b in zip(nearest(root / "pq", queries, 8), nearest(copy, queries, 8)):
        assert np.array_equal(a, b)


@pytest.mark.parametrize(
    "method, route, body, message",
    [
        ("POST", "/datastores", {"name": "flat", "path": "flat", "default": "maybe"}, "default: Input should be a valid boolean"),
        ("POST", "/datastores", {"name": "flat2", "path": "flat", "default": "yes"}, "default: Input should be a valid boolean"),
        ("PUT", "/default", {"name": 3}, "name: Input should be a valid string"),
        ("POST", "/datastores/flat/compact", {"shards": 0}, "shards: Input should be greater than 0"),
        ("POST", "/datastores/flat/compact", {"shards": "2"}, "shards: Input should be a valid integer"),
        ("POST", "/datastores/flat/compact", {"shards": 10**6}, "shards: 1000000 is more than the"),
        (
            "POST",
            "/datastores/flat/documents",
            {"texts": [{"text": "x"}], "recalibrate": "yes"},
            "recalibrate: Input should be a valid boolean",
        ),
    ],
    ids=[
        "load-default",
        "load-default-yes",
        "default-name",
        "compact-shards",
        "compact-shards-text",
        "compact-shards-beyond-entries",
        "add-recalibrate-yes",
    ],
)
def test_admin_body_errors_are_400s_naming_the_field(server, method, route, body, message):
    response = admin(server, method, route, **body)
    assert response.status_code == 400 and message in response.text, response.text
    assert response.json()["error"]["param"] == message.split(":")[0]  # as the completion routes name theirs


@pytest.mark.parametrize(
    "method, route, body, message",
    [
        ("POST", "/datastores/flat/compact", "[1]", "body: Input should be a valid dictionary"),
        ("POST", "/datastores/flat/compact", "{", "body is not valid JSON"),
        ("DELETE", "/datastores/flat/documents/first", None, "document: Input should be a valid integer"),
        ("DELETE", "/datastores/flat/documents/0?erase=maybe", None, "erase: Input should be a valid boolean"),
        ("POST", "/explain", '{"prompt": "x", "knn_context": 1}', "knn_context: Extra inputs are not permitted"),
    ],
    ids=["body-not-an-object", "body-not-json", "document-not-a-number", "erase-maybe", "explain-unknown-field"],
)
def test_requests_the_routes_cannot_parse_are_400s_naming_the_field(server, method, route, body, message):
    """Caught before the route runs (FastAPI's own parsing), and answered in the same format."""
    before = admin(server, "GET", "/datastores").json()
    response = requests.request(
        method,
        f"{server.base_url}/v1/knn{route}",
        data=body,
        headers={"X-Admin-Token": TOKEN, "Content-Type": "application/json"},
        timeout=60,
    )
    assert response.status_code == 400 and message in response.json()["error"]["message"], response.text
    assert response.json()["error"]["param"] == message.split(":")[0].split(" ")[0], response.text
    assert admin(server, "GET", "/datastores").json() == before  # nothing forgotten


def test_explain_refuses_a_null_knob_naming_it_as_the_completion_routes_do(server):
    response = requests.post(
        f"{server.base_url}/v1/knn/explain",
        json={"prompt": PREFIX, "vllm_xargs": {"knn_datastore": "flat", "knn_pointers": None}},
        timeout=60,
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "vllm_xargs.knn_pointers", response.text


def test_an_add_whose_datastore_is_unloaded_meanwhile_keeps_the_texts_its_version_names_and_says_how_to_serve_it(server, root, ids):
    """The add's child puts its version in the datastore's directory before the server loads it;
    that version names the texts file, so a load that fails then keeps the file."""
    response = admin(server, "POST", "/datastores/flat/documents", texts=[{"text": FACT, "id": "while-unloaded"}])
    assert admin(server, "DELETE", "/datastores/flat").status_code == 200
    job = job_of(server, response)
    assert job["state"] == "failed" and "the new version is in flat, not serving: POST /v1/knn/datastores serves it" in job["error"]
    (source,) = job["record"]["sources"]
    assert source.startswith(".knnlm-added/flat/") and (root / source).is_file()  # shown below the root, not as a server path

    assert admin(server, "POST", "/datastores", name="flat", path="flat", default=True).status_code == 200
    assert answer(server, ids, "flat") == ids["fact"]
    document = requests.get(f"{server.base_url}/v1/knn/documents/flat/{job['record']['first_document']}", timeout=30).json()
    assert (document["id"], document["text"]) == ("while-unloaded", FACT)


def test_a_broken_version_written_into_a_serving_directory_is_logged_and_not_followed(server, root, ids):
    """knn.follow_changes_s: a new manifest that fails the load's checks leaves the serving version serving."""
    manifest = root / "flat" / "manifest.json"
    good, before, served = manifest.read_bytes(), listed(server, "flat"), answer(server, ids, "flat")

    def refusals() -> int:
        return server.log_path.read_text().count("a new version that does not serve")

    logged = refusals()
    broken = json.loads(good)
    broken["shards"][0]["values"]["sha256"] = "0" * 64
    staged = manifest.with_suffix(".staged")
    try:
        staged.write_text(json.dumps(broken))
        staged.replace(manifest)  # as a writer's atomic rename would
        until(lambda: refusals() > logged, 30, "the follower never logged the new version it refused")
        assert listed(server, "flat") == before and answer(server, ids, "flat") == served
        assert admin(server, "GET", "/health").json()["healthy"]
    finally:
        staged.write_bytes(good)
        staged.replace(manifest)
    time.sleep(3)  # three of the follower's checks: the version it serves is on disk again, nothing to load
    assert listed(server, "flat")["version"] == before["version"] and refusals() == logged + 1


def test_a_datastore_another_process_is_changing_refuses_add_forget_and_compact_with_429s_and_keeps_nothing(server, root):
    """Another server sharing the directory, or knnlm-index, holds the datastore's writer lock."""
    from index_builder.versions import writer_lock

    before, texts = listed(server, "flat"), root / ".knnlm-added" / "flat"
    kept = sorted(texts.iterdir()) if texts.exists() else []
    calls = [
        ("POST", "/datastores/flat/documents", {"texts": [{"text": "a text that must not be kept"}]}),
        ("DELETE", "/datastores/flat/documents/0", {}),
        ("POST", "/datastores/flat/compact", {}),
    ]
    with writer_lock(root / "flat"):
        for method, route, body in calls:
            response = admin(server, method, route, **body)
            assert response.status_code == 429 and "being changed by another process" in response.text, response.text
    assert listed(server, "flat") == before
    assert (sorted(texts.iterdir()) if texts.exists() else []) == kept
