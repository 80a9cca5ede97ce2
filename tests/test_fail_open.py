"""kNN never takes the server down: faults in the per-step path serve LM-only, every datastore file
is checked at load, knob types are taken as the client sent them, names and paths are checked, and
explanations are whole or refused (real server, Ray shard actors, FAISS)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading

import numpy as np
import openai
import psutil
import pytest
import requests
from conftest import TINY_SERVER, continuations, greedy, stream_while, until
from datastore_edits import calibrated, rewritten, save

from index_builder.build import build_datastore
from knnlm_core.config import BuildConfig
from knnlm_serve.server.process import RunningServer, scrape_metrics

pytestmark = pytest.mark.slow

PREFIX = "The archivist of the old observatory noted on a card pinned above the door that in spring"
ENDINGS = (
    ("a", "the swallows nested under the dome and the great brass telescope was never moved."),
    ("p", "a comet crossed the northern sky for nine nights and the villagers rang every bell."),
)
TEXTS = {name: f"{PREFIX} {ending}" for name, ending in ENDINGS}
TOKEN = "s3cret-admin-token"
CONTINUATION = 12
BAD_STORES = {
    # name: (edit, the file and field the refusal must name)
    "documents-object": (lambda d, m: save(d / "documents.npy", np.array([0, "x"], dtype=object)), "documents.npy"),
    "documents-length": (lambda d, m: save(d / "documents.npy", np.array([0, 3, 5], dtype=np.int64)), "documents.npy"),
    "provenance-json": (lambda d, m: (d / "provenance.json").write_text("{not json"), "provenance.json"),
    "provenance-columns": (
        lambda d, m: (d / "provenance.json").write_text(json.dumps({**json.loads((d / "provenance.json").read_text()), "sha256": []})),
        "provenance.json",
    ),
    "calibration-nan": (calibrated(temperature=float("nan")), "calibration.temperature"),
    "calibration-inf": (calibrated(temperature=float("inf")), "calibration.temperature"),
    "calibration-range": (calibrated(**{"lambda": 1.5}), "calibration.lambda"),
}


@pytest.fixture(scope="module")
def root(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("datastores")
    config = BuildConfig(index="flat", context_length=128, stride=64)
    for name, text in TEXTS.items():
        (root / f"{name}.txt").write_text(text)
        build_datastore([root / f"{name}.txt"], root / name, tiny_model_dir, config, progress=False)
    shutil.copytree(root / "p", root / "p-pristine")
    for name, (edit, _) in BAD_STORES.items():
        rewritten(root, name, "a", edit)
    rewritten(
        root,
        "beyond-limits",
        "a",
        calibrated(k=4096, pointers={"min_pointers": 5000, "saved": 0.5, "ppl": 10.0, "full_ppl": 10.0, "tolerance": 0.005}),
    )
    return root


@pytest.fixture(scope="module")
def server(tiny_model_dir, root):
    knn = {
        "datastores": {"a": str(root / "a"), "p": str(root / "p")},
        "k": 8,
        "lambda": 1.0,
        "admin_token": TOKEN,
        "datastore_root": str(root),
        "fail_open": True,  # what these tests test (the suite's other servers turn it off)
        "draft_tokens": 4,  # and the datastore drafter's faults
    }
    with RunningServer({**TINY_SERVER, "model": str(tiny_model_dir), "knn": knn}, root) as server:
        yield server


@pytest.fixture(scope="module")
def ids(tiny_model_dir):
    return continuations(tiny_model_dir, PREFIX, TEXTS, CONTINUATION)


def admin(server, method, route, **body):
    return requests.request(method, f"{server.base_url}/v1/knn{route}", json=body or None, headers={"X-Admin-Token": TOKEN}, timeout=120)


def listed(server, name: str) -> dict:
    return next(d for d in admin(server, "GET", "/datastores").json()["datastores"] if d["name"] == name and d["status"] == "serving")


def test_a_file_broken_after_load_is_served_lm_only_and_marked_unhealthy_until_reloaded(server, root, ids):
    """documents.npy of datastore p is replaced by an object array after p was loaded and checked;
    the workers read it at p's first pointer-following request."""
    # No pointers and no drafts (both read documents.npy): not read yet.
    assert greedy(server, ids["prompt"], CONTINUATION, knn_datastore="p", knn_drafts=False).token_ids == ids["p"]
    plain = greedy(server, ids["prompt"], CONTINUATION, knn=False)
    save(root / "p" / "documents.npy", np.array([0, "x"], dtype=object))
    before = scrape_metrics(server.base_url)

    def meanwhile():
        for _ in range(3):
            broken = greedy(server, ids["prompt"], CONTINUATION, knn_datastore="p", knn_pointers=1)
            assert broken.token_ids == plain.token_ids  # served LM-only, exactly as kNN off
            assert np.allclose(broken.logprobs.token_logprobs, plain.logprobs.token_logprobs, atol=1e-5)
            assert greedy(server, ids["prompt"], CONTINUATION, knn_datastore="a").token_ids == ids["a"]  # the other keeps kNN

    results, errors = stream_while(server, ids["prompt"], CONTINUATION, meanwhile, xargs={"knn_datastore": "p", "knn_pointers": 1})
    assert errors == [] and results and all(r == plain.token_ids for r in results)
    after = scrape_metrics(server.base_url)
    key = 'knnlm_fallbacks_total{datastore="p",reason="error"}'
    assert after.get(key, 0) - before.get(key, 0) >= 3

    until(lambda: not listed(server, "p")["healthy"], 30, "p was never reported unhealthy")
    assert "documents.npy" in listed(server, "p")["error"] and listed(server, "a")["healthy"]
    health = admin(server, "GET", "/health").json()
    assert not health["healthy"] and {d["name"]: d["healthy"] for d in health["datastores"]} == {"a": True, "p": False}
    assert scrape_metrics(server.base_url)['knnlm_datastore_healthy{datastore="p"}'] == 0
    stopped = 'knnlm_fallbacks_total{datastore="p",reason="unhealthy"}'
    before = scrape_metrics(server.base_url).get(stopped, 0)
    stopped_request = greedy(server, ids["prompt"], CONTINUATION, knn_datastore="p", knn_pointers=1, knn_drafts=False)
    assert stopped_request.token_ids == plain.token_ids
    assert scrape_metrics(server.base_url)[stopped] - before == CONTINUATION  # not tried again: one stopped row a step (no draft rows)

    # Fixed on disk and reloaded: a new version, healthy, with kNN again.
    shutil.copy(root / "p-pristine" / "documents.npy", root / "p" / "documents.npy")
    assert admin(server, "POST", "/datastores", name="p", path="p").status_code == 200
    assert listed(server, "p")["healthy"] and scrape_metrics(server.base_url)['knnlm_datastore_healthy{datastore="p"}'] == 1
    assert greedy(server, ids["prompt"], CONTINUATION, knn_datastore="p", knn_pointers=1).token_ids == ids["p"]
    assert admin(server, "GET", "/health").json()["healthy"]


