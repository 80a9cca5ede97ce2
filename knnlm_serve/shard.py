"""One datastore shard in memory, and the merge of several shards' answers into a global top-k.

A shard answers `search(queries, k, nprobe) -> (distances, token_ids)`; rows with fewer than k
entries are padded with distance +inf and token -1, so answers from shards of any size merge.
"""

from __future__ import annotations

from pathlib import Path

import faiss
import numpy as np

from knnlm_serve.datastore import Manifest, ShardEntry, load_values


def gpu_available() -> bool:
    return hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0


class ShardSearcher:
    """A FAISS shard with its values; on GPU when faiss-gpu sees a device, else on CPU."""

    def __init__(self, root: Path, shard: ShardEntry, use_gpu: bool | None = None):
        self.name = shard.name
        index = faiss.read_index(str(root / shard.index.path))
        self.values = np.ascontiguousarray(load_values(root / shard.values.path), dtype=np.int32)
        if len(self.values) != index.ntotal:
            raise ValueError(f"shard {shard.name}: {index.ntotal} keys but {len(self.values)} values")
        self.on_gpu = gpu_available() if use_gpu is None else use_gpu
        if self.on_gpu:
            self._gpu_resources = faiss.StandardGpuResources()  # must outlive the GPU index
            index = faiss.index_cpu_to_gpu(self._gpu_resources, 0, index)
        self.index = index
        self.ntotal = index.ntotal
        self.dim = index.d

    def search(self, queries: np.ndarray, k: int, nprobe: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        queries = np.ascontiguousarray(queries, dtype=np.float32)
        params = None
        if nprobe is not None and _is_ivf(self.index):
            params = faiss.SearchParametersIVF(nprobe=nprobe)
        distances, ids = self.index.search(queries, min(k, self.ntotal), params=params)
        tokens = np.where(ids >= 0, self.values[np.maximum(ids, 0)], -1).astype(np.int32)
        distances = np.where(ids >= 0, distances, np.inf).astype(np.float32)
        return _pad(distances, tokens, k)


def _is_ivf(index) -> bool:
    try:
        faiss.extract_index_ivf(index)
        return True
    except RuntimeError:
        return False


def _pad(distances: np.ndarray, tokens: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    missing = k - distances.shape[1]
    if missing <= 0:
        return distances, tokens
    n = distances.shape[0]
    return (
        np.concatenate([distances, np.full((n, missing), np.inf, np.float32)], axis=1),
        np.concatenate([tokens, np.full((n, missing), -1, np.int32)], axis=1),
    )


def merge_topk(answers: list[tuple[np.ndarray, np.ndarray]], k: int) -> tuple[np.ndarray, np.ndarray]:
    """Merge per-shard (distances, tokens) answers into the global k nearest, sorted by distance."""
    distances = np.concatenate([d for d, _ in answers], axis=1)
    tokens = np.concatenate([t for _, t in answers], axis=1)
    order = np.argsort(distances, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(distances, order, axis=1), np.take_along_axis(tokens, order, axis=1)


def open_shards(root: Path, manifest: Manifest, use_gpu: bool | None = None) -> list[ShardSearcher]:
    return [ShardSearcher(root, shard, use_gpu=use_gpu) for shard in manifest.shards]
