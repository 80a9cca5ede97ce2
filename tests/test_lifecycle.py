"""Datastores under traffic: hot-swap, shard faults, admin API errors, metrics (real server, Ray, FAISS)."""

from __future__ import annotations

import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import requests
from conftest import TINY_SERVER, admin_knn, continuations, greedy, make_tiny_llama, prompt_logprobs, stream_while

from index_builder.build import build_datastore
from knnlm_core.config import BuildConfig
from knnlm_serve.server.process import RunningServer, scrape_metrics

pytestmark = pytest.mark.slow

PREFIX = "The keeper of the lighthouse on the western cape wrote in the log that at midnight"
TEXT_A = PREFIX + " a silver ship without sails drifted past the rocks and vanished into the fog."
TEXT_B = PREFIX + " the great lamp went dark for an hour while wolves sang on the frozen beach."
TOKEN = "s3cret"
CONTINUATION = 12


@pytest.fixture(scope="module")
def root(tiny_model_dir, tmp_path_factory, smollm2_dir):
    root = tmp_path_factory.mktemp("datastores")
    config = BuildConfig(index="flat", context_length=128, stride=64)
    for name, text, extra in (("a", TEXT_A, {"shards": 2}), ("b", TEXT_B, {}), ("a-final", TEXT_A, {"key_type": "final"})):
        (root / f"{name}.txt").write_text(text)
        build_datastore([root / f"{name}.txt"], root / name, tiny_model_dir, config.model_copy(update=extra), progress=False)
    other_model = make_tiny_llama(tmp_path_factory.mktemp("other-model"), smollm2_dir, seed=1)
    build_datastore([root / "a.txt"], root / "other-model", other_model, config, progress=False)
    shutil.copytree(root / "a", root / "truncated")
    values = root / "truncated/shard-000/values.npy"
    values.write_bytes(values.read_bytes()[:-16])
    shutil.copytree(root / "a", root / "corrupt")
    index = root / "corrupt/shard-001/index.faiss"
    data = bytearray(index.read_bytes())
    data[-5] ^= 0xFF
    index.write_bytes(bytes(data))
    return root


@pytest.fixture(scope="module")
def server(tiny_model_dir, root):
    """Datastore drafts on (knn.draft_tokens): hot-swaps, explanations and shard faults are tested
    under speculative decoding; compiled graphs where each shard actor has a core to itself."""
    knn = admin_knn(root, TOKEN, draft_tokens=4, compiled_graphs="auto")
    with RunningServer({**TINY_SERVER, "model": str(tiny_model_dir), "knn": knn}, root) as server:
        yield server


@pytest.fixture(scope="module")
def ids(tiny_model_dir):
    return continuations(tiny_model_dir, PREFIX, {"a": TEXT_A, "b": TEXT_B}, CONTINUATION)


def admin(server, method, route, token=TOKEN, **body):
    headers = {"X-Admin-Token": token} if token else {}
    return requests.request(method, f"{server.base_url}/v1/knn{route}", json=body or None, headers=headers, timeout=120)


def complete(server, prompt, **xargs):
    return greedy(server, prompt, CONTINUATION, **xargs).token_ids


def scrape(server) -> dict[str, float]:
    return scrape_metrics(server.base_url)


def total(values: dict[str, float], prefix: str) -> float:
    return sum(v for k, v in values.items() if k.startswith(prefix))