def test_a_drafter_fault_serves_the_step_without_drafts(server, root, ids):
    """values.npy of a loaded copy of datastore a grows on disk after load: drafting from it fails
    at every step (it is read only for drafts), which then has none, counted; kNN serves on, the
    engine too, and the other datastore's drafts go on."""
    shutil.copytree(root / "a", root / "grown")
    assert admin(server, "POST", "/datastores", name="grown", path="grown").status_code == 200
    with open(root / "grown" / "shard-000" / "values.npy", "ab") as f:
        f.write(b"\0" * 4)
    drafts = lambda values, name: values.get(f'knnlm_drafts_total{{datastore="{name}",source="datastore"}}', 0)  # noqa: E731
    before = scrape_metrics(server.base_url)
    assert greedy(server, ids["prompt"], CONTINUATION, knn_datastore="grown").token_ids == ids["a"]
    failed = scrape_metrics(server.base_url)
    assert greedy(server, ids["prompt"], CONTINUATION, knn_datastore="a").token_ids == ids["a"]
    after = scrape_metrics(server.base_url)
    assert failed.get("knnlm_draft_failures_total", 0) - before.get("knnlm_draft_failures_total", 0) >= 1
    assert drafts(failed, "grown") == 0 and drafts(after, "a") > drafts(failed, "a")
    assert admin(server, "DELETE", "/datastores/grown").status_code == 200


@pytest.mark.parametrize("name", sorted(BAD_STORES))
def test_each_bad_datastore_file_is_refused_at_load_naming_the_file_and_field(server, ids, name):
    def serving() -> dict:  # versions an earlier test retired may finish draining meanwhile
        listing = admin(server, "GET", "/datastores").json()
        return {**listing, "datastores": [d for d in listing["datastores"] if d["status"] == "serving"]}

    before = serving()
    response = admin(server, "POST", "/datastores", name="a", path=name)
    assert response.status_code == 422, response.text
    assert BAD_STORES[name][1] in response.json()["error"]["message"]
    assert serving() == before
    assert greedy(server, ids["prompt"], CONTINUATION, knn_datastore="a").token_ids == ids["a"]


def started(tiny_model_dir, datastore, work) -> str:
    """The log of a server started with `datastore` configured, which must fail to start and leave
    none of vLLM's engine processes running."""
    knn = {"datastores": {"a": str(datastore)}, "fail_open": False}
    server = RunningServer({**TINY_SERVER, "model": str(tiny_model_dir), "knn": knn}, work, startup_timeout=300)
    with pytest.raises(RuntimeError, match="server exited"):
        server.__enter__()

    def engines() -> list[str]:  # the server's session: it was started as a session leader
        names = []
        for p in psutil.process_iter(["name"]):
            with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError):
                if os.getsid(p.pid) == server.proc.pid and p.info["name"].startswith("VLLM::"):
                    names.append(p.info["name"])
        return names

    until(lambda: not engines(), 30, f"engine processes left running: {engines()}")
    return server.log_path.read_text()


def test_a_configured_datastore_with_a_bad_manifest_is_refused_before_ray_and_vllm_start(tiny_model_dir, root, tmp_path):
    log = started(tiny_model_dir, root / "calibration-range", tmp_path)
    assert "knnlm-serve: error: knn.datastores.a: " in log and "calibration.lambda" in log  # the config's field
    assert "Started a local Ray instance" not in log and "Initializing a V1 LLM engine" not in log


