"""Batched top-k search over a datastore version's shards: Ray actors (one per shard) or in-process.

Both backends answer `search(info, queries, k, nprobe, pointers)` with the global top-k merged
from every shard's top-k by distance; rows with pointers (pointer following) are scored against
those entries instead of searched, in the same call. A shard that fails or misses the deadline is left out (policy
`partial`) or fails the whole search (policy `lm_only`); either way the caller learns why.
The Ray backend reaches each shard actor through a Ray Compiled Graph, with plain actor calls
while a graph is being built or after it failed (see `RayRetriever`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from knnlm_core.config import KnnConfig
from knnlm_core.datastore import read_manifest
from knnlm_core.errors import ErrorKind, KnnlmError
from knnlm_core.search import ShardSearcher, gpu_available, merge_topk, shard_first_ids
from knnlm_serve.runtime import DatastoreInfo

logger = logging.getLogger("knnlm_serve")


class RetrievalError(KnnlmError):
    """A search that produced no usable answer; `reason` labels the fallback metric."""

    kind = ErrorKind.UNAVAILABLE

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


@dataclass
class SearchResult:
    distances: np.ndarray
    tokens: np.ndarray
    ids: np.ndarray  # global entry ids
    shard_seconds: dict[str, float]
    failed_shards: dict[str, str] = field(default_factory=dict)  # shard -> reason


def _timed(method, *args):
    """(distances, tokens, ids, seconds) of a shard's answer."""
    start = time.perf_counter()
    return (*method(*args), time.perf_counter() - start)


def _shard_searchers(info: DatastoreInfo, use_gpu: bool | None) -> list[ShardSearcher]:
    manifest = read_manifest(info.path)
    return [ShardSearcher(Path(info.path), s, first, use_gpu=use_gpu) for s, first in zip(manifest.shards, shard_first_ids(manifest))]


class LocalRetriever:
    """Shards searched in this process: for tests, tiny stores and single-process deployments."""

    def __init__(self, knn: KnnConfig):
        self.gpu = knn.gpu
        self._shards: dict[tuple[str, int], list[ShardSearcher]] = {}

    def search(self, info: DatastoreInfo, queries: np.ndarray, k: int, nprobe: int | None, pointers=None) -> SearchResult:
        if info.key not in self._shards:
            self._shards[info.key] = _shard_searchers(info, self.gpu)
        answers = {s.name: _timed(s.find, queries, k, nprobe, pointers) for s in self._shards[info.key]}
        distances, tokens, ids = merge_topk([a[:3] for a in answers.values()], k)
        return SearchResult(distances, tokens, ids, {name: a[3] for name, a in answers.items()})

    def release(self, keep: set[tuple[str, int]]) -> None:
        for key in set(self._shards) - keep:
            del self._shards[key]


class ShardActor:
    """A Ray actor holding one FAISS shard (GPU FAISS when the actor has a GPU)."""

    def __init__(self, root: str, shard_name: str, use_gpu: bool | None, threads: int | None):
        import faiss

        # Ray sets OMP_NUM_THREADS=1 in actors that reserve no CPU; the search should use the node's cores.
        import torch

        faiss.omp_set_num_threads(threads or os.cpu_count())
        torch.set_num_threads(threads or os.cpu_count())  # exact (flat) shards search with torch
        manifest = read_manifest(root)
        ((shard, first),) = [(s, f) for s, f in zip(manifest.shards, shard_first_ids(manifest)) if s.name == shard_name]
        self.searcher = ShardSearcher(Path(root), shard, first, use_gpu=use_gpu)

    def describe(self) -> dict:
        import ray

        s = self.searcher
        node = ray.get_runtime_context().get_node_id()
        return {"name": s.name, "entries": s.ntotal, "dim": s.dim, "on_gpu": s.on_gpu, "pid": os.getpid(), "node": node}

    def search(self, queries: np.ndarray, k: int, nprobe: int | None, pointers: np.ndarray | None = None):
        return _timed(self.searcher.find, queries, k, nprobe, pointers)


def actor_name(info: DatastoreInfo, shard: str) -> str:
    return f"{info.name}@{info.version}/{shard}"