def test_metrics_count_every_knn_step(server, ids):
    before = scrape(server)
    for _ in range(3):
        assert complete(server, ids["prompt"], knn_drafts=False) == ids["a"]
    after = scrape(server)
    # Batch of one, no drafts, no prompt logprobs: one retrieval step per generated token.
    steps = total(after, 'knnlm_retrieval_steps_total{datastore="main"}') - total(before, 'knnlm_retrieval_steps_total{datastore="main"}')
    assert steps == 3 * CONTINUATION
    assert (
        total(after, 'knnlm_neighbours_total{datastore="main"}') - total(before, 'knnlm_neighbours_total{datastore="main"}')
        == 3 * CONTINUATION * 8
    )
    assert total(after, 'knnlm_requests_total{datastore="main"}') - total(before, 'knnlm_requests_total{datastore="main"}') == 3
    entries = server_entries(server)
    (info,) = [k for k, v in after.items() if k.startswith('knnlm_datastore_info{datastore="main"') and v == 1]
    assert f'entries="{entries}"' in info and 'key_type="ffn_input"' in info and 'shards="2"' in info and 'version="1"' in info
    latency_sum = total(after, 'knnlm_retrieval_seconds_sum{datastore="main"}') - total(
        before, 'knnlm_retrieval_seconds_sum{datastore="main"}'
    )
    assert 0 < latency_sum / steps < 1.0  # seconds per step: positive and plausible
    # What the step waited for (sending the search, then its answer) is within the retrieval's span,
    # and with knn.overlap (the default) the end of the forward pass ran in between: strictly less.
    waits = total(after, 'knnlm_retrieval_wait_seconds_count{datastore="main"}') - total(
        before, 'knnlm_retrieval_wait_seconds_count{datastore="main"}'
    )
    wait_sum = total(after, 'knnlm_retrieval_wait_seconds_sum{datastore="main"}') - total(
        before, 'knnlm_retrieval_wait_seconds_sum{datastore="main"}'
    )
    assert waits == steps and 0 < wait_sum < latency_sum
    # All of kNN's work on each step's path: one observation per step, holding the wait and the mix.
    step_count = total(after, "knnlm_step_seconds_count") - total(before, "knnlm_step_seconds_count")
    step_sum = total(after, "knnlm_step_seconds_sum") - total(before, "knnlm_step_seconds_sum")
    mix_sum = total(after, 'knnlm_interpolation_seconds_sum{datastore="main"}') - total(
        before, 'knnlm_interpolation_seconds_sum{datastore="main"}'
    )
    assert step_count == steps and wait_sum + mix_sum < step_sum < 1.0 * steps
    # The same work part by part (engine/step_clock.py): every part took time, adding up to the whole.
    parts = ("plan", "keys", "send", "confidence", "wait", "neighbours", "mix", "record")

    def part(name: str) -> float:
        return total(after, f'knnlm_step_part_seconds_total{{part="{name}"}}') - total(
            before, f'knnlm_step_part_seconds_total{{part="{name}"}}'
        )

    assert sum(part(p) for p in parts) == pytest.approx(step_sum, rel=1e-6)
    assert part("mix") >= mix_sum and all(part(p) > 0 for p in parts)
    assert total(after, "knnlm_shard_search_seconds_count") > 0


DRAFTED = [{}, {"knn": False}, {"knn_pointers": 1}, {"knn_lambda": 0.5, "knn_k": 2}, {"knn_lambda": 0.3, "knn_skip_threshold": 0.05}]


def test_drafts_change_the_speed_not_the_output(server, ids):
    """With knn.draft_tokens, where the nearest neighbour predicted a request's newest token the
    stored text after it is drafted, and vLLM verifies it against the kNN-LM: at λ 1 on the stored
    text most drafts are accepted (fewer steps than tokens). Where a request repeats its own text
    (the tiny model, kNN off, loops on one token) prompt lookup drafts it, and those drafts are
    accepted too. Greedy tokens and logprobs equal those of the same requests with
    `knn_drafts: false`, for kNN off, pointers, other λ, k and skip thresholds, alone and batched."""
    counted = lambda name, values, datastore="main", source="datastore": total(  # noqa: E731
        values, f'knnlm_{name}_total{{datastore="{datastore}",source="{source}"}}'
    )
    drafts = lambda values: total(values, "knnlm_drafts_total")  # noqa: E731
    steps = lambda values: total(values, 'knnlm_retrieval_steps_total{datastore="main"}')  # noqa: E731
    before = scrape(server)
    expected = [greedy(server, ids["prompt"], CONTINUATION, knn_drafts=False, **x) for x in DRAFTED]
    undrafted = scrape(server)
    assert complete(server, ids["prompt"]) == ids["a"]
    drafted = scrape(server)
    assert drafts(undrafted) == drafts(before)  # knn_drafts false: none proposed, from either source
    stored = [counted(name, drafted) - counted(name, undrafted) for name in ("drafts", "draft_accepted_tokens")]
    assert stored[1] > stored[0] > 0  # over 1 token accepted per datastore draft
    assert steps(drafted) - steps(undrafted) < CONTINUATION
    alone = [greedy(server, ids["prompt"], CONTINUATION, **x) for x in DRAFTED]
    own_text = scrape(server)
    repeated = [
        counted(n, own_text, "none", "context") - counted(n, drafted, "none", "context") for n in ("drafts", "draft_accepted_tokens")
    ]
    assert repeated[1] >= repeated[0] > 0  # the kNN-off request's loop was drafted from its own tokens, and accepted
    with ThreadPoolExecutor(2 * len(DRAFTED)) as pool:
        together = list(pool.map(lambda x: greedy(server, ids["prompt"], CONTINUATION, **x), DRAFTED * 2))
    for want, *got in zip(expected, alone, together, together[len(DRAFTED) :]):
        for choice in got:
            assert choice.token_ids == want.token_ids
            np.testing.assert_allclose(choice.logprobs.token_logprobs, want.logprobs.token_logprobs, atol=1e-4)


