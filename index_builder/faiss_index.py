"""FAISS index specs with sensible defaults from the datastore size, training, and adding.

The quantizers (PCA, IVF centroids, PQ codebooks) are trained once on a sample and the trained
empty index is cloned for every shard, so all shards share one coarse quantizer and code space.
"""

from __future__ import annotations

import math

import faiss
import numpy as np

from knnlm_core.errors import ConfigError
from knnlm_core.search import gpu_available, ivf_of

PRESETS = ("auto", "flat", "ivfpq", "hnsw")
# `--index auto`: exact below this many entries, IVF-PQ above: exact while its search costs at
# most ~3x IVF-PQ's. From benchmarks/results/search_backends.json (2 threads, 576-d, batch 32, k
# 1024, p50): the exact search flat shards use (torch) takes 7.6 / 16 / 32 / 82 / 244 ms at 3k /
# 10k / 30k / 100k / 300k entries, IVF-PQ (nprobe 32) 11 / 10 / 10 / 16 / 23 ms: 3.2x at 30k,
# 5.0x at 100k (FAISS's own flat search: 87 ms at 30k).
AUTO_FLAT_BELOW = 30_000
DEFAULT_NPROBE = 32
# From this many IVF lists the coarse quantizer is an HNSW graph over the centroids (FAISS's
# guideline from ~1M entries): assigning 10M keys to 16384 centroids exhaustively is ~2e14 flops
# (an hour on 2 cores), through the graph a few minutes. `efSearch` is saved with the index and
# keeps the nprobe lists found the same as exhaustive assignment's for nprobe up to ~efSearch.
HNSW_QUANTIZER_FROM_NLIST = 16_384
HNSW_QUANTIZER_EF_SEARCH = 128


def index_factory_string(preset: str, entries: int, dim: int, pca_dim: int | None = None) -> str:
    """Turn a preset (or a raw FAISS factory string) into a factory string for `entries` keys."""
    if pca_dim is not None and pca_dim >= dim:
        raise ConfigError(f"--pca-dim {pca_dim} must be below the key dimension {dim}")
    d = pca_dim or dim
    prefix = f"PCA{pca_dim}," if pca_dim else ""
    if preset == "auto":
        preset = "flat" if entries < AUTO_FLAT_BELOW else "ivfpq"
    if preset == "flat":
        return prefix + "Flat"
    if preset == "hnsw":
        return prefix + "HNSW32"
    if preset == "ivfpq":
        # nlist ~ 4 sqrt(N) (the FAISS guideline), a power of two, with >= 39 training points per list.
        nlist = 2 ** round(math.log2(max(4 * math.sqrt(entries), 1)))
        nlist = int(min(nlist, 65536, max(1, entries // 39)))
        # 64-byte codes as in the paper; fewer sub-quantizers when the dimension does not divide.
        # "np": skip polysemous training, which search never uses and which dominates train time.
        m = max(x for x in range(1, 65) if d % x == 0)
        quantizer = "_HNSW32" if nlist >= HNSW_QUANTIZER_FROM_NLIST else ""
        return f"{prefix}IVF{nlist}{quantizer},PQ{m}np"
    return preset  # a FAISS factory string given verbatim


def needs_training(factory: str, dim: int) -> bool:
    return not faiss.index_factory(dim, factory, faiss.METRIC_L2).is_trained


def train_index(factory: str, sample: np.ndarray, seed: int = 0) -> faiss.Index:
    """A trained, empty index; IVF training runs on the GPU when faiss-gpu sees one."""
    index = faiss.index_factory(sample.shape[1], factory, faiss.METRIC_L2)
    if index.is_trained:
        return index
    ivf = ivf_of(index)
    if ivf is not None:
        ivf.cp.seed = seed
        quantizer = faiss.downcast_index(ivf.quantizer)
        if isinstance(quantizer, faiss.IndexHNSW):
            quantizer.hnsw.efSearch = HNSW_QUANTIZER_EF_SEARCH
        if gpu_available():
            ivf.clustering_index = faiss.index_cpu_to_all_gpus(faiss.IndexFlatL2(ivf.d))
    index.train(np.ascontiguousarray(sample, dtype=np.float32))
    return index
