"""RayRetriever with a real local Ray and real shard actors: plain calls and compiled graphs, shard and replica faults."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from index_builder.build import build_from_keys
from knnlm_core.config import BuildConfig, KnnConfig
from knnlm_core.datastore import read_manifest
from knnlm_core.errors import KnnlmError
from knnlm_core.manifest import ModelIdentity
from knnlm_serve.retrieval import LocalRetriever, RayRetriever, RetrievalError, ShardActor, start_shard_actors
from knnlm_serve.runtime import DatastoreInfo

pytestmark = pytest.mark.slow  # every test starts Ray and shard actors (the module's fixtures)

DIM, K, TIMEOUT_S = 32, 64, 1.0
NAMESPACE = f"knnlm-test-retrieval-{os.getpid()}"


@pytest.fixture(scope="module")
def ray_session():
    import ray

    # address "local": a Ray of its own, whatever cluster another test or program started on this machine
    ray.init(address="local", include_dashboard=False, log_to_driver=False, namespace=NAMESPACE, object_store_memory=256 * 2**20)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def stores(tmp_path_factory, ray_session):
    """name -> (DatastoreInfo, its shard actors): 2 shards and 1 shard over the same keys."""
    root = tmp_path_factory.mktemp("stores")
    rng = np.random.default_rng(0)
    keys, values = rng.normal(size=(4000, DIM)).astype(np.float32), rng.integers(0, 1000, 4000)
    model = ModelIdentity(name="m", fingerprint="f", hidden_size=DIM, vocab_size=1000, dtype="float32")
    out = {}
    for name, shards in (("two", 2), ("one", 1)):
        build_from_keys(keys, values, root / name, model, BuildConfig(index="flat", shards=shards), source="test", progress=False)
        info = DatastoreInfo.of(name, root / name, read_manifest(root / name))
        out[name] = (info, start_shard_actors(info, knn()))  # per shard, its replicas; the handles keep the named actors alive
    return out


def knn(**overrides) -> KnnConfig:
    return KnnConfig(
        **{
            "backend": "ray",
            "ray_namespace": NAMESPACE,
            "gpu": False,
            "shard_threads": 1,
            "shard_timeout_s": TIMEOUT_S,
            "compiled_graphs": False,  # plain calls (the default) unless a test says otherwise
            **overrides,
        }
    )


def queries(n: int = 8, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, DIM)).astype(np.float32)


def until(condition, timeout: float = 90.0, every: float = 0.2):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(every)
    return value


def compiled(retriever: RayRetriever, info: DatastoreInfo) -> None:
    """Search until every shard of `info` is on its compiled graph (builds start with the first search)."""
    retriever.search(info, queries(1), 1, None)
    until(lambda: retriever.compiled_shards(info) == info.shards)


def assert_same(result, expected) -> None:
    np.testing.assert_allclose(result.distances, expected.distances, rtol=1e-5)
    np.testing.assert_array_equal(result.tokens, expected.tokens)
    np.testing.assert_array_equal(result.ids, expected.ids)


@pytest.fixture
def retriever(ray_session):
    retriever = RayRetriever(knn(compiled_graphs=True), None)
    yield retriever
    retriever.release(set())


def test_compiled_and_plain_calls_answer_as_in_process(stores, retriever):
    """Also with pointer rows, and a one-shard answer (a view of the graph's channel) survives the next step."""
    local = LocalRetriever(knn())
    plain = RayRetriever(knn(), None)
    pointers = np.full((8, 5), -1, dtype=np.int64)
    pointers[3, :4] = [7, 2100, 3999, 15]  # a row that follows pointers, in both shards
    for name in ("two", "one"):
        info, _ = stores[name]
        compiled(retriever, info)
        first = retriever.search(info, queries(seed=1), K, None, pointers)
        second = retriever.search(info, queries(seed=2), K, None)
        assert first.failed_shards == {} and set(first.shard_seconds) == set(info.shards)
        assert_same(first, local.search(info, queries(seed=1), K, None, pointers))
        assert_same(second, local.search(info, queries(seed=2), K, None))
        assert_same(plain.search(info, queries(seed=2), K, None), second)
        assert retriever.compiled_shards(info) == info.shards and plain.compiled_shards(info) == []


def test_searches_and_health_checks_leave_no_task_events_in_rays_gcs_where_other_actor_calls_do(stores, ray_session):
    """Both come many times a minute for as long as the server runs: a record of each in the GCS
    was its memory growing for hours."""
    from ray._private.state import state

    from knnlm_serve.server.shard_health import ShardPids

    def described() -> int:
        return sum(e.task_info.func_or_class_name == "ShardActor.describe" for e in state._get_all_task_events() if e.HasField("task_info"))

    def settled() -> int:
        """Events reach the GCS in batches about a second apart, each process its own: the count
        once it has not moved for three seconds (the actors' starts and graph builds describe too)."""
        last, since = described(), time.monotonic()
        while time.monotonic() - since < 3.0:
            time.sleep(0.5)
            if (now := described()) != last:
                last, since = now, time.monotonic()
        return last

    info, actors = stores["one"]
    plain, before = RayRetriever(knn(), None), settled()
    for _ in range(20):
        assert plain.search(info, queries(), K, None).failed_shards == {}
    for _ in range(3):
        (health,) = ShardPids().check([(info, info.shards[0], 0, actors[0][0])], 10.0, lambda actor: None)
        assert health["status"] == "ok"
    ray_session.get(actors[0][0].describe.remote())
    until(lambda: described() > before, timeout=30)  # the plain call after the others is in
    assert settled() == before + 1
    assert not [e for e in state._get_all_task_events() if e.task_info.func_or_class_name == "ShardActor.search"]


def process_state(pid: int) -> str:
    """The process's state letter in /proc (R running, S sleeping, T stopped, ...)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_a_stopped_shard_misses_the_deadline_and_rejoins(stores, retriever, ray_session):
    info, actors = stores["two"]
    compiled(retriever, info)
    pid = ray_session.get(actors[0][0].describe.remote())["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        until(lambda: process_state(pid) == "T", timeout=10)  # stopped before the first step, not by chance
        for step in range(3):  # its graph times out, then plain calls do
            start = time.monotonic()
            result = retriever.search(info, queries(), K, None)
            assert time.monotonic() - start < TIMEOUT_S + 0.5, f"step {step} waited past the deadline"
            assert result.failed_shards == {"shard-000": "shard_timeout"}
            assert (result.ids[result.ids >= 0] >= 2000).all()  # shard-001's entries only
        retriever.knn = knn(on_shard_failure="lm_only")
        with pytest.raises(RetrievalError) as e:
            retriever.search(info, queries(), K, None)
        assert e.value.reason == "shard_timeout"
    finally:
        os.kill(pid, signal.SIGCONT)
    retriever.knn = knn()
    until(lambda: not retriever.search(info, queries(), K, None).failed_shards)
    until(lambda: retriever.compiled_shards(info) == info.shards)
    assert_same(retriever.search(info, queries(), K, None), LocalRetriever(knn()).search(info, queries(), K, None))


def test_a_killed_shard_actor_fails_its_steps_until_ray_restarts_it(stores, retriever, ray_session):
    info, actors = stores["two"]
    compiled(retriever, info)
    before = ray_session.get(actors[1][0].describe.remote())["pid"]
    ray_session.kill(actors[1][0], no_restart=False)
    failed = until(lambda: retriever.search(info, queries(), K, None).failed_shards, timeout=10)
    assert set(failed) == {"shard-001"} and failed["shard-001"] in ("shard_error", "shard_timeout")
    until(lambda: not retriever.search(info, queries(), K, None).failed_shards)
    until(lambda: retriever.compiled_shards(info) == info.shards)
    assert ray_session.get(actors[1][0].describe.remote())["pid"] != before
    assert_same(retriever.search(info, queries(), K, None), LocalRetriever(knn()).search(info, queries(), K, None))


def test_release_tears_the_graphs_down_without_waiting(stores, retriever):
    """An actor runs one graph at a time: a new graph on the same actors proves the old one is gone."""
    info, _ = stores["two"]
    compiled(retriever, info)
    start = time.monotonic()
    retriever.release(set())
    assert time.monotonic() - start < 0.1 and retriever.compiled_shards(info) == []
    compiled(retriever, info)


def test_automatic_compiled_graphs_only_where_each_shard_actor_has_a_core_of_its_own(stores, ray_session):
    """knn.compiled_graphs auto: a version's actors get graphs when, on their node, they and the
    actors of the versions given graphs before are no more than the CPUs left once the engine has
    one (this process binds none): every graph's reader polls a core, so more of them than spare
    cores would take the engine's. The others stay on plain calls for good, and both answer as
    in-process."""
    spare = len(os.sched_getaffinity(0)) - 1
    retriever = RayRetriever(knn(compiled_graphs="auto", shard_timeout_s=5.0), None)
    started, polling = [], 0
    try:
        for name in ("one", "two"):
            stored, _ = stores[name]
            info = DatastoreInfo.of(f"auto-{name}", stored.path, read_manifest(stored.path))  # its own actors
            started.append(start_shard_actors(info, knn()))
            expected = LocalRetriever(knn()).search(info, queries(), K, None)
            graphs = polling + len(info.shards) <= spare
            polling += len(info.shards) if graphs else 0
            # Searched until the decision is in: graphs built, or every shard on plain calls for good.
            until(
                lambda info=info: (
                    retriever.search(info, queries(1), 1, None)
                    and info.shards in (retriever.compiled_shards(info), retriever.plain_shards(info))
                )
            )
            assert retriever.compiled_shards(info) == (info.shards if graphs else []), (name, spare)
            result = retriever.search(info, queries(), K, None)
            assert set(result.transports.values()) == {"graph" if graphs else "call"}
            assert_same(result, expected)
    finally:
        retriever.release(set())
        for actors in started:
            for replicas in actors:
                ray_session.kill(replicas[0])


def test_idle_graphs_are_parked_so_their_actors_stop_polling_and_come_back_at_the_next_search(stores, ray_session):
    import psutil

    stored, _ = stores["two"]
    info = DatastoreInfo.of("idle", stored.path, read_manifest(stored.path))  # its own actors: no other test's graphs
    actors = start_shard_actors(info, knn())
    idle_s = 3.0
    # A plain call waits behind a graph's set-up on the actor (0.1-0.9 s here): a deadline that
    # leaves room for it, since the graphs come back while the version serves.
    retriever = RayRetriever(knn(compiled_graphs=True, graph_idle_s=idle_s, shard_timeout_s=5.0), None)
    expected = LocalRetriever(knn()).search(info, queries(), K, None)
    pids = [ray_session.get(replicas[0].describe.remote())["pid"] for replicas in actors]

    def in_use_until_compiled() -> None:  # a search keeps the version in use and unparks its graphs
        until(lambda: retriever.search(info, queries(1), 1, None) and retriever.compiled_shards(info) == info.shards)

    def cpu_used_in(seconds: float) -> list[float]:
        before = [sum(psutil.Process(pid).cpu_times()[:2]) for pid in pids]
        time.sleep(seconds)
        return [sum(psutil.Process(pid).cpu_times()[:2]) - b for pid, b in zip(pids, before)]

    try:
        in_use_until_compiled()
        polling = cpu_used_in(1.0)  # compiled, idle for less than idle_s: the readers poll
        for _ in range(int(2 * idle_s / 0.1)):  # in use for twice the idle time: never parked
            assert_same(retriever.search(info, queries(), K, None), expected)
            assert retriever.compiled_shards(info) == info.shards
            time.sleep(0.1)
        until(lambda: retriever.compiled_shards(info) == [], timeout=idle_s + 10)
        time.sleep(1.0)  # the teardown reaches the actors
        parked = cpu_used_in(2.0)
        # Against the same actors polling (a core's worth each): a loaded machine's Ray threads
        # alone have cost parked actors 0.2 s in 2 s, so the bound is a share of the polling.
        assert max(parked) < 0.25 * 2 * min(polling), f"parked shard actors used {parked} s of CPU in 2 s, polling {polling} s in 1 s"
        result = retriever.search(info, queries(), K, None)  # plain calls answer while the graphs come back
        assert result.failed_shards == {}
        assert_same(result, expected)
        in_use_until_compiled()
        assert_same(retriever.search(info, queries(), K, None), expected)
    finally:
        retriever.release(set())
        for replicas in actors:
            ray_session.kill(replicas[0])


def test_a_second_engine_on_the_same_actors_is_served_by_plain_calls_until_the_graphs_are_free(stores, ray_session):
    """Two engines (vLLM data parallel, or two servers on one Ray cluster) sharing a datastore's
    actors, both with compiled graphs: an actor runs one graph at a time, so the second engine's
    searches go through plain calls, beside the first engine's graph, until that graph is gone."""
    stored, _ = stores["two"]
    info = DatastoreInfo.of("shared", stored.path, read_manifest(stored.path))  # its own actors: no other test's graphs
    actors = start_shard_actors(info, knn())
    first, second = (RayRetriever(knn(compiled_graphs=True, shard_timeout_s=5.0), None) for _ in range(2))
    expected = LocalRetriever(knn()).search(info, queries(), K, None)
    try:
        compiled(first, info)
        for _ in range(10):  # the second engine's graph builds wait for the actors meanwhile
            assert_same(first.search(info, queries(), K, None), expected)
            result = second.search(info, queries(), K, None)
            assert result.failed_shards == {} and set(result.transports.values()) == {"call"}
            assert_same(result, expected)
            time.sleep(0.1)
        assert first.compiled_shards(info) == info.shards and second.compiled_shards(info) == []
        first.release(set())
        until(lambda: second.search(info, queries(1), 1, None) and second.compiled_shards(info) == info.shards)
        result = second.search(info, queries(), K, None)
        assert set(result.transports.values()) == {"graph"}
        assert_same(result, expected)
    finally:
        first.release(set())
        second.release(set())
        for replicas in actors:
            ray_session.kill(replicas[0])


@pytest.mark.parametrize("graphs", [True, False], ids=["compiled graphs", "plain calls"])
def test_a_stopped_or_killed_replica_costs_no_fallback(stores, ray_session, graphs):
    """Two replicas per shard: a SIGSTOPped replica costs at most its share of one step's deadline
    and is then asked last; a killed one fails at once and the other answers. No step falls back."""
    info, _ = stores["two"]
    replicated = DatastoreInfo.of(f"replicated-{graphs}", info.path, read_manifest(info.path))
    actors = start_shard_actors(replicated, knn(replicas=2))
    timeout = 8.0  # each of the two replicas gets up to half: room for a loaded machine
    retriever = RayRetriever(knn(replicas=2, compiled_graphs=graphs, shard_timeout_s=timeout), None)
    expected = LocalRetriever(knn()).search(replicated, queries(), K, None)
    if graphs:
        compiled(retriever, replicated)
    pid = ray_session.get(actors[0][0].describe.remote())["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        until(lambda: process_state(pid) == "T", timeout=10)  # stopped before the first step, not by chance
        took = []
        for step in range(6):
            start = time.monotonic()
            result = retriever.search(replicated, queries(), K, None)
            took.append(time.monotonic() - start)
            assert result.failed_shards == {}, f"step {step} fell back"
            assert_same(result, expected)
        # The first step that asks the stopped replica waits its half of the deadline, once, and the
        # other replica answers within the rest (no step fell back: a wait of the whole deadline
        # would leave it no time); the stopped replica is then asked last. The slow step's bound is
        # the deadline, with slack: a 2-core CI machine once stalled that step 5.5 s past its half.
        slow = [t for t in took if t >= 1.0]
        assert len(slow) == 1 and timeout / 2 - 0.05 <= slow[0] < timeout + 2.0, took
        ray_session.kill(actors[1][1], no_restart=False)
        for _ in range(4):
            assert_same(result := retriever.search(replicated, queries(), K, None), expected)
            assert result.failed_shards == {}
    finally:
        os.kill(pid, signal.SIGCONT)
        retriever.release(set())


def test_knn_gpu_on_a_cluster_without_gpus_is_refused_instead_of_waiting_for_one(stores, ray_session):
    if ray_session.cluster_resources().get("GPU"):
        pytest.skip("this Ray cluster has a GPU")
    info, _ = stores["one"]
    with pytest.raises(KnnlmError, match="knn.gpu is true but no node of the Ray cluster offers a GPU"):
        start_shard_actors(info, knn(gpu=True))


def test_any_thread_that_searches_a_shard_uses_the_shard_threads(stores):
    """A compiled graph calls ShardActor.search from its own thread, and OpenMP's thread count is
    per thread: FAISS ran there at Ray's OMP_NUM_THREADS=1 until the search set it in every thread."""
    import faiss

    info, _ = stores["two"]
    fresh: dict[str, int] = {}
    probe = threading.Thread(target=lambda: fresh.setdefault("threads", faiss.omp_get_max_threads()))
    probe.start()
    probe.join()
    wanted = fresh["threads"] + 1  # not what a new thread starts with
    shard = ShardActor(info.path, info.shards[0], False, wanted, False)
    seen: dict[str, int] = {}

    def search_from_a_new_thread() -> None:
        shard.search(queries(), K, None)
        seen["threads"] = faiss.omp_get_max_threads()

    worker = threading.Thread(target=search_from_a_new_thread)
    worker.start()
    worker.join()
    assert seen["threads"] == wanted


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs a core besides the model's")
def test_in_process_searches_run_on_a_thread_off_the_cores_the_engine_is_bound_to(stores):
    """vLLM's CPU worker binds its threads to some cores; an in-process search that ran there would
    take the forward pass's core while it runs beside it."""
    info, _ = stores["two"]
    allowed = os.sched_getaffinity(0)
    model_core = min(allowed)
    os.sched_setaffinity(0, {model_core})  # this thread, as vLLM binds its worker's
    try:
        local = LocalRetriever(knn(backend="local"))
        result = local.result(local.start(info, queries(), K, None))
        searched_on = local._searcher.submit(os.sched_getaffinity, 0).result()
    finally:
        os.sched_setaffinity(0, allowed)
    assert searched_on == allowed - {model_core}
    assert_same(result, LocalRetriever(knn(backend="local")).search(info, queries(), K, None))


def test_an_in_process_search_that_hangs_costs_one_deadline_then_no_wait_until_it_ends(stores):
    """A search that never returns (a hang inside FAISS: no signal stops one thread, so its shard's
    `find` blocks here) fails its step at knn.shard_timeout_s; while it holds the search thread,
    later steps fail at once instead of queueing behind it, and once it ends they are searched again."""
    info, _ = stores["one"]
    local = LocalRetriever(knn(backend="local"))
    expected = local.search(info, queries(), K, None)
    shard = local._shards[info.key][0][0]
    release = threading.Event()
    find = shard.find
    shard.find = lambda *args: (release.wait(), find(*args))[1]
    started = time.monotonic()
    with pytest.raises(RetrievalError, match="longer than knn.shard_timeout_s") as late:
        local.search(info, queries(), K, None)
    assert late.value.reason == "shard_timeout" and TIMEOUT_S <= time.monotonic() - started < TIMEOUT_S + 1
    started = time.monotonic()
    with pytest.raises(RetrievalError, match="still running") as busy:
        local.search(info, queries(), K, None)
    assert busy.value.reason == "shard_timeout" and time.monotonic() - started < 0.1
    shard.find = find
    release.set()
    until(lambda: local._late.done())
    assert_same(local.search(info, queries(), K, None), expected)
