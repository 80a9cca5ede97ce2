"""Batched top-k search over a datastore's shards: Ray actors (one per shard) or in-process.

Both backends answer `search(datastore, queries, k, nprobe) -> (distances, tokens)` with the
global top-k, merged from every shard's top-k by distance.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from knnlm_serve.datastore import read_manifest
from knnlm_serve.runtime import Runtime
from knnlm_serve.shard import ShardSearcher, gpu_available, merge_topk


class RetrievalError(RuntimeError):
    """A search that did not complete (shard dead or too slow); the step falls back to the LM."""


class LocalRetriever:
    """All shards in this process: for tests, tiny stores and single-process deployments."""

    def __init__(self, runtime: Runtime):
        self.shards: dict[str, list[ShardSearcher]] = {}
        for name, info in runtime.datastores.items():
            manifest = read_manifest(info.path)
            self.shards[name] = [ShardSearcher(Path(info.path), s, use_gpu=runtime.knn.gpu) for s in manifest.shards]

    def search(self, datastore: str, queries: np.ndarray, k: int, nprobe: int | None) -> tuple[np.ndarray, np.ndarray]:
        return merge_topk([s.search(queries, k, nprobe) for s in self.shards[datastore]], k)


class ShardActor:
    """A Ray actor holding one FAISS shard (GPU FAISS when the actor has a GPU)."""

    def __init__(self, root: str, shard_name: str, use_gpu: bool | None):
        manifest = read_manifest(root)
        (shard,) = [s for s in manifest.shards if s.name == shard_name]
        self.searcher = ShardSearcher(Path(root), shard, use_gpu=use_gpu)

    def describe(self) -> dict:
        return {"name": self.searcher.name, "entries": self.searcher.ntotal, "on_gpu": self.searcher.on_gpu}

    def search(self, queries: np.ndarray, k: int, nprobe: int | None) -> tuple[np.ndarray, np.ndarray]:
        return self.searcher.search(queries, k, nprobe)


def actor_name(datastore: str, shard: str) -> str:
    return f"{datastore}/{shard}"


def start_shard_actors(runtime: Runtime) -> list:
    """Create (or reuse) one named actor per shard in the runtime's namespace; wait until loaded.

    The caller (the launcher) owns them: they live as long as the server does."""
    import ray

    use_gpu = runtime.knn.gpu if runtime.knn.gpu is not None else gpu_available()
    actors = []
    for name, info in runtime.datastores.items():
        for shard in info.shards:
            options = dict(name=actor_name(name, shard), namespace=runtime.knn.ray_namespace,
                           get_if_exists=True, max_restarts=-1, num_cpus=0, num_gpus=runtime.knn.gpu_fraction if use_gpu else 0)
            actors.append(ray.remote(ShardActor).options(**options).remote(info.path, shard, use_gpu))
    ray.get([a.describe.remote() for a in actors])
    return actors


class RayRetriever:
    """Fans a step's queries out to every shard actor in parallel and merges their answers."""

    def __init__(self, runtime: Runtime):
        import ray

        if not ray.is_initialized():
            ray.init(address=runtime.ray_address, namespace=runtime.knn.ray_namespace, log_to_driver=False)
        self.timeout = runtime.knn.shard_timeout_s
        self.actors = {
            name: [ray.get_actor(actor_name(name, s), namespace=runtime.knn.ray_namespace) for s in info.shards]
            for name, info in runtime.datastores.items()
        }

    def search(self, datastore: str, queries: np.ndarray, k: int, nprobe: int | None) -> tuple[np.ndarray, np.ndarray]:
        import ray

        queries_ref = ray.put(np.ascontiguousarray(queries, dtype=np.float32))
        refs = [actor.search.remote(queries_ref, k, nprobe) for actor in self.actors[datastore]]
        try:
            answers = ray.get(refs, timeout=self.timeout)
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayError) as e:
            raise RetrievalError(f"datastore {datastore!r}: {type(e).__name__}: {e}") from e
        return merge_topk(answers, k)


def make_retriever(runtime: Runtime) -> LocalRetriever | RayRetriever:
    return RayRetriever(runtime) if runtime.knn.backend == "ray" else LocalRetriever(runtime)
