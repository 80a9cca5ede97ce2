"""Batched top-k search over a datastore version's shards: Ray actors (one per shard) or in-process.

Both backends answer `search(info, queries, k, nprobe, pointers)`, or `start` then `result` (the
shards search while the caller goes on), with the global top-k merged from every shard's top-k by
distance; rows with pointers (pointer following) are scored against those entries instead of
searched, in the same call. A shard that fails or misses the deadline is left out (policy
`partial`) or fails the whole search (policy `lm_only`); either way the caller learns why.
The Ray backend reaches each shard actor with plain actor calls, or with `knn.compiled_graphs`
through a Ray Compiled Graph (plain calls while one is built or after it failed; see `RayRetriever`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
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
    transports: dict[str, str] = field(default_factory=dict)  # shard -> "graph" (compiled), "call" or "local"


@dataclass
class PendingSearch:
    """A search sent to the shards and not yet collected (RayRetriever.start -> result)."""

    info: DatastoreInfo
    args: tuple  # (queries, k, nprobe, pointers) as sent
    deadline: float  # time.monotonic() by which every shard must have answered
    orders: list[list[int]]  # per shard, its replicas in the order they are asked
    calls: list[tuple]  # per shard, the first replica's call in flight: (graph or None, ref, when sent)


def _timed(method, *args):
    """(distances, tokens, ids, seconds) of a shard's answer."""
    start = time.perf_counter()
    return (*method(*args), time.perf_counter() - start)


def _shard_searchers(info: DatastoreInfo, use_gpu: bool | None, mmap: bool) -> list[ShardSearcher]:
    manifest = read_manifest(info.path)
    return [ShardSearcher(Path(info.path), s, first, use_gpu, mmap) for s, first in zip(manifest.shards, shard_first_ids(manifest))]


class LocalRetriever:
    """Shards searched in this process: for tests, tiny stores and single-process deployments."""

    def __init__(self, knn: KnnConfig):
        self.gpu, self.mmap = knn.gpu, knn.mmap
        self._shards: dict[tuple[str, int], list[ShardSearcher]] = {}

    def start(self, info: DatastoreInfo, queries: np.ndarray, k: int, nprobe: int | None, pointers=None) -> SearchResult:
        """In-process shards search at once: their answer is the pending search."""
        if info.key not in self._shards:
            self._shards[info.key] = _shard_searchers(info, self.gpu, self.mmap)
        answers = {s.name: _timed(s.find, queries, k, nprobe, pointers) for s in self._shards[info.key]}
        distances, tokens, ids = merge_topk([a[:3] for a in answers.values()], k)
        return SearchResult(distances, tokens, ids, {name: a[3] for name, a in answers.items()}, transports=dict.fromkeys(answers, "local"))

    def result(self, pending: SearchResult) -> SearchResult:
        return pending

    def search(self, info: DatastoreInfo, queries: np.ndarray, k: int, nprobe: int | None, pointers=None) -> SearchResult:
        return self.result(self.start(info, queries, k, nprobe, pointers))

    def release(self, keep: set[tuple[str, int]]) -> None:
        for key in set(self._shards) - keep:
            del self._shards[key]


