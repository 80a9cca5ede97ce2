"""Ray Compiled Graphs to a datastore version's shard actors: one graph per actor.

A graph (`InputNode -> ShardActor.search_step`) carries the queries and the answer through
shared-memory channels instead of a task submission, the object store and the raylet. One graph
per actor, not one over all shards, so that each shard keeps its own deadline and a late or dead
shard fails alone.

A graph's reader busy-waits between steps and holds a core while it exists, so:
- with `knn.compiled_graphs: auto`, a version gets graphs only where each of its actors has a core
  to itself (`_core_each`), and is served by plain calls for good otherwise;
- a version's graphs are parked (torn down) once no search has used them for `knn.graph_idle_s`,
  and rebuilt at its next search.
Graphs are built in background threads (compile, then a first execution that starts the actor's
loop); until an actor's graph is ready, and after it fails (timeout, actor death), the caller
reaches that actor by plain calls and its graph is rebuilt once the actor answers. Tearing a graph
down waits for the actor (forever while it is stopped), so that happens in the background too.
An actor runs one graph at a time: where engines share a version's actors, the first to build
holds the graph, and the others' builds wait while plain calls serve them.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter

import numpy as np

from knnlm_core.config import KnnConfig
from knnlm_serve.runtime import DatastoreInfo

logger = logging.getLogger("knnlm_serve")

PARKED = "parked"  # a slot whose graph was torn down for idleness (None: plain calls while one is built)
PLAIN = "plain"  # a slot served by plain calls for good: automatic compiled graphs, and no core of its own (`_core_each`)
GRAPH_START_TIMEOUT_S = 60.0  # a new graph's first execution starts the actor's loop, which takes seconds
GRAPH_RETRY_S = 5.0  # between attempts to build a shard's graph
Slot = tuple[int, int]  # (shard index, replica)
# A channel's first buffer: large enough that no step's queries or answers resize it (a prompt
# chunk of 2048 rows of a 2048-d model; 256 rows at k 1024). Ray leaves a resized channel's old
# buffer and its semaphores behind (ray-project/ray#59640): shared memory and /dev/shm entries
# then grow with every resize for as long as the server runs.
GRAPH_BUFFER_BYTES = int(os.environ.get("RAY_CGRAPH_buffer_size_bytes", 16 * 2**20))


class GraphPool:
    """Each shard actor's graph slot of every version in use: a graph, None (plain calls while one
    is built), PARKED or PLAIN."""

    def __init__(self, knn: KnnConfig):
        self.knn = knn
        self.compiled = knn.compiled_graphs is not False  # "auto": per version, where `_core_each` holds
        self._engine_node: str | None = None
        self._core_each_of: dict[tuple[str, int], bool] = {}  # version -> whether its actors have a core each
        self._polling: dict[tuple[str, int], Counter] = {}  # versions given graphs -> their actors per node
        self._deciding = threading.Lock()  # one `_core_each` at a time: a version's builds ask together
        self._actors: dict[tuple[str, int], list[list]] = {}  # per version: per shard, its replicas
        self._graphs: dict[tuple[str, int], dict[Slot, object]] = {}
        self._used: dict[tuple[str, int], float] = {}  # version -> its last search, or its last graph's arrival
        self._parker: threading.Thread | None = None
        self._parking: dict[tuple, threading.Thread] = {}  # (version, slot) -> its parked graph's teardown
        self._lock = threading.Lock()

    def add(self, key: tuple[str, int], actors: list[list]) -> None:
        """A version's actors (per shard, its replicas), with no graph yet."""
        slots = [(index, r) for index, replicas in enumerate(actors) for r in range(len(replicas))]
        with self._lock:
            self._actors[key], self._graphs[key] = actors, dict.fromkeys(slots, PARKED if self.compiled else None)

    def graph(self, key: tuple[str, int], slot: Slot):
        """The slot's graph, or None where the actor is reached by plain calls."""
        graph = self._graphs[key].get(slot)
        return graph if is_graph(graph) else None

    def shards_where(self, info: DatastoreInfo, holds) -> list[str]:
        """The shards of this version whose every replica's graph slot satisfies `holds`."""
        graphs = self._graphs.get(info.key, {})
        slots = [[holds(g) for (i, _), g in graphs.items() if i == index] for index in range(len(info.shards))]
        return [shard for shard, replicas in zip(info.shards, slots) if replicas and all(replicas)]

    def release(self, keep: set[tuple[str, int]]) -> None:
        with self._lock:
            gone = set(self._actors) - keep
            dropped = [graph for key in gone for graph in self._graphs.pop(key).values() if is_graph(graph)]
            for key in gone:
                del self._actors[key]
                self._used.pop(key, None)
            self._core_each_of = {key: each for key, each in self._core_each_of.items() if key in keep}
            self._polling = {key: nodes for key, nodes in self._polling.items() if key in keep}
            self._parking = {s: thread for s, thread in self._parking.items() if s[0] in keep}
        if dropped:
            threading.Thread(target=teardown, args=(dropped,), name="knnlm-graph-teardown", daemon=True).start()

    def use(self, key: tuple[str, int]) -> None:
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
                            if is_graph(graph):
                                # Teardown waits for the actor (forever for a stopped one): not in this
                                # thread; the slot's next build waits for it (one graph per actor).
                                graphs[slot], idle = PARKED, idle + 1
                                self._parking[(key, slot)] = thread = threading.Thread(
                                    target=teardown, args=([graph],), name="knnlm-graph-teardown", daemon=True
                                )
                                thread.start()
                done = all(graph is PARKED or graph is PLAIN for graphs in self._graphs.values() for graph in graphs.values())
                if done:
                    self._parker = None
            if idle:
                logger.info("parked %d compiled graph(s), idle for %.0f s", idle, self.knn.graph_idle_s)

    def drop(self, key: tuple[str, int], slot: tuple[int, int], graph) -> None:
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
        actors, counting those of the versions given graphs before, than the CPUs they may run on,
        less the engine's on its own node (the cores vLLM bound it to, or one where it binds none).
        Decided once a version, logged."""
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
            # Other versions' graphs poll the same spare cores: theirs count too.
            polling = Counter(node for k, per_node in self._polling.items() if k != key for node in per_node.elements())
            self._core_each_of[key] = each = all(count + polling[node] <= spare[node] for node, (count, _) in nodes.items())
            if each:
                self._polling[key] = Counter({node: count for node, (count, _) in nodes.items()})
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
            teardown([failed])
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
                if self.knn.compiled_graphs == "auto" and not self._core_each(key):
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
            teardown([graph])  # released while it was being built
            return


def compile_shard_graph(actor, dim: int):
    """`actor.search(queries, k, nprobe, pointers, links)` as a Ray Compiled Graph, executed once (which
    starts the actor's loop) so that the first real step does not wait for it."""
    from ray.dag import InputNode

    with InputNode() as step:
        graph = actor.search_step.bind(step).experimental_compile(_buffer_size_bytes=GRAPH_BUFFER_BYTES)
    try:
        graph.execute((np.zeros((1, dim), np.float32), 1, None, None)).get(timeout=GRAPH_START_TIMEOUT_S)
    except BaseException:
        teardown([graph])
        raise
    return graph


def is_graph(slot) -> bool:
    return slot is not None and slot is not PARKED and slot is not PLAIN


def teardown(graphs: list) -> None:
    for graph in graphs:
        try:
            graph.teardown()
        except Exception:  # noqa: BLE001 - a graph whose actor is gone is as good as torn down
            logger.debug("compiled graph teardown failed", exc_info=True)