def server_entries(server) -> int:
    return admin(server, "GET", "/datastores").json()["datastores"][0]["entries"]


def test_the_knn_page_is_a_404_where_knn_ui_is_off(server):
    assert requests.get(f"{server.base_url}/knn/ui/", timeout=30).status_code == 404


def test_admin_needs_the_admin_token(server):
    assert admin(server, "GET", "/datastores", token=None).status_code == 401
    assert admin(server, "GET", "/datastores", token="wrong").status_code == 401
    listing = admin(server, "GET", "/datastores").json()
    assert listing["default"] == "main" and listing["datastores"][0]["status"] == "serving"
    paths = requests.get(f"{server.base_url}/openapi.json", timeout=30).json()["paths"]
    assert {"/v1/knn/datastores", "/v1/knn/default", "/v1/knn/health"} <= set(paths)


@pytest.mark.parametrize(
    "path, body, status, message, param",
    [
        ("../outside", {}, 403, "outside the datastore root", "path"),
        ("missing", {}, 404, "does not exist", "path"),
        ("other-model", {}, 422, "built for model", "path"),
        ("a-final", {}, 422, "key type", "path"),  # unlike the serving version's: the datastore at path is wrong
        ("b", {"key_type": "final"}, 422, "key type", "key_type"),
        ("truncated", {}, 422, "truncated", "path"),
        ("corrupt", {}, 422, "checksum mismatch", "path"),
    ],
)
def test_bad_loads_are_4xx_naming_the_field_and_leave_serving_unchanged(server, root, ids, path, body, status, message, param):
    before = admin(server, "GET", "/datastores").json()
    response = admin(server, "POST", "/datastores", name="main", path=path, **body)
    assert response.status_code == status, response.text
    assert message in response.json()["error"]["message"] and response.json()["error"]["param"] == param
    assert path in response.json()["error"]["message"] and str(root) not in response.json()["error"]["message"]
    assert admin(server, "GET", "/datastores").json() == before
    assert complete(server, ids["prompt"]) == ids["a"]


def swap_to_b_and_back(server, ids) -> None:
    """Hot-swap `main` to b, then back to a, each once it is seen serving; 2 s of traffic around each."""
    for path, expect in (("b", "b"), ("a", "a")):
        time.sleep(2)
        response = admin(server, "POST", "/datastores", name="main", path=path)
        assert response.status_code == 200, response.text
        deadline = time.monotonic() + 60
        while complete(server, ids["prompt"]) != ids[expect]:
            assert time.monotonic() < deadline, "the swap never took effect"
            time.sleep(0.2)
    time.sleep(2)


def test_swap_twice_under_streaming_load(server, ids):
    results, errors = stream_while(server, ids["prompt"], CONTINUATION, lambda: swap_to_b_and_back(server, ids))
    assert errors == []
    assert len(results) > 16
    mixed = [r for r in results if r not in (ids["a"], ids["b"])]
    assert mixed == [], f"{len(mixed)} responses mix two datastore versions"
    assert ids["b"] in results and ids["a"] in results
    listing = admin(server, "GET", "/datastores").json()
    assert [(d["name"], d["version"], d["status"]) for d in listing["datastores"]][0] == ("main", 3, "serving")
    deadline = time.monotonic() + 30  # retired versions are released once no request uses them
    while len(admin(server, "GET", "/datastores").json()["datastores"]) > 1:
        assert time.monotonic() < deadline, "old versions were never released"
        time.sleep(0.5)
    assert total(scrape(server), 'knnlm_swaps_total{datastore="main",result="swapped"}') >= 2


