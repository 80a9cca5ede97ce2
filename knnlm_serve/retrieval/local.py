"""Shards searched in this process: for tests, tiny stores and single-process deployments."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from knnlm_core.config import KnnConfig
from knnlm_core.datastore import load_document_starts, read_manifest
from knnlm_core.pointers import RowLinks, find_linked
from knnlm_core.search import ShardSearcher, merge_topk, open_shards
from knnlm_serve.retrieval.types import SearchResult, timed
from knnlm_serve.runtime import DatastoreInfo


class LocalRetriever:
    def __init__(self, knn: KnnConfig):
        self.gpu, self.mmap = knn.gpu, knn.mmap
        self._shards: dict[tuple[str, int], tuple[list[ShardSearcher], np.ndarray | None]] = {}  # with document starts

    def links_rows(self, info: DatastoreInfo) -> bool:
        """Whether a call may link rows (`RowLinks`): always, every shard is in this process."""
        return True

    def start(
        self, info: DatastoreInfo, queries: np.ndarray, k: int, nprobe: int | None, pointers=None, links: RowLinks | None = None
    ) -> SearchResult:
        """In-process shards search at once: their answer is the pending search."""
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

        if links is None:
            distances, tokens, ids = find(queries, k, nprobe, pointers)
        else:
            distances, tokens, ids = find_linked(find, queries, k, nprobe, pointers, links, document_starts)
        return SearchResult(distances, tokens, ids, seconds, transports=dict.fromkeys(seconds, "local"))

    def result(self, pending: SearchResult) -> SearchResult:
        return pending

    def search(self, info: DatastoreInfo, queries: np.ndarray, k: int, nprobe: int | None, pointers=None) -> SearchResult:
        return self.result(self.start(info, queries, k, nprobe, pointers))

    def release(self, keep: set[tuple[str, int]]) -> None:
        for key in set(self._shards) - keep:
            del self._shards[key]