class ShardActor:
    """A Ray actor holding one FAISS shard (GPU FAISS when the actor has a GPU)."""

    def __init__(self, root: str, shard_name: str, use_gpu: bool | None, threads: int | None, mmap: bool):
        # Ray sets OMP_NUM_THREADS=1 in actors that reserve no CPU; the search should use the node's cores.
        self.threads = threads
        self._allowed = sorted(os.sched_getaffinity(0))
        self._search_threads = threads or len(self._allowed)
        self._threads_set: set[int] = set()  # the threads that search with _search_threads
        self._use_search_threads()
        manifest = read_manifest(root)
        ((shard, first),) = [(s, f) for s, f in zip(manifest.shards, shard_first_ids(manifest)) if s.name == shard_name]
        self.searcher = ShardSearcher(Path(root), shard, first, use_gpu, mmap)

    def describe(self) -> dict:
        import ray

        s = self.searcher
        node = ray.get_runtime_context().get_node_id()
        return {
            "name": s.name,
            "entries": s.ntotal,
            "dim": s.dim,
            "on_gpu": s.on_gpu,
            "pid": os.getpid(),
            "node": node,
            "cpus": sorted(os.sched_getaffinity(0)),
            "nice": os.nice(0),
        }

    def search(self, queries: np.ndarray, k: int, nprobe: int | None, pointers: np.ndarray | None = None):
        self._use_search_threads()
        return _timed(self.searcher.find, queries, k, nprobe, pointers)

    def search_step(self, step: tuple):
        """`search(*step)` for a compiled graph: one input channel for the step, not one per argument."""
        return self.search(*step)

    def _use_search_threads(self) -> None:
        """Give the calling thread `_search_threads` OpenMP threads (FAISS, and torch for flat shards).

        OpenMP's thread count is per calling thread, and a thread that never set it starts at Ray's
        OMP_NUM_THREADS=1: a compiled graph calls `search` from its own thread, where FAISS ran on
        one core (1.9x slower: 1M IVF-PQ, batch 32) until this was set there too."""
        thread = threading.get_ident()
        if thread not in self._threads_set:
            import faiss
            import torch

            faiss.omp_set_num_threads(self._search_threads)
            torch.set_num_threads(self._search_threads)  # exact (flat) shards search with torch
            self._threads_set.add(thread)

    def keep_off(self, model_cpus: dict[str, list[int]]) -> None:
        """Run on this host's CPUs that no vLLM worker is bound to (`model_cpus`: host -> CPUs).

        vLLM's CPU worker binds its OpenMP threads to cores and leaves the rest to the other
        processes; a search thread on a model core takes that core from the model and waits at its
        own thread barrier for it. Where every CPU is the model's (or none is bound, as on GPU
        hosts) nothing changes; `describe` shows where it runs."""
        cpus = sorted(set(self._allowed) - set(model_cpus.get(socket.gethostname(), [])))
        if not cpus or cpus == sorted(os.sched_getaffinity(0)):
            return
        for thread in os.listdir("/proc/self/task"):  # every thread: the OpenMP pool exists already
            with contextlib.suppress(OSError):
                os.sched_setaffinity(int(thread), cpus)
        self._search_threads, self._threads_set = self.threads or len(cpus), set()
        self._use_search_threads()
        logger.info("shard %s: searching on CPUs %s, off the model's", self.searcher.name, cpus)


def actor_name(info: DatastoreInfo, shard: str, replica: int = 0) -> str:
    return f"{info.name}@{info.version}/{shard}" + (f"#{replica}" if replica else "")


def start_shard_actors(info: DatastoreInfo, knn: KnnConfig) -> list[list]:
    """`knn.replicas` named actors per shard of this datastore version (per shard, a list of
    replicas), loaded before this returns. Replicas of a shard are spread over the nodes that offer
    `knn.shard_resources`, as far as Ray can.

    Ray restarts a dead actor (reloading its shard) under the same name and handle, on any node
    with the actor's resources, when one is or becomes available."""
    import ray

    resources = ray.cluster_resources()
    has_gpu = resources.get("GPU", 0) >= knn.gpu_fraction
    use_gpu = knn.gpu if knn.gpu is not None else gpu_available() and has_gpu  # auto: only where actors can get one
    missing = sorted(set(knn.shard_resources) - set(resources))
    if missing:
        raise KnnlmError(
            f"knn.shard_resources names {missing}, which no node of the Ray cluster offers: start a node with "
            f"`ray start --address <head> --resources '{{\"{missing[0]}\": 1}}'`, or change knn.shard_resources",
            ErrorKind.UNAVAILABLE,
        )
    if use_gpu and not has_gpu:
        raise KnnlmError(
            "knn.gpu is true but no node of the Ray cluster offers a GPU, so the shard actors could never be placed: "
            "set knn.gpu to null (automatic) or false, or join a node with a GPU (`ray start --address <head> --num-gpus 1`)",
            ErrorKind.UNAVAILABLE,
        )
    actors = [
        [
            ray.remote(ShardActor)
            .options(
                name=actor_name(info, shard, replica),
                namespace=knn.ray_namespace,
                get_if_exists=True,
                max_restarts=-1,
                num_cpus=0,
                num_gpus=knn.gpu_fraction if use_gpu else 0,
                resources=dict(knn.shard_resources) or None,
                scheduling_strategy="SPREAD" if knn.replicas > 1 else "DEFAULT",
                runtime_env={"env_vars": SHARD_ACTOR_ENV},
            )
            .remote(info.path, shard, use_gpu, knn.shard_threads, knn.mmap)
            for replica in range(knn.replicas)
        ]
        for shard in info.shards
    ]
    ray.get([a.describe.remote() for replicas in actors for a in replicas])
    return actors