def test_explanations_come_from_the_version_each_request_was_pinned_to(server, ids):
    """Explained requests under two hot-swaps: each explanation's tokens, datastore version and
    neighbours' documents all belong to one version (a.txt's text, or b.txt's), never a mix."""
    explained, errors, stop = [], [], threading.Event()

    def client():
        while not stop.is_set():
            response = requests.post(
                f"{server.base_url}/v1/knn/explain",
                json={"prompt": PREFIX, "max_tokens": CONTINUATION, "vllm_xargs": {"knn_explain": 2}},
                timeout=120,
            )
            (explained.append(response.json()) if response.status_code == 200 else errors.append(response.text))

    threads = [threading.Thread(target=client) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        swap_to_b_and_back(server, ids)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)
    assert errors == []
    seen = {}
    for body in explained:
        tokens = [t["token_id"] for t in body["tokens"]]
        sources = {n["source"] for t in body["tokens"] for n in t["neighbours"]}
        text = "a" if tokens == ids["a"] else "b" if tokens == ids["b"] else None
        assert text is not None and sources == {f"{text}.txt"}, (tokens, sources)
        assert seen.setdefault(body["datastore"]["version"], text) == text  # one version, one text
    assert set(seen.values()) == {"a", "b"} and len(seen) >= 3


def test_killed_shard_actor_never_fails_a_request_and_recovers(server, ids):
    import os
    import signal

    full_prompt = ids["prompt"] + ids["a"]
    baseline = prompt_logprobs(server, full_prompt, knn_lambda=0.5)
    shard = next(s for s in admin(server, "GET", "/health").json()["shards"] if s["shard"] == "shard-001")
    before = scrape(server)
    errors, stop = [], threading.Event()

    def client():
        while not stop.is_set():
            try:
                complete(server, ids["prompt"])
            except Exception as e:  # noqa: BLE001
                errors.append(repr(e))

    threads = [threading.Thread(target=client) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        time.sleep(1)
        os.kill(shard["pid"], signal.SIGKILL)  # Ray restarts the actor
        time.sleep(3)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)
    assert errors == []
    fallbacks = total(scrape(server), "knnlm_fallbacks_total") - total(before, "knnlm_fallbacks_total")
    assert fallbacks > 0
    deadline = time.monotonic() + 60
    while not (health := admin(server, "GET", "/health").json())["healthy"]:
        assert time.monotonic() < deadline, health
        time.sleep(0.5)
    assert total(scrape(server), "knnlm_shard_restarts_total") >= 1
    np.testing.assert_allclose(prompt_logprobs(server, full_prompt, knn_lambda=0.5), baseline, atol=1e-5)


def test_a_stopped_shard_actor_bounds_each_step_by_the_timeout_and_rejoins(server, ids):
    """A real hang (SIGSTOP, no mock) under streaming load: no request fails, the stopped shard's
    steps fall back after at most knn.shard_timeout_s, and SIGCONT brings it back."""
    import os
    import signal

    timeout_s = 3.0  # the server fixture's knn.shard_timeout_s
    shard = next(s for s in admin(server, "GET", "/health").json()["shards"] if s["shard"] == "shard-001")
    before = scrape(server)
    gaps = []  # the longest wait between two streamed tokens of each request

    def stop_and_resume():
        time.sleep(1)
        os.kill(shard["pid"], signal.SIGSTOP)
        try:
            time.sleep(3 * timeout_s)
        finally:
            os.kill(shard["pid"], signal.SIGCONT)
        time.sleep(1)

    results, errors = stream_while(server, ids["prompt"], CONTINUATION, stop_and_resume, clients=8, gaps=gaps)
    assert errors == [] and results
    timeouts = total(scrape(server), 'knnlm_fallbacks_total{datastore="main",reason="shard_timeout"}') - total(
        before, 'knnlm_fallbacks_total{datastore="main",reason="shard_timeout"}'
    )
    assert timeouts > 0
    assert max(gaps) < timeout_s + 2.0, f"a step waited {max(gaps):.1f} s, past the {timeout_s} s shard timeout"
    deadline = time.monotonic() + 60
    while not admin(server, "GET", "/health").json()["healthy"]:
        assert time.monotonic() < deadline, "the stopped shard never rejoined"
        time.sleep(0.5)
    settled = total(scrape(server), "knnlm_fallbacks_total")
    assert complete(server, ids["prompt"]) == ids["a"] and total(scrape(server), "knnlm_fallbacks_total") == settled


