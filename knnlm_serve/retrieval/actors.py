"""The Ray actor that holds one FAISS shard, and starting a datastore version's actors.

A version's actors are named (`actor_name`), so every engine process on the cluster reaches the
same ones, and Ray restarts a dead one under the same name. A version made by an add or a forget
keeps the actors of the shards it did not change. They run with their own process environment
(`SHARD_ACTOR_ENV`, a Ray runtime_env, so it holds on any cluster).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from pathlib import Path

import numpy as np

from knnlm_core.config import KnnConfig
from knnlm_core.datastore import load_document_starts, read_manifest
from knnlm_core.errors import ErrorKind, KnnlmError
from knnlm_core.pointers import RowLinks, find_linked
from knnlm_core.search import gpu_available, open_shards
from knnlm_serve.retrieval.types import timed
from knnlm_serve.runtime import DatastoreInfo

logger = logging.getLogger("knnlm_serve")

# What every process on a step's search path runs with (vLLM's, and the shard actors):
# - Searches' queries and answers up to 4 MiB (a prompt's rows, batch 256 at k 1024) go inline
#   with the call and its reply, not through the object store (Ray's default limit is 100 KB): a
#   caller that puts each large batch there maps ever more of the store's shared memory, which
#   then counts as its own, and a long-running worker creeps by the store's size.
# - glibc's malloc raises its mmap threshold after each large free (up to 32 MiB), so buffers of
#   ever-new batch shapes then come from a heap it does not give back; a fixed threshold keeps
#   large buffers mapped and unmapped.
# - oneDNN keeps every matmul primitive it makes in a process-wide cache (1,024 by default), and
#   vLLM's CPU linear layers make one per new batch size (rows in a step): a long-running worker's
#   heap filled with them. vLLM keeps its own recent ones per layer, so none is kept twice.
SERVING_PROCESS_ENV = {
    "RAY_max_direct_call_object_size": str(4 * 2**20),
    "MALLOC_MMAP_THRESHOLD_": str(2**20),
    "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0",
}
# The shard actors' own, beside it:
# - OpenMP (FAISS, torch) threads spin after each parallel region before they sleep; libgomp's
#   default spin held the cores after every search while the caller waiting for the answer and
#   the actor's own thread sending it needed one.
# - Niceness 0, not the 15 Ray starts worker processes at: a search is on every step's critical
#   path, and at 15 it yields its core to anything else there (the API server, the engine core).
SHARD_ACTOR_ENV = {"GOMP_SPINCOUNT": "1000", "RAY_worker_niceness": "0", **SERVING_PROCESS_ENV}


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
        (self.searcher,) = open_shards(Path(root), manifest, use_gpu, mmap, names={shard_name})
        # for linked rows, which only a version with this one shard sends
        self.document_starts = load_document_starts(Path(root), manifest) if len(manifest.shards) == 1 else None

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

    def search(self, queries: np.ndarray, k: int, nprobe: int | None, pointers: np.ndarray | None = None, links: RowLinks | None = None):
        self._use_search_threads()
        if links is None:
            return timed(self.searcher.find, queries, k, nprobe, pointers)
        return timed(find_linked, self.searcher.find, queries, k, nprobe, pointers, links, self.document_starts)

    def search_step(self, step: tuple):
        """`search(*step)` for a compiled graph: one input channel for the step, not one per argument."""
        return self.search(*step)

    def _use_search_threads(self) -> None:
        """Give the calling thread `_search_threads` OpenMP threads (FAISS, and torch for flat shards).

        OpenMP's thread count is per calling thread, and a thread that never set it starts at Ray's
        OMP_NUM_THREADS=1: a compiled graph calls `search` from its own thread, where FAISS would
        run on one core."""
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
    """The shard's actor: one per load of the datastore (`info.actors`) and per state of the shard
    (`info.shard_keys`), so an add or a forget reaches the actors of the shards it left unchanged."""
    key = info.shard_keys[info.shards.index(shard)]
    return f"{info.name}@{info.actors}/{shard}:{key}" + (f"#{replica}" if replica else "")


def start_shard_actors(info: DatastoreInfo, knn: KnnConfig) -> list[list]:
    """`knn.replicas` named actors per shard of this datastore version (per shard, a list of
    replicas), loaded before this returns; those that exist under their names already are reused.
    Replicas of a shard are spread over the nodes that offer `knn.shard_resources`, as far as Ray can.

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
