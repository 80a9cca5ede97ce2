"""Shards searched in this process: for tests, single-process deployments and one stream on one host.

A search runs on a thread of its own (FAISS and torch release the GIL), so a search started
mid-forward runs while the forward pass ends, as an actor's would, without Ray's transport and
without a reader polling a core between steps. Where vLLM bound this process to some of the
host's cores (its CPU worker), that thread runs on the others, as shard actors do
(`ShardActor.keep_off`): on a model core it would take that core from the forward pass.

A step waits for its search at most `knn.shard_timeout_s`, as for a shard actor; a search past
it (a hang) keeps the thread, and until it ends every search fails at once (`shard_timeout`), so
each step is served LM-only without waiting instead of queueing behind it."""

from __future__ import annotations

import contextlib
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from knnlm_core.config import KnnConfig
from knnlm_core.datastore import load_document_starts, read_manifest
from knnlm_core.pointers import RowLinks, find_linked
from knnlm_core.search import ShardSearcher, merge_topk, open_shards
from knnlm_serve.retrieval.types import RetrievalError, SearchResult, timed
from knnlm_serve.runtime import DatastoreInfo


@dataclass
class PendingLocal:
    info: DatastoreInfo
    search: Future
    deadline: float  # time.monotonic()


class LocalRetriever:
    def __init__(self, knn: KnnConfig):
        self.gpu, self.mmap, self.timeout_s = knn.gpu, knn.mmap, knn.shard_timeout_s
        self._shards: dict[tuple[str, int], tuple[list[ShardSearcher], np.ndarray | None]] = {}  # with document starts
        # one search at a time, in order
        self._searcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="knnlm-search", initializer=keep_off_bound_cpus)
        self._late: Future | None = None  # a search that missed its step's deadline, until it ends

    def links_rows(self, info: DatastoreInfo) -> bool:
        """Whether a call may link rows (`RowLinks`): always, every shard is in this process."""
        return True

    def start(
        self, info: DatastoreInfo, queries: np.ndarray, k: int, nprobe: int | None, pointers=None, links: RowLinks | None = None
    ) -> PendingLocal:
        """The search, begun on the search thread; `result` waits for it."""
        if self._late is not None and not self._late.done():
            raise RetrievalError(
                f"datastore {info.name!r} v{info.version}: an earlier search is still running past knn.shard_timeout_s", "shard_timeout"
            )
        if info.key not in self._shards:
            manifest = read_manifest(info.path)
            self._shards[info.key] = (
                open_shards(Path(info.path), manifest, self.gpu, self.mmap),
                load_document_starts(Path(info.path), manifest),
            )
        shards, document_starts = self._shards[info.key]
        seconds = dict.fromkeys((s.name for s in shards), 0.0)

        def find(queries: np.ndarray, k: int, nprobe: int | None, pointers) -> tuple[np.ndarray, ...]:
            answers = []
            for s in shards:
                *answer, took = timed(s.find, queries, k, nprobe, pointers)
                seconds[s.name] += took
                answers.append(answer)
            return merge_topk(answers, k)

        def run() -> SearchResult:
            if links is None:
                distances, tokens, ids = find(queries, k, nprobe, pointers)
            else:
                distances, tokens, ids = find_linked(find, queries, k, nprobe, pointers, links, document_starts)
            return SearchResult(distances, tokens, ids, seconds, transports=dict.fromkeys(seconds, "local"))

        return PendingLocal(info, self._searcher.submit(run), time.monotonic() + self.timeout_s)

    def result(self, pending: PendingLocal) -> SearchResult:
        try:
            return pending.search.result(timeout=max(0.0, pending.deadline - time.monotonic()))
        except FutureTimeout:
            self._late = pending.search
            info = pending.info
            raise RetrievalError(
                f"datastore {info.name!r} v{info.version}: the search took longer than knn.shard_timeout_s", "shard_timeout"
            ) from None

    def search(self, info: DatastoreInfo, queries: np.ndarray, k: int, nprobe: int | None, pointers=None) -> SearchResult:
        return self.result(self.start(info, queries, k, nprobe, pointers))

    def release(self, keep: set[tuple[str, int]]) -> None:
        for key in set(self._shards) - keep:
            del self._shards[key]


def keep_off_bound_cpus() -> None:
    """Move the calling thread to the host's CPUs this process is not bound to, if there are any."""
    spare = set(range(os.cpu_count() or 1)) - os.sched_getaffinity(0)
    if spare:
        with contextlib.suppress(OSError):  # CPUs outside this container's cpuset: stay where it is
            os.sched_setaffinity(0, spare)