def start_shard_actors(info: DatastoreInfo, knn: KnnConfig) -> list:
    """One named actor per shard of this datastore version, loaded before this returns.

    Ray restarts a dead actor (reloading its shard) under the same name and handle, on any node
    with the actor's resources (`knn.shard_resources`), when one is or becomes available."""
    import ray

    use_gpu = knn.gpu if knn.gpu is not None else gpu_available()
    missing = sorted(set(knn.shard_resources) - set(ray.cluster_resources()))
    if missing:
        raise KnnlmError(
            f"knn.shard_resources names {missing}, which no node of the Ray cluster offers: start a node with "
            f"`ray start --address <head> --resources '{{\"{missing[0]}\": 1}}'`, or change knn.shard_resources",
            ErrorKind.UNAVAILABLE,
        )
    actors = [
        ray.remote(ShardActor)
        .options(
            name=actor_name(info, shard),
            namespace=knn.ray_namespace,
            get_if_exists=True,
            max_restarts=-1,
            num_cpus=0,
            num_gpus=knn.gpu_fraction if use_gpu else 0,
            resources=dict(knn.shard_resources) or None,
        )
        .remote(info.path, shard, use_gpu, knn.shard_threads)
        for shard in info.shards
    ]
    ray.get([a.describe.remote() for a in actors])
    return actors