def test_a_configured_datastore_with_a_bad_file_stops_the_start_naming_it(tiny_model_dir, root, tmp_path):
    """Checksums, provenance and shard actors are checked while vLLM starts its engine; a failure
    stops that start at once, before the model is loaded."""
    log = started(tiny_model_dir, root / "provenance-json", tmp_path)
    assert "knnlm-serve: error:" in log and "provenance.json" in log
    assert "Loading weights took" not in log and "Starting vLLM server" not in log


def test_a_calibration_beyond_this_servers_limits_is_held_to_them(server, ids):
    response = admin(server, "POST", "/datastores", name="wide", path="beyond-limits")
    assert response.status_code == 200, response.text
    defaults = listed(server, "wide")["defaults"]
    assert defaults["k"] == 2048 and defaults["min_pointers"] == 2048  # knn.max_k
    assert "exceeds knn.max_k" in server.log_tail(100_000)
    out = greedy(server, ids["prompt"], CONTINUATION, knn_datastore="wide")  # no knob sent: no 400 about one
    assert out.token_ids == greedy(server, ids["prompt"], CONTINUATION, knn_datastore="a", knn_k=2048).token_ids
    assert admin(server, "DELETE", "/datastores/wide").status_code == 200


@pytest.mark.parametrize(
    "xargs, field",
    [
        ({"knn_skip_threshold": False}, "knn_skip_threshold"),
        ({"knn_pointers": True}, "knn_pointers"),
        ({"knn_lambda": True}, "knn_lambda"),
        ({"knn_k": 8.0}, "knn_k"),
        ({"knn": 1}, "knn"),
        ({"knn": "yes"}, "knn"),
    ],
)
@pytest.mark.parametrize("route", ["completions", "chat"])
def test_knob_types_are_taken_as_the_client_sent_them(server, xargs, field, route):
    client = server.openai_client()
    with pytest.raises(openai.BadRequestError) as refused:
        if route == "completions":
            client.completions.create(model="tiny", prompt="Hello", max_tokens=2, extra_body={"vllm_xargs": xargs})
        else:
            client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=2, extra_body={"vllm_xargs": xargs}
            )
    assert refused.value.status_code == 400 and f"vllm_xargs.{field}" in str(refused.value)
    assert client.completions.create(model="tiny", prompt="Hello", max_tokens=2, extra_body={"vllm_xargs": {"knn": True, "knn_k": 4}})


@pytest.mark.parametrize("name", ["..", ".", "a.b", "a\n", "has space", "", "x" * 65])
def test_datastore_names_are_letters_digits_dashes_and_underscores(server, name):
    response = admin(server, "POST", "/datastores", name=name, path="a")
    assert response.status_code == 400, response.text
    assert "name" in response.json()["error"]["message"]
    assert all(d["name"] != name for d in admin(server, "GET", "/datastores").json()["datastores"])


def test_unusable_paths_are_a_400_naming_path_and_no_route_answers_for_a_refused_name(server):
    response = admin(server, "POST", "/datastores", name="nul", path="a\x00b")
    assert response.status_code == 400 and "path" in response.json()["error"]["message"], response.text
    assert requests.get(f"{server.base_url}/v1/knn/documents/%2E%2E/0", timeout=30).status_code == 404


def test_concurrent_explanations_are_whole_or_refused_with_a_reason(server):
    statuses, bodies, lock = [], [], threading.Lock()

    def explain():
        response = requests.post(f"{server.base_url}/v1/knn/explain", json={"prompt": PREFIX, "max_tokens": 8}, timeout=300)
        with lock:
            statuses.append(response.status_code)
            bodies.append(response.json())

    threads = [threading.Thread(target=explain) for _ in range(80)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(statuses) <= {200, 429} and 200 in statuses
    for status, body in zip(statuses, bodies):
        if status == 200:
            assert len(body["tokens"]) == 8
            assert all(t["status"] == "searched" and t["neighbours"] for t in body["tokens"])
        else:
            assert "explanations are running" in body["error"]["message"]


def test_no_response_error_or_metric_shows_the_admin_token_or_a_server_path(server, root, ids):
    shown = [
        admin(server, "GET", "/datastores").text,
        admin(server, "GET", "/health").text,
        admin(server, "POST", "/datastores", name="a", path="documents-object").text,
        admin(server, "POST", "/datastores", name="a", path="missing").text,
        admin(server, "DELETE", "/datastores/nothing").text,
        requests.post(f"{server.base_url}/v1/knn/explain", json={"prompt": PREFIX, "max_tokens": 2}, timeout=120).text,
        requests.get(f"{server.base_url}/v1/knn/documents/a/0", timeout=30).text,
        requests.get(f"{server.base_url}/v1/knn/documents/a/99", timeout=30).text,
        requests.get(f"{server.base_url}/metrics", timeout=30).text,
    ]
    for text in shown:
        assert TOKEN not in text and str(root) not in text
    assert listed(server, "a")["path"] == "a"