class RayRetriever:
    """Fans a step's queries out to every shard in parallel and merges what comes back in time.

    With `knn.compiled_graphs` (by default where each shard actor has a core to itself:
    `_core_each`), each shard actor serves this process through its own Ray Compiled Graph (`InputNode ->
    ShardActor.search`): the queries and the answer travel through shared-memory channels instead
    of a task submission, the object store and the raylet, so a round trip costs ~0.3-0.5 ms
    instead of 3-4 ms here (the answer, 512 KB at batch 32 and k 1024, is over Ray's 100 KB
    inlining limit and went through the object store). One graph per actor, not one over all
    shards, so that each shard has its own deadline and a late or dead shard fails alone
    (`on_shard_failure: partial`).

    A graph's reader busy-waits with `sched_yield` between steps: on this 2-core machine two idle
    graphs held their actors at ~50% CPU each and the engine's worker at 100%, enough to stall a
    second engine's start for minutes. So a version's graphs are parked (torn down) once no search
    has used them for `knn.graph_idle_s`, and rebuilt at its next search.

    Graphs are built in a background thread (compile, then a first execution that starts the
    actor's loop: seconds here), per datastore version; until an actor's graph is ready, and after
    it fails (timeout, actor death), that actor is searched through plain `actor.search.remote`
    and its graph is rebuilt once the actor answers again. Tearing a graph down waits for the
    actor (forever while it is stopped), so that happens in the background too. An actor runs one
    graph at a time: where engines share a version's actors, the first to build holds the graph,
    and the others' builds wait while plain calls serve them.

    With replicas (`knn.replicas`), a step asks one replica per shard, in turn (replicas that
    failed in the last `SUSPECT_S` seconds last), and each replica it asks gets an equal share of
    what is left of the step's deadline: a dead replica fails at once and the next answers; a hung
    one costs its share of one step, then is asked last. The step falls back only when every
    replica of a shard failed."""

    def __init__(self, knn: KnnConfig, ray_address: str | None):
        import ray

        if not ray.is_initialized():
            ray.init(address=ray_address, namespace=knn.ray_namespace, log_to_driver=False)
        self.knn = knn
        self.compiled = knn.compiled_graphs is not False  # None: per version, where `_core_each` holds
        self._engine_node: str | None = None
        self._core_each_of: dict[tuple[str, int], bool] = {}  # version -> whether its actors have a core each
        self._deciding = threading.Lock()  # one `_core_each` at a time: a version's builds ask together
        self._actors: dict[tuple[str, int], list[list]] = {}  # per version: per shard, its replicas
        self._graphs: dict[tuple[str, int], dict[tuple[int, int], object]] = {}  # (shard, replica) -> graph or None
        self._suspect: dict[tuple[str, int, int, int], float] = {}  # (version, shard, replica) -> until when
        self._row_seconds: dict[tuple[str, int, int, int], float] = {}  # (version, shard, replica) -> search s/row
        self._used: dict[tuple[str, int], float] = {}  # version -> its last search, or its last graph's arrival
        self._parker: threading.Thread | None = None
        self._parking: dict[tuple, threading.Thread] = {}  # (version, slot) -> its parked graph's teardown
        self._turn = 0
        self._lock = threading.Lock()

    def _handles(self, info: DatastoreInfo) -> list[list]:
        import ray

        if info.key not in self._actors:
            actors = [
                [ray.get_actor(actor_name(info, shard, r), namespace=self.knn.ray_namespace) for r in range(self.knn.replicas)]
                for shard in info.shards
            ]
            slots = [(index, r) for index, replicas in enumerate(actors) for r in range(len(replicas))]
            with self._lock:
                self._actors[info.key], self._graphs[info.key] = actors, dict.fromkeys(slots, PARKED if self.compiled else None)
        return self._actors[info.key]

    def compiled_shards(self, info: DatastoreInfo) -> list[str]:
        """The shards of this version whose every replica is searched through its compiled graph."""
        return self._shards_where(info, _is_graph)

    def plain_shards(self, info: DatastoreInfo) -> list[str]:
        """The shards of this version whose every replica is searched through plain calls for good
        (`knn.compiled_graphs` false, or unset and `_core_each` found no core for each)."""
        return self._shards_where(info, lambda graph: not self.compiled or graph is PLAIN)

    def _shards_where(self, info: DatastoreInfo, holds) -> list[str]:
        """The shards of this version whose every replica's graph slot satisfies `holds`."""
        graphs = self._graphs.get(info.key, {})
        slots = [[holds(g) for (i, _), g in graphs.items() if i == index] for index in range(len(info.shards))]
        return [shard for shard, replicas in zip(info.shards, slots) if replicas and all(replicas)]

    def search(self, info: DatastoreInfo, queries: np.ndarray, k: int, nprobe: int | None, pointers=None) -> SearchResult:
        return self.result(self.start(info, queries, k, nprobe, pointers))

    def start(self, info: DatastoreInfo, queries: np.ndarray, k: int, nprobe: int | None, pointers=None) -> PendingSearch:
        """Send the step's queries to one replica of every shard and return without waiting: the
        shards search while the caller goes on (knn.overlap: the rest of the forward pass)."""
        # Plain calls pass the queries with the call, not through ray.put: Ray inlines arguments
        # under 100 KB (a step's batch of 32 is 74 KB) and puts larger ones itself.
        queries = np.ascontiguousarray(queries, dtype=np.float32)
        args = (queries, k, nprobe, pointers)
        actors = self._handles(info)
        if self.compiled:
            self._unpark(info.key)
        deadline = time.monotonic() + self.knn.shard_timeout_s
        self._turn += 1
        orders = [self._order(info.key, index, len(replicas)) for index, replicas in enumerate(actors)]
        calls = [self._call(info.key, index, order[0], actors, args) for index, order in enumerate(orders)]
        return PendingSearch(info, args, deadline, orders, calls)

    def result(self, pending: PendingSearch) -> SearchResult:
        """Wait for the shards of a started search (each within the step's deadline, the next
        replica asked where one fails) and merge their answers."""
        info, args, deadline, orders, calls = pending.info, pending.args, pending.deadline, pending.orders, pending.calls
        actors, k = self._handles(info), args[1]
        found, seconds, failed, transports = {}, {}, {}, {}
        for index, (shard, order) in enumerate(zip(info.shards, orders)):
            for attempt, replica in enumerate(order):
                call = calls[index] if attempt == 0 else self._call(info.key, index, replica, actors, args)
                # At least READY_GRACE_S: an answer already in is taken even after an earlier shard
                # used the whole deadline (a channel read with no time left can miss it).
                share = max(READY_GRACE_S, deadline - time.monotonic()) / (len(order) - attempt)
                answer, reason = self._wait(info.key, index, replica, call, share, len(args[0]))
                if answer is not None:
                    *found[shard], seconds[shard] = answer
                    transports[shard] = "call" if call[0] is None else "graph"
                    self._note_search_time((*info.key, index, replica), seconds[shard], len(args[0]))
                    failed.pop(shard, None)
                    break
                failed[shard] = reason
        if failed and (not found or self.knn.on_shard_failure == "lm_only"):
            reason = next(iter(failed.values()))
            raise RetrievalError(f"datastore {info.name!r} v{info.version}: shards {failed}", reason)
        answers = [found[shard] for shard in info.shards if shard in found]
        distances, tokens, ids = merge_topk(answers, k)
        if len(answers) == 1:  # one shard's answer is a view of its channel's buffer, which the next step reuses
            distances, tokens, ids = np.array(distances), np.array(tokens), np.array(ids)
        return SearchResult(distances, tokens, ids, seconds, failed, transports)

    def _order(self, key: tuple[str, int], index: int, replicas: int) -> list[int]:
        """This step's replicas of a shard, in turn, the recently failed ones last."""
        now = time.monotonic()
        turn = [(self._turn + r) % replicas for r in range(replicas)]
        return sorted(turn, key=lambda r: self._suspect.get((*key, index, r), 0.0) > now)

    def _call(self, key: tuple[str, int], index: int, replica: int, actors: list[list], args: tuple):
        """Start one replica's search: through its graph when it has one, else a plain call."""
        import ray

        graph = self._graphs[key].get((index, replica))
        if _is_graph(graph):
            try:
                return graph, graph.execute(args), time.monotonic()
            except ray.exceptions.RayError:  # the graph was closed (its actor died): rebuild it, call plainly
                self._drop(key, (index, replica), graph)
        return None, actors[index][replica].search.remote(*args), time.monotonic()

    def _wait(self, key: tuple[str, int], index: int, replica: int, call, timeout: float, rows: int) -> tuple[tuple | None, str]:
        """(the replica's answer, "") or (None, why not) after at most `timeout` seconds."""
        import ray

        graph, ref, sent = call
        if graph is not None:
            # A graph's get() spins on a core until the answer is in; where the shard's search needs
            # every core (this 2-core host) the spin slowed an exact search 2x. So sleep through most of the
            # search first: until DOZE_FRACTION of what this replica's last searches took per row.
            per_row = self._row_seconds.get((*key, index, replica))
            pause = 0.0 if per_row is None else min(DOZE_FRACTION * per_row * rows, timeout) - (time.monotonic() - sent)
            if pause > 0:
                time.sleep(pause)
                timeout -= pause
        try:
            return (ref.get(timeout=timeout) if graph is not None else ray.get(ref, timeout=timeout)), ""
        except ray.exceptions.RayError as e:
            timed_out = isinstance(e, (ray.exceptions.RayChannelTimeoutError, ray.exceptions.GetTimeoutError))
            self._suspect[(*key, index, replica)] = time.monotonic() + SUSPECT_S
            if graph is not None:
                self._drop(key, (index, replica), graph)
            elif timed_out:
                ray.cancel(ref)
            return None, "shard_timeout" if timed_out else "shard_error"

    def _note_search_time(self, replica: tuple, seconds: float, rows: int) -> None:
        """A moving average of a replica's own search seconds per query row (what `_wait` sleeps by)."""
        last = self._row_seconds.get(replica)
        per_row = seconds / max(rows, 1)
        self._row_seconds[replica] = per_row if last is None else last + 0.3 * (per_row - last)

    def release(self, keep: set[tuple[str, int]]) -> None:
        with self._lock:
            gone = set(self._actors) - keep
            dropped = [graph for key in gone for graph in self._graphs.pop(key).values() if _is_graph(graph)]
            for key in gone:
                del self._actors[key]
                self._used.pop(key, None)
            self._suspect = {s: until for s, until in self._suspect.items() if s[:2] in keep}
            self._row_seconds = {r: t for r, t in self._row_seconds.items() if r[:2] in keep}
            self._core_each_of = {key: each for key, each in self._core_each_of.items() if key in keep}
            self._parking = {s: teardown for s, teardown in self._parking.items() if s[0] in keep}
        if dropped:
            threading.Thread(target=_teardown, args=(dropped,), name="knnlm-graph-teardown", daemon=True).start()

    def _unpark(self, key: tuple[str, int]) -> None:
        """A search of this version: its parked graphs are built again (plain calls serve until then)."""
        with self._lock:
            self._used[key] = time.monotonic()
            graphs = self._graphs[key]
            parked = [slot for slot, graph in graphs.items() if graph is PARKED]
            for slot in parked:
                graphs[slot] = None
            if parked and (self._parker is None or not self._parker.is_alive()):
                self._parker = threading.Thread(target=self._park_idle, name="knnlm-graph-parker", daemon=True)
                self._parker.start()
        for slot in parked:
            self._start_build(key, slot, None)

    def _park_idle(self) -> None:
        """In a background thread while any version has graphs: tear down the graphs of versions
        that no search used for `graph_idle_s`. A search notes its use under the same lock before
        it reads a graph, so a graph is never parked under a step that is using it."""
        done = False
        while not done:
            time.sleep(min(1.0, self.knn.graph_idle_s / 4))
            now, idle = time.monotonic(), 0
            with self._lock:
                for key, graphs in self._graphs.items():
                    if now - self._used.get(key, now) > self.knn.graph_idle_s:
                        for slot, graph in graphs.items():
                            if _is_graph(graph):
                                # Teardown waits for the actor (forever for a stopped one): not in this
                                # thread; the slot's next build waits for it (one graph per actor).
                                graphs[slot], idle = PARKED, idle + 1
                                self._parking[(key, slot)] = teardown = threading.Thread(
                                    target=_teardown, args=([graph],), name="knnlm-graph-teardown", daemon=True
                                )
                                teardown.start()
                done = all(graph is PARKED or graph is PLAIN for graphs in self._graphs.values() for graph in graphs.values())
                if done:
                    self._parker = None
            if idle:
                logger.info("parked %d compiled graph(s), idle for %.0f s", idle, self.knn.graph_idle_s)

    def _drop(self, key: tuple[str, int], slot: tuple[int, int], graph) -> None:
        """An actor's graph failed: the actor goes back to plain calls until a new graph is built."""
        with self._lock:
            graphs = self._graphs.get(key)
            if graphs is None or graphs.get(slot) is not graph:
                return  # released, or already dropped
            graphs[slot] = None
        self._start_build(key, slot, graph)

    def _core_each(self, key: tuple[str, int]) -> bool:
        """Whether each of this version's shard actors has a core to itself, so that its graph's
        polling reader takes no core that the engine or another actor needs: on every node, no more
        actors than the CPUs they may run on, less the engine's on its own node (the cores vLLM
        bound it to, or one where it binds none). Decided once a version, logged."""
        import ray

        with self._deciding:
            if key in self._core_each_of:
                return self._core_each_of[key]
            if self._engine_node is None:
                self._engine_node = ray.get_runtime_context().get_node_id()
            with self._lock:
                actors = [a for replicas in self._actors.get(key, []) for a in replicas]
            described = ray.get([a.describe.remote() for a in actors], timeout=GRAPH_START_TIMEOUT_S)
            nodes: dict[str, tuple[int, set[int]]] = {}
            for d in described:
                count, cpus = nodes.get(d["node"], (0, set()))
                nodes[d["node"]] = (count + 1, cpus | set(d["cpus"]))
            spare = {
                node: len(cpus - self._engine_cpus(cpus)) if node == self._engine_node else len(cpus) for node, (_, cpus) in nodes.items()
            }
            self._core_each_of[key] = each = all(count <= spare[node] for node, (count, _) in nodes.items())
            logger.info(
                "%s@%s: shard actors reached through %s (actors per node %s, spare CPUs %s)",
                *key,
                "compiled graphs" if each else "plain calls",
                {node[:8]: count for node, (count, _) in nodes.items()},
                {node[:8]: n for node, n in spare.items()},
            )
            return each

    @staticmethod
    def _engine_cpus(node_cpus: set[int]) -> set[int]:
        """The CPUs among `node_cpus` this engine needs: those vLLM bound it to, or one where it may run on all."""
        bound = set(os.sched_getaffinity(0))
        return set(sorted(node_cpus)[:1]) if node_cpus <= bound else bound & node_cpus

    def _start_build(self, key: tuple[str, int], slot: tuple[int, int], failed) -> None:
        name = f"knnlm-graph-{key[0]}@{key[1]}/{slot[0]}#{slot[1]}"
        threading.Thread(target=self._build, args=(key, slot, failed), name=name, daemon=True).start()

    def _build(self, key: tuple[str, int], slot: tuple[int, int], failed) -> None:
        """In a background thread: tear the failed graph down (an actor runs one graph at a time),
        then compile a new one as soon as the actor answers, retrying while the version is in use."""
        import ray

        if failed is not None:
            _teardown([failed])
        with self._lock:
            parking = self._parking.pop((key, slot), None)
        if parking is not None:
            parking.join()
        while True:
            with self._lock:
                if key not in self._actors:
                    return
                actor = self._actors[key][slot[0]][slot[1]]
            try:
                if self.knn.compiled_graphs is None and not self._core_each(key):
                    with self._lock:
                        if key in self._graphs and self._graphs[key][slot] is None:
                            self._graphs[key][slot] = PLAIN
                    return
                dim = ray.get(actor.describe.remote(), timeout=GRAPH_START_TIMEOUT_S)["dim"]
                graph = compile_shard_graph(actor, dim)
            except Exception as e:  # noqa: BLE001 - any failure: plain calls serve the actor, retry later
                logger.warning(
                    "%s@%s shard %d replica %d: no compiled graph (%s: %s); retrying in %.0f s",
                    *key,
                    *slot,
                    type(e).__name__,
                    e,
                    GRAPH_RETRY_S,
                )
                time.sleep(GRAPH_RETRY_S)
                continue
            with self._lock:
                if key in self._graphs and self._graphs[key][slot] is None:
                    self._graphs[key][slot] = graph
                    self._used[key] = max(self._used.get(key, 0.0), time.monotonic())  # idle counts from here
                    return
            _teardown([graph])  # released while it was being built
            return


