"""The Ray backend: a step's queries fanned out to one replica of every shard, merged in time.

Each shard actor is reached through its compiled graph where it has one (graphs.py) and by a
plain actor call otherwise. With replicas (`knn.replicas`), a step asks one replica per shard, in
turn (replicas that failed in the last `SUSPECT_S` seconds last), and each replica it asks gets
an equal share of what is left of the step's deadline: a dead replica fails at once and the next
answers; a hung one costs its share of one step, then is asked last. The step falls back only
when every replica of a shard failed.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import numpy as np

from knnlm_core.config import KnnConfig
from knnlm_core.pointers import RowLinks
from knnlm_core.search import merge_topk
from knnlm_serve.retrieval.actors import actor_name
from knnlm_serve.retrieval.graphs import PLAIN, GraphPool, is_graph
from knnlm_serve.retrieval.types import RetrievalError, SearchResult
from knnlm_serve.runtime import DatastoreInfo

SUSPECT_S = 30.0  # a replica that failed is asked last for this long
READY_GRACE_S = 0.02  # what a shard's answer is waited for once the step's deadline has passed
DOZE_FRACTION = 0.75  # of a graph search's expected time that the caller sleeps before it spins on the answer


@dataclass
class PendingSearch:
    """A search sent to the shards and not yet collected (RayRetriever.start -> result)."""

    info: DatastoreInfo
    args: tuple  # (queries, k, nprobe, pointers, links) as sent
    deadline: float  # time.monotonic() by which every shard must have answered
    orders: list[list[int]]  # per shard, its replicas in the order they are asked
    calls: list[tuple]  # per shard, the first replica's call in flight: (graph or None, ref, when sent)


class RayRetriever:
    def __init__(self, knn: KnnConfig, ray_address: str | None):
        import ray

        if not ray.is_initialized():
            ray.init(address=ray_address, namespace=knn.ray_namespace, log_to_driver=False)
        self.knn = knn
        self.graphs = GraphPool(knn)
        self._actors: dict[tuple[str, int], list[list]] = {}  # per version: per shard, its replicas
        self._suspect: dict[tuple[str, int, int, int], float] = {}  # (version, shard, replica) -> until when
        self._row_seconds: dict[tuple[str, int, int, int], float] = {}  # (version, shard, replica) -> search s/row
        self._turn = 0
        self._lock = threading.Lock()

    def _handles(self, info: DatastoreInfo) -> list[list]:
        import ray

        if info.key not in self._actors:
            actors = [
                [ray.get_actor(actor_name(info, shard, r), namespace=self.knn.ray_namespace) for r in range(self.knn.replicas)]
                for shard in info.shards
            ]
            with self._lock:
                self._actors[info.key] = actors
            self.graphs.add(info.key, actors)
        return self._actors[info.key]

    def compiled_shards(self, info: DatastoreInfo) -> list[str]:
        """The shards of this version whose every replica is searched through its compiled graph."""
        return self.graphs.shards_where(info, is_graph)

    def plain_shards(self, info: DatastoreInfo) -> list[str]:
        """The shards of this version whose every replica is searched through plain calls for good
        (`knn.compiled_graphs` false, or auto and no core for each actor)."""
        return self.graphs.shards_where(info, lambda graph: not self.graphs.compiled or graph is PLAIN)

    def search(self, info: DatastoreInfo, queries: np.ndarray, k: int, nprobe: int | None, pointers=None) -> SearchResult:
        return self.result(self.start(info, queries, k, nprobe, pointers))

    @staticmethod
    def links_rows(info: DatastoreInfo) -> bool:
        """Whether a call may link rows (`RowLinks`): where one actor holds the whole version, so
        it can follow a row's pointers with the row's answer in hand."""
        return len(info.shards) == 1

    def start(
        self, info: DatastoreInfo, queries: np.ndarray, k: int, nprobe: int | None, pointers=None, links: RowLinks | None = None
    ) -> PendingSearch:
        """Send the step's queries to one replica of every shard and return without waiting: the
        shards search while the caller goes on (knn.overlap: the rest of the forward pass)."""
        # Plain calls pass the queries with the call, not through ray.put: Ray inlines arguments
        # up to max_direct_call_object_size (SERVING_PROCESS_ENV: 4 MiB) and puts larger ones itself.
        queries = np.ascontiguousarray(queries, dtype=np.float32)
        args = (queries, k, nprobe, pointers, links)
        actors = self._handles(info)
        if self.graphs.compiled:
            self.graphs.use(info.key)
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

        graph = self.graphs.graph(key, (index, replica))
        if graph is not None:
            try:
                return graph, graph.execute(args), time.monotonic()
            except ray.exceptions.RayError:  # the graph was closed (its actor died): rebuild it, call plainly
                self.graphs.drop(key, (index, replica), graph)
        # A search is a step's, many a second: its task events (the dashboard's task history)
        # would be the GCS's memory and work, growing for hours, with nothing that reads them.
        return None, actors[index][replica].search.options(enable_task_events=False).remote(*args), time.monotonic()

    def _wait(self, key: tuple[str, int], index: int, replica: int, call, timeout: float, rows: int) -> tuple[tuple | None, str]:
        """(the replica's answer, "") or (None, why not) after at most `timeout` seconds."""
        import ray

        graph, ref, sent = call
        if graph is not None:
            # A graph's get() spins on a core until the answer is in, which slows a search that needs
            # every core (a 2-core host). So sleep through most of the search first: until
            # DOZE_FRACTION of what this replica's last searches took per row.
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
                self.graphs.drop(key, (index, replica), graph)
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
            for key in set(self._actors) - keep:
                del self._actors[key]
            self._suspect = {s: until for s, until in self._suspect.items() if s[:2] in keep}
            self._row_seconds = {r: t for r, t in self._row_seconds.items() if r[:2] in keep}
        self.graphs.release(keep)
