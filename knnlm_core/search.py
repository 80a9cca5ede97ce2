"""Search: one datastore shard in memory, batched top-k over it, and the merge of shards' answers.

The server's shard actors, the evaluator, `knnlm-index verify` and the benchmarks all search
through `search_index`, so they agree on padding, nprobe and token lookup.

A shard answers `search(queries, k, nprobe) -> (distances, token_ids)`; rows with fewer than k
entries are padded with distance +inf and token -1, so answers from shards of any size merge.
"""

from __future__ import annotations

from pathlib import Path

import faiss
import numpy as np

from knnlm_core.datastore import Manifest, ShardEntry, load_values
from knnlm_core.errors import DatastoreError


def gpu_available() -> bool:
    return hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0


class ShardSearcher:
    """A FAISS shard with its values; on GPU when faiss-gpu sees a device, else on CPU."""

    def __init__(self, root: Path, shard: ShardEntry, use_gpu: bool | None = None):
        self.name = shard.name
        index = faiss.read_index(str(root / shard.index.path))
        self.values = np.ascontiguousarray(load_values(root / shard.values.path), dtype=np.int32)
        if len(self.values) != index.ntotal:
            raise DatastoreError(f"shard {shard.name}: {index.ntotal} keys but {len(self.values)} values; rebuild the datastore")
        self.on_gpu = gpu_available() if use_gpu is None else use_gpu
        if self.on_gpu:
            self._gpu_resources = faiss.StandardGpuResources()  # must outlive the GPU index
            index = faiss.index_cpu_to_gpu(self._gpu_resources, 0, index)
        self.index = index
        self.ntotal = index.ntotal
        self.dim = index.d

    def search(self, queries: np.ndarray, k: int, nprobe: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        return search_index(self.index, self.values, queries, k, nprobe)


def search_index(
    index, values: np.ndarray, queries: np.ndarray, k: int, nprobe: int | None = None, keep: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(distances, tokens) [n, k] of the k nearest entries, padded with (+inf, -1) past the index size.

    `nprobe` overrides the index's own for IVF indexes; `keep` (bool per entry) restricts the
    search to a subset, e.g. a random fraction of the datastore."""
    queries = np.ascontiguousarray(queries, dtype=np.float32)
    selector = faiss.IDSelectorBatch(np.flatnonzero(keep).astype(np.int64)) if keep is not None else None
    params = None
    ivf = ivf_of(index)
    if ivf is not None:  # SearchParametersIVF defaults to nprobe 1: always say which
        params = faiss.SearchParametersIVF(nprobe=nprobe or ivf.nprobe)
    elif selector is not None:
        params = faiss.SearchParameters()
    if selector is not None:
        params.sel = selector
    distances, ids = index.search(queries, min(k, index.ntotal), params=params)
    tokens = np.where(ids >= 0, values[np.maximum(ids, 0)], -1).astype(np.int32)
    return _pad(np.where(ids >= 0, distances, np.inf).astype(np.float32), tokens, k)


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


SEARCH_BATCH = 2048  # queries per FAISS call in offline searches: large batches amortise top-k selection


def search_many(
    shards: list[tuple], queries: np.ndarray, k: int, nprobe: int | None = None, *, progress: bool = False, desc: str = "search"
):
    """The merged top-k (distances [n, k], tokens [n, k]) of many queries over `shards`, a list of
    (index, values, keep-mask or None): offline searches (calibration, knnlm-eval), in batches."""
    from tqdm import tqdm

    out_d, out_t = [], []
    for i in tqdm(range(0, len(queries), SEARCH_BATCH), desc=desc, disable=not progress):
        q = queries[i : i + SEARCH_BATCH]
        d, t = merge_topk([search_index(index, values, q, k, nprobe, keep) for index, values, keep in shards], k)
        out_d.append(d)
        out_t.append(t)
    return np.concatenate(out_d), np.concatenate(out_t)
