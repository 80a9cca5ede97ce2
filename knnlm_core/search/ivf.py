"""IVF indexes: their layer inside a wrapped index, their nprobe, and their coarse step by torch."""

from __future__ import annotations

import os
from functools import cache

import faiss
import numpy as np

from knnlm_core.search.exact import FlatKeys, flat_keys, torch_is_faster, torch_search


def is_fast_scan(index) -> bool:
    """Whether `index` is (or wraps) an IVF index with 4-bit fast-scan codes (`PQ{m}x4fs`)."""
    ivf = ivf_of(index)
    return ivf is not None and isinstance(faiss.downcast_index(ivf), faiss.IndexIVFFastScan)


def ivf_centroids(index) -> FlatKeys | None:
    """An IVF index's coarse centroids for `torch_search`, which finds each query's nprobe lists
    faster than FAISS's flat quantizer at a decode step's batch (see `ivf_search`); None for other
    indexes, IVF indexes behind a transform (PCA) and non-flat quantizers (HNSW).

    In fp32 only: over a few thousand centroids the exact matmul is cheap, and bf16 candidates
    would cost more in re-scoring them (a gathered [batch, candidates, d] copy) than they save."""
    if not isinstance(index, faiss.IndexIVF) or index.metric_type != faiss.METRIC_L2:
        return None
    return flat_keys(faiss.downcast_index(index.quantizer), on_gpu=False, bf16=False)


def coarse_by_torch(batch: int, ivf) -> bool:
    """Whether `ivf_search` beats FAISS's own IVF search over the IVF layer `ivf`: where `torch_is_faster`, on one thread;
    on more, only for 4-bit fast-scan lists in a process whose OpenMP threads stop spinning soon
    (`omp_spins_briefly`, as in shard actors). FAISS splits the queries over its threads, coarse
    step and scan together. `search_preassigned` scans 8-bit PQ lists on one thread, and with
    libgomp's default spin each hand-off between torch's and FAISS's thread pools costs more than
    it saves (docs/performance.md has the figures)."""
    if not torch_is_faster(batch, ivf.nlist, "cpu"):
        return False
    if faiss.omp_get_max_threads() == 1:
        return True
    return omp_spins_briefly() and isinstance(faiss.downcast_index(ivf), faiss.IndexIVFFastScan)


@cache
def omp_spins_briefly() -> bool:
    """Whether this process's OpenMP threads go to sleep soon after a parallel region: libgomp's
    GOMP_SPINCOUNT at most 10k, or OMP_WAIT_POLICY=passive. Read once, as libgomp reads them when
    it starts; shard actors start with SHARD_ACTOR_ENV's."""
    if os.environ.get("OMP_WAIT_POLICY", "").lower() == "passive":
        return True
    spin = os.environ.get("GOMP_SPINCOUNT", "")
    return spin.isdigit() and int(spin) <= 10_000


def ivf_search(index, centroids: FlatKeys, queries: np.ndarray, k: int, params) -> tuple[np.ndarray, np.ndarray]:
    """An IVF index's search with its coarse step (each query's `params.nprobe` nearest centroids)
    taken by `torch_search` and the lists scanned by FAISS (`search_preassigned`): the same lists
    and distances in less time."""
    n = len(queries)
    coarse_distances, lists = (np.ascontiguousarray(a) for a in torch_search(centroids, queries, params.nprobe))
    distances, ids = np.empty((n, k), np.float32), np.empty((n, k), np.int64)
    ptr = faiss.swig_ptr
    index.search_preassigned_c(n, ptr(queries), k, ptr(lists), ptr(coarse_distances), ptr(distances), ptr(ids), False, params)
    return distances, ids


def ivf_of(index):
    """The IVF layer inside `index` (possibly behind a PCA transform), or None for other indexes."""
    try:
        return faiss.extract_index_ivf(index)
    except RuntimeError:
        return None


def set_nprobe(index, nprobe: int) -> None:
    ivf = ivf_of(index)
    if ivf is not None:
        ivf.nprobe = nprobe
