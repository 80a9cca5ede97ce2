"""FAISS index specs with sensible defaults from the datastore size, training, and adding.

The quantizers (PCA, IVF centroids, PQ codebooks) are trained once on a sample and the trained
empty index is cloned for every shard, so all shards share one coarse quantizer and code space.
"""

from __future__ import annotations

import logging
import math

import faiss
import numpy as np

from knnlm_core.errors import ConfigError
from knnlm_core.search import gpu_available, ivf_of

logger = logging.getLogger("index_builder")

PRESETS = ("auto", "flat", "ivfpq", "hnsw")
# `--index auto`: exact below this many entries, IVF-PQ above: exact while its search costs at
# most ~3x IVF-PQ's (benchmarks/results/search_backends.json; docs/performance.md). Fast-scan
# codes search faster still, so the line is if anything conservative.
AUTO_FLAT_BELOW = 30_000
DEFAULT_NPROBE = 32
# An IVF index given an HNSW coarse quantizer (a factory string such as "IVF16384_HNSW32,PQ64np")
# searches its graph with this beam, saved with the index: FAISS's default (16) puts keys in other
# lists than exhaustive assignment picks far more often, and exhaustive assignment is faster
# still at the presets' sizes, so the presets keep the flat quantizer.
HNSW_QUANTIZER_EF_SEARCH = 128
OUTLIER_PEAK_FACTOR = 2.0  # see typical_keys


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
        # 4-bit fast-scan PQ, 4 dimensions a sub-quantizer (d / 8 bytes an entry; at most 256 of
        # them, fewer where the dimension does not divide): the kNN-LM perplexity of 8-bit PQ64
        # with a faster decode-step search (benchmarks/pq_codes.py; docs/performance.md).
        m = max(x for x in range(1, max(1, min(d // 4, 256)) + 1) if d % x == 0)
        return f"{prefix}IVF{nlist},PQ{m}x4fs"
    return preset  # a FAISS factory string given verbatim


def checked_factory_string(preset: str, entries: int, dim: int, pca_dim: int | None = None) -> str:
    """index_factory_string, refused before any key is encoded where FAISS cannot make that index."""
    factory = index_factory_string(preset, entries, dim, pca_dim)
    try:
        faiss.index_factory(dim, factory, faiss.METRIC_L2)
    except RuntimeError as e:
        reason = str(e).strip().splitlines()[-1].rsplit(": ", 1)[-1]
        raise ConfigError(
            f"index: FAISS cannot make {factory!r} for {dim}-dimensional keys ({reason}); "
            f"use one of {', '.join(PRESETS)} or a FAISS factory string such as IVF1024,PQ8"
        ) from None
    return factory


def needs_training(factory: str, dim: int) -> bool:
    return not faiss.index_factory(dim, factory, faiss.METRIC_L2).is_trained


def typical_keys(sample: np.ndarray) -> np.ndarray:
    """The training sample without its outlier keys: those whose largest |value| is over
    OUTLIER_PEAK_FACTOR x the sample's 99.9th percentile of it. A transformer gives the first
    position of a sequence a massive activation (SmolLM2's ffn_input: 31.5 in one dimension, every
    other key under 7.9). Trained on, such a key took a PQ centroid of its own, whose distance table
    spanned ~2000x the others'. Fast-scan PQ rounds all tables to 8 bits on one scale, so every
    other sub-quantizer rounded to 0 and all neighbours came back at one distance. The key is still
    added and searched."""
    peak = np.abs(sample).max(axis=1)
    keep = peak <= OUTLIER_PEAK_FACTOR * np.quantile(peak, 0.999)
    if not keep.all():
        logger.info("train: %d outlier key(s) left out (largest |value| %.1f)", int((~keep).sum()), float(peak.max()))
    return sample[keep]


def train_index(factory: str, sample: np.ndarray, seed: int = 0) -> tuple[faiss.Index, int]:
    """A trained, empty index and how many keys it was trained on (the sample's `typical_keys`; 0
    where the factory needs no training). IVF training runs on the GPU when faiss-gpu sees one."""
    index = faiss.index_factory(sample.shape[1], factory, faiss.METRIC_L2)
    if index.is_trained:
        return index, 0
    ivf = ivf_of(index)
    if ivf is not None:
        ivf.cp.seed = seed
        quantizer = faiss.downcast_index(ivf.quantizer)
        if isinstance(quantizer, faiss.IndexHNSW):
            quantizer.hnsw.efSearch = HNSW_QUANTIZER_EF_SEARCH
        if gpu_available():
            ivf.clustering_index = faiss.index_cpu_to_all_gpus(faiss.IndexFlatL2(ivf.d))
    typical = np.ascontiguousarray(typical_keys(sample), dtype=np.float32)
    index.train(typical)
    return index, len(typical)
