"""Batched top-k search over a datastore version's shards: Ray actors (one per shard) or in-process.

Both backends answer `search(info, queries, k, nprobe, pointers)` with the global top-k merged
from every shard's top-k by distance; rows with pointers (pointer following) are scored against
those entries instead of searched, in the same call. A shard that fails or misses the deadline is left out (policy
`partial`) or fails the whole search (policy `lm_only`); either way the caller learns why.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from knnlm_core.config import KnnConfig
from knnlm_core.datastore import read_manifest
from knnlm_core.errors import ErrorKind, KnnlmError
from knnlm_core.search import ShardSearcher, gpu_available, merge_topk, shard_first_ids
from knnlm_serve.runtime import DatastoreInfo


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
        return {"name": self.searcher.name, "entries": self.searcher.ntotal, "on_gpu": self.searcher.on_gpu, "pid": os.getpid()}

    def search(self, queries: np.ndarray, k: int, nprobe: int | None, pointers: np.ndarray | None = None):
        return _timed(self.searcher.find, queries, k, nprobe, pointers)


def actor_name(info: DatastoreInfo, shard: str) -> str:
    return f"{info.name}@{info.version}/{shard}"


def start_shard_actors(info: DatastoreInfo, knn: KnnConfig) -> list:
    """One named actor per shard of this datastore version, loaded before this returns.

    Ray restarts a dead actor (reloading its shard) under the same name and handle."""
    import ray

    use_gpu = knn.gpu if knn.gpu is not None else gpu_available()
    actors = [
        ray.remote(ShardActor)
        .options(
            name=actor_name(info, shard),
            namespace=knn.ray_namespace,
            get_if_exists=True,
            max_restarts=-1,
            num_cpus=0,
            num_gpus=knn.gpu_fraction if use_gpu else 0,
        )
        .remote(info.path, shard, use_gpu, knn.shard_threads)
        for shard in info.shards
    ]
    ray.get([a.describe.remote() for a in actors])
    return actors


class RayRetriever:
    """Fans a step's queries out to every shard actor in parallel and merges what comes back in time."""

    def __init__(self, knn: KnnConfig, ray_address: str | None):
        import ray

        if not ray.is_initialized():
            ray.init(address=ray_address, namespace=knn.ray_namespace, log_to_driver=False)
        self.knn = knn
        self._actors: dict[tuple[str, int], list] = {}

    def _handles(self, info: DatastoreInfo) -> list:
        import ray

        if info.key not in self._actors:
            self._actors[info.key] = [ray.get_actor(actor_name(info, s), namespace=self.knn.ray_namespace) for s in info.shards]
        return self._actors[info.key]

    def search(self, info: DatastoreInfo, queries: np.ndarray, k: int, nprobe: int | None, pointers=None) -> SearchResult:
        import ray

        # The queries go with the call, not through ray.put: Ray inlines arguments under 100 KB (a
        # step's batch of 32 is 74 KB) and puts larger ones itself; measured here, 3.2 ms a round
        # trip instead of 5.6 with an explicit put.
        queries = np.ascontiguousarray(queries, dtype=np.float32)
        refs = {shard: actor.search.remote(queries, k, nprobe, pointers) for shard, actor in zip(info.shards, self._handles(info))}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=self.knn.shard_timeout_s)
        answers, seconds, failed = [], {}, {}
        for shard, ref in refs.items():
            if ref not in ready:
                failed[shard] = "shard_timeout"
                ray.cancel(ref)
                continue
            try:
                *answer, took = ray.get(ref)
            except ray.exceptions.RayError:
                failed[shard] = "shard_error"
                continue
            answers.append(answer)
            seconds[shard] = took
        if failed and (not answers or self.knn.on_shard_failure == "lm_only"):
            reason = next(iter(failed.values()))
            raise RetrievalError(f"datastore {info.name!r} v{info.version}: shards {failed}", reason)
        distances, tokens, ids = merge_topk(answers, k)
        return SearchResult(distances, tokens, ids, seconds, failed)

    def release(self, keep: set[tuple[str, int]]) -> None:
        for key in set(self._actors) - keep:
            del self._actors[key]


def make_retriever(knn: KnnConfig, ray_address: str | None) -> LocalRetriever | RayRetriever:
    return RayRetriever(knn, ray_address) if knn.backend == "ray" else LocalRetriever(knn)
