"""Each datastore version searched where it is held: by the server's backend, or in this process
where the registry says so (`DatastoreInfo.in_process`: a vector store's datastore, small and
many, where a set of shard actors each would not fit)."""

from __future__ import annotations

import numpy as np

from knnlm_core.config import KnnConfig
from knnlm_core.pointers import RowLinks
from knnlm_serve.retrieval.fanout import RayRetriever
from knnlm_serve.retrieval.local import LocalRetriever, PendingLocal
from knnlm_serve.retrieval.types import SearchResult
from knnlm_serve.runtime import DatastoreInfo


class PlacedRetriever:
    def __init__(self, knn: KnnConfig, ray_address: str | None):
        self.local = LocalRetriever(knn)
        self.ray = RayRetriever(knn, ray_address) if knn.backend == "ray" else None

    def _of(self, info: DatastoreInfo) -> LocalRetriever | RayRetriever:
        return self.ray if self.ray is not None and not info.in_process else self.local

    def links_rows(self, info: DatastoreInfo) -> bool:
        return self._of(info).links_rows(info)

    def start(self, info: DatastoreInfo, queries: np.ndarray, k: int, nprobe: int | None, pointers=None, links: RowLinks | None = None):
        return self._of(info).start(info, queries, k, nprobe, pointers, links)

    def result(self, pending) -> SearchResult:
        return self.local.result(pending) if isinstance(pending, PendingLocal) else self.ray.result(pending)

    def search(self, info: DatastoreInfo, queries: np.ndarray, k: int, nprobe: int | None, pointers=None) -> SearchResult:
        return self.result(self.start(info, queries, k, nprobe, pointers))

    def release(self, keep: set[tuple[str, int]]) -> None:
        self.local.release(keep)
        if self.ray is not None:
            self.ray.release(keep)
