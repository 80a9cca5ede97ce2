"""Shards searched in this process: for tests, tiny stores and single-process deployments."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from knnlm_core.config import KnnConfig
from knnlm_core.datastore import read_manifest
from knnlm_core.search import ShardSearcher, merge_topk, open_shards
from knnlm_serve.retrieval.types import SearchResult, timed
from knnlm_serve.runtime import DatastoreInfo


class LocalRetriever:
    def __init__(self, knn: KnnConfig):
        self.gpu, self.mmap = knn.gpu, knn.mmap
        self._shards: dict[tuple[str, int], list[ShardSearcher]] = {}

    def start(self, info: DatastoreInfo, queries: np.ndarray, k: int, nprobe: int | None, pointers=None) -> SearchResult:
        """In-process shards search at once: their answer is the pending search."""
        if info.key not in self._shards:
            self._shards[info.key] = open_shards(Path(info.path), read_manifest(info.path), self.gpu, self.mmap)
        answers = {s.name: timed(s.find, queries, k, nprobe, pointers) for s in self._shards[info.key]}
        distances, tokens, ids = merge_topk([a[:3] for a in answers.values()], k)
        return SearchResult(distances, tokens, ids, {name: a[3] for name, a in answers.items()}, transports=dict.fromkeys(answers, "local"))

    def result(self, pending: SearchResult) -> SearchResult:
        return pending

    def search(self, info: DatastoreInfo, queries: np.ndarray, k: int, nprobe: int | None, pointers=None) -> SearchResult:
        return self.result(self.start(info, queries, k, nprobe, pointers))

    def release(self, keep: set[tuple[str, int]]) -> None:
        for key in set(self._shards) - keep:
            del self._shards[key]