PARKED = "parked"  # a slot whose graph was torn down for idleness (None: plain calls while one is built)
PLAIN = "plain"  # a slot served by plain calls for good: automatic compiled graphs, and no core of its own (`_core_each`)
SUSPECT_S = 30.0  # a replica that failed is asked last for this long
GRAPH_START_TIMEOUT_S = 60.0  # a new graph's first execution starts the actor's loop: 1.5-4 s measured here
GRAPH_RETRY_S = 5.0  # between attempts to build a shard's graph
READY_GRACE_S = 0.02  # what a shard's answer is waited for once the step's deadline has passed
DOZE_FRACTION = 0.75  # of a graph search's expected time that the caller sleeps before it spins on the answer
# The shard actors' process environment (Ray runtime_env, so it holds on any cluster):
# - OpenMP (FAISS, torch) threads spin after each parallel region before they sleep; libgomp's
#   default 300,000 spins held the cores for about a millisecond after every search, while the
#   caller waiting for the answer and the actor's own thread sending it needed one (2 cores, 1M
#   IVF-PQ, batch 32, compiled graph: transport 1.4-2.4 ms by default, 0.7-1.1 at 1,000 spins).
# - Answers up to 4 MiB (batch 256 at k 1024) return inline with the call's reply, not through the
#   object store (Ray's default limit is 100 KB; batch 32 at k 1024 is 512 KB): plain calls'
#   transport 3.7-4.1 -> 2.7-3.3 ms at batch 32.
# - Niceness 0, not the 15 Ray starts worker processes at (its job supervisor does the same): a
#   search is on every step's critical path, and at 15 it yields its core to anything else there
#   (the API server, the engine core, a load generator).
SHARD_ACTOR_ENV = {"GOMP_SPINCOUNT": "1000", "RAY_max_direct_call_object_size": str(4 * 2**20), "RAY_worker_niceness": "0"}


def compile_shard_graph(actor, dim: int):
    """`actor.search(queries, k, nprobe, pointers)` as a Ray Compiled Graph, executed once (which
    starts the actor's loop) so that the first real step does not wait for it."""
    from ray.dag import InputNode

    with InputNode() as step:
        graph = actor.search_step.bind(step).experimental_compile()
    try:
        graph.execute((np.zeros((1, dim), np.float32), 1, None, None)).get(timeout=GRAPH_START_TIMEOUT_S)
    except BaseException:
        _teardown([graph])
        raise
    return graph


def _is_graph(slot) -> bool:
    return slot is not None and slot is not PARKED and slot is not PLAIN


def _teardown(graphs: list) -> None:
    for graph in graphs:
        try:
            graph.teardown()
        except Exception:  # noqa: BLE001 - a graph whose actor is gone is as good as torn down
            logger.debug("compiled graph teardown failed", exc_info=True)


def make_retriever(knn: KnnConfig, ray_address: str | None) -> LocalRetriever | RayRetriever:
    return RayRetriever(knn, ray_address) if knn.backend == "ray" else LocalRetriever(knn)