class RayRetriever:
    """Fans a step's queries out to every shard actor in parallel and merges what comes back in time.

    Each shard actor serves this process through its own Ray Compiled Graph (`InputNode ->
    ShardActor.search`): the queries and the answer travel through shared-memory channels instead
    of a task submission, the object store and the raylet, so a round trip costs ~0.3-0.5 ms
    instead of 3-4 ms here (the answer, 512 KB at batch 32 and k 1024, is over Ray's 100 KB
    inlining limit and went through the object store). One graph per shard, not one over all
    shards, so that each shard has its own deadline and a late or dead shard fails alone
    (`on_shard_failure: partial`).

    A graph's reader busy-waits with `sched_yield` between steps: it takes an idle core but yields
    to any runnable thread (measured here: a 2-thread torch loop in the caller is not slowed by an
    idle graph, while the spinning actor takes ~1 core when one is idle).

    Graphs are built in a background thread (compile, then a first execution that starts the
    actor's loop: seconds here), per datastore version; until a shard's graph is ready, and after
    it fails (timeout, actor death), that shard is searched through plain `actor.search.remote`
    and its graph is rebuilt once the actor answers again. Tearing a graph down waits for the
    actor (forever while it is stopped), so that happens in the background too."""

    def __init__(self, knn: KnnConfig, ray_address: str | None, compiled: bool = True):
        import ray

        if not ray.is_initialized():
            ray.init(address=ray_address, namespace=knn.ray_namespace, log_to_driver=False)
        self.knn = knn
        self.compiled = compiled
        self._actors: dict[tuple[str, int], list] = {}
        self._graphs: dict[tuple[str, int], list] = {}  # per shard: its compiled graph, or None (plain path)
        self._lock = threading.Lock()

    def _handles(self, info: DatastoreInfo) -> list:
        import ray

        if info.key not in self._actors:
            actors = [ray.get_actor(actor_name(info, s), namespace=self.knn.ray_namespace) for s in info.shards]
            with self._lock:
                self._actors[info.key], self._graphs[info.key] = actors, [None] * len(actors)
            if self.compiled:
                for index in range(len(actors)):
                    self._start_build(info.key, index, None)
        return self._actors[info.key]

    def compiled_shards(self, info: DatastoreInfo) -> list[str]:
        """The shards of this version searched through their compiled graph (the others: plain calls)."""
        graphs = self._graphs.get(info.key, [])
        return [shard for shard, graph in zip(info.shards, graphs) if graph is not None]

    def search(self, info: DatastoreInfo, queries: np.ndarray, k: int, nprobe: int | None, pointers=None) -> SearchResult:
        import ray

        # Plain calls pass the queries with the call, not through ray.put: Ray inlines arguments
        # under 100 KB (a step's batch of 32 is 74 KB) and puts larger ones itself.
        queries = np.ascontiguousarray(queries, dtype=np.float32)
        actors = self._handles(info)
        deadline = time.monotonic() + self.knn.shard_timeout_s
        graph_calls, plain_calls = {}, {}
        for index, (shard, actor, graph) in enumerate(zip(info.shards, actors, list(self._graphs[info.key]))):
            if graph is not None:
                try:
                    graph_calls[shard] = (index, graph, graph.execute(queries, k, nprobe, pointers))
                    continue
                except ray.exceptions.RayError:  # the graph was closed (its actor died): rebuild it, call plainly
                    self._drop(info.key, index, graph)
            plain_calls[shard] = actor.search.remote(queries, k, nprobe, pointers)
        found, seconds, failed = {}, {}, {}
        for shard, (index, graph, ref) in graph_calls.items():
            try:
                *found[shard], seconds[shard] = ref.get(timeout=max(0.0, deadline - time.monotonic()))
            except ray.exceptions.RayError as e:
                failed[shard] = "shard_timeout" if isinstance(e, ray.exceptions.RayChannelTimeoutError) else "shard_error"
                self._drop(info.key, index, graph)
        if plain_calls:
            refs = list(plain_calls.values())
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=max(0.0, deadline - time.monotonic()))
            for shard, ref in plain_calls.items():
                if ref not in ready:
                    failed[shard] = "shard_timeout"
                    ray.cancel(ref)
                    continue
                try:
                    *found[shard], seconds[shard] = ray.get(ref)
                except ray.exceptions.RayError:
                    failed[shard] = "shard_error"
        if failed and (not found or self.knn.on_shard_failure == "lm_only"):
            reason = next(iter(failed.values()))
            raise RetrievalError(f"datastore {info.name!r} v{info.version}: shards {failed}", reason)
        answers = [found[shard] for shard in info.shards if shard in found]
        distances, tokens, ids = merge_topk(answers, k)
        if len(answers) == 1:  # one shard's answer is a view of its channel's buffer, which the next step reuses
            distances, tokens, ids = np.array(distances), np.array(tokens), np.array(ids)
        return SearchResult(distances, tokens, ids, seconds, failed)

    def release(self, keep: set[tuple[str, int]]) -> None:
        with self._lock:
            gone = set(self._actors) - keep
            dropped = [graph for key in gone for graph in self._graphs.pop(key) if graph is not None]
            for key in gone:
                del self._actors[key]
        if dropped:
            threading.Thread(target=_teardown, args=(dropped,), name="knnlm-graph-teardown", daemon=True).start()

    def _drop(self, key: tuple[str, int], index: int, graph) -> None:
        """A shard's graph failed: its shard goes back to plain calls until a new graph is built."""
        with self._lock:
            graphs = self._graphs.get(key)
            if graphs is None or graphs[index] is not graph:
                return  # released, or already dropped
            graphs[index] = None
        self._start_build(key, index, graph)

    def _start_build(self, key: tuple[str, int], index: int, failed) -> None:
        name = f"knnlm-graph-{key[0]}@{key[1]}/{index}"
        threading.Thread(target=self._build, args=(key, index, failed), name=name, daemon=True).start()

    def _build(self, key: tuple[str, int], index: int, failed) -> None:
        """In a background thread: tear the failed graph down (an actor runs one graph at a time),
        then compile a new one as soon as the actor answers, retrying while the version is in use."""
        import ray

        if failed is not None:
            _teardown([failed])
        while True:
            with self._lock:
                if key not in self._actors:
                    return
                actor = self._actors[key][index]
            try:
                dim = ray.get(actor.describe.remote(), timeout=GRAPH_START_TIMEOUT_S)["dim"]
                graph = compile_shard_graph(actor, dim)
            except Exception as e:  # noqa: BLE001 - any failure: plain calls serve the shard, retry later
                logger.warning(
                    "%s@%s shard %d: no compiled graph (%s: %s); retrying in %.0f s", *key, index, type(e).__name__, e, GRAPH_RETRY_S
                )
                time.sleep(GRAPH_RETRY_S)
                continue
            with self._lock:
                if key in self._graphs:
                    self._graphs[key][index] = graph
                    return
            _teardown([graph])  # released while it was being built
            return


GRAPH_START_TIMEOUT_S = 60.0  # a new graph's first execution starts the actor's loop: 1.5-4 s measured here
GRAPH_RETRY_S = 5.0  # between attempts to build a shard's graph


def compile_shard_graph(actor, dim: int):
    """`actor.search(queries, k, nprobe, pointers)` as a Ray Compiled Graph, executed once (which
    starts the actor's loop) so that the first real step does not wait for it."""
    from ray.dag import InputNode

    with InputNode() as step:
        graph = actor.search.bind(step[0], step[1], step[2], step[3]).experimental_compile()
    try:
        graph.execute(np.zeros((1, dim), np.float32), 1, None, None).get(timeout=GRAPH_START_TIMEOUT_S)
    except BaseException:
        _teardown([graph])
        raise
    return graph


def _teardown(graphs: list) -> None:
    for graph in graphs:
        try:
            graph.teardown()
        except Exception:  # noqa: BLE001 - a graph whose actor is gone is as good as torn down
            logger.debug("compiled graph teardown failed", exc_info=True)


def make_retriever(knn: KnnConfig, ray_address: str | None) -> LocalRetriever | RayRetriever:
    return RayRetriever(knn, ray_address) if knn.backend == "ray" else LocalRetriever(knn)