def test_unload_and_default(server, ids):
    assert admin(server, "POST", "/datastores", name="second", path="b").status_code == 200
    assert admin(server, "PUT", "/default", name="second").json() == {"default": "second"}
    assert complete(server, ids["prompt"]) == ids["b"]
    assert admin(server, "DELETE", "/datastores/second").status_code == 200
    assert admin(server, "GET", "/datastores").json()["default"] == "main"
    assert complete(server, ids["prompt"]) == ids["a"]
    assert admin(server, "DELETE", "/datastores/second").status_code == 404
    with pytest.raises(Exception) as e:  # an unloaded name is now an unknown datastore: HTTP 400
        complete(server, ids["prompt"], knn_datastore="second")
    assert getattr(e.value, "status_code", None) == 400 and "knn_datastore" in str(e.value)


def test_shard_actors_search_off_the_models_cores(server):
    """vLLM's CPU worker binds its threads to cores and leaves the others to other processes: the
    shard actors run on those, including the one Ray restarted after the kill above, and at the
    server's priority, not at the niceness 15 Ray starts its workers at."""
    import os

    assert {s["nice"] for s in admin(server, "GET", "/health").json()["shards"]} == {os.nice(0)}
    model = {cpu for cpus in admin(server, "GET", "/health").json()["model_cpus"].values() for cpu in cpus}
    rest = set(os.sched_getaffinity(0)) - model
    if not model or not rest:
        pytest.skip(f"vLLM bound the model to {sorted(model)} of {sorted(os.sched_getaffinity(0))}: no other cores to search on")
    deadline = time.monotonic() + 30  # a restarted actor is moved when the health check sees its new pid
    while True:
        shards = admin(server, "GET", "/health").json()["shards"]
        if shards and all(set(s.get("cpus", ())) == rest for s in shards):
            break
        assert time.monotonic() < deadline, shards
        time.sleep(0.5)


def test_shard_actors_run_with_their_own_environment_on_any_cluster(server):
    """SHARD_ACTOR_ENV reaches every shard actor through its Ray runtime_env (so it holds on a
    cluster the server did not start): OpenMP's short spin, Ray's niceness, and what keeps a
    long-running search path's memory flat (knnlm_serve/retrieval/actors.py)."""
    import psutil

    from knnlm_serve.retrieval import SHARD_ACTOR_ENV

    shards = admin(server, "GET", "/health").json()["shards"]
    assert shards
    for shard in shards:
        environ = psutil.Process(shard["pid"]).environ()
        assert {name: environ.get(name) for name in SHARD_ACTOR_ENV} == SHARD_ACTOR_ENV, shard


def test_automatic_compiled_graphs_where_each_shard_actor_has_a_core_to_itself(server, ids):
    """knn.compiled_graphs auto: a datastore whose shard actors have a core each outside the
    model's answers through Ray Compiled Graphs once they are built, with the same tokens; one with
    more actors than such cores stays on plain calls (a graph's reader polls its core)."""
    import os

    model = {cpu for cpus in admin(server, "GET", "/health").json()["model_cpus"].values() for cpu in cpus}
    spare = len(set(os.sched_getaffinity(0)) - model) if model else len(os.sched_getaffinity(0)) - 1
    assert admin(server, "POST", "/datastores", name="solo", path="b").status_code == 200  # one shard

    def answers(name: str, transport: str) -> float:
        return total(scrape(server), f'knnlm_shard_answers_total{{datastore="{name}",shard="shard-000",transport="{transport}"')

    try:
        deadline = time.monotonic() + 120
        while spare >= 1 and not answers("solo", "graph"):
            assert time.monotonic() < deadline, "no compiled-graph answers after 120 s"
            assert complete(server, ids["prompt"], knn_datastore="solo") == ids["b"]
        for name, expect, shards in (("solo", "b", 1), ("main", "a", 2)):
            before = {t: answers(name, t) for t in ("graph", "call")}
            assert complete(server, ids["prompt"], knn_datastore=name) == ids[expect]
            grew = {t for t in before if answers(name, t) > before[t]}
            assert grew == {"graph" if shards <= spare else "call"}, (name, spare, grew)
    finally:
        admin(server, "DELETE", "/datastores/solo")


def test_a_stopped_server_exits_promptly_and_starts_no_second_ray_cluster(server):
    """SIGTERM (what a supervisor sends) stops vLLM, the shard actors and the local Ray cluster.
    Nothing calls Ray after it shut down (that would start a new local cluster on the way out),
    and Ray does not wait for a dashboard this server does not run. Last in this module: it stops
    the module's server."""
    import os
    import signal

    os.killpg(server.proc.pid, signal.SIGTERM)
    server.proc.wait(timeout=15)
    assert server.log_path.read_text().count("Started a local Ray instance") == 1
