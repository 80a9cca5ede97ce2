"""Search: one datastore shard in memory, batched top-k over it, and the merge of shards' answers.

The server's shard actors, the evaluator, `knnlm-index verify` and the benchmarks all search
through `search_index`, so they agree on padding, nprobe and token lookup.

A shard answers `search(queries, k, nprobe) -> (distances, token_ids, entry_ids)`; rows with
fewer than k entries are padded with distance +inf, token -1 and id -1, so answers from shards
of any size merge. Entry ids are global (the shard's first id plus its FAISS id): entries are in
corpus order across shards, which pointer following relies on.
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

    def __init__(self, root: Path, shard: ShardEntry, first_id: int, use_gpu: bool | None = None):
        self.name = shard.name
        self.first_id = first_id
        index = faiss.read_index(str(root / shard.index.path))
        self.values = np.ascontiguousarray(load_values(root / shard.values.path), dtype=np.int32)
        if len(self.values) != index.ntotal:
            raise DatastoreError(f"shard {shard.name}: {index.ntotal} keys but {len(self.values)} values; rebuild the datastore")
        self.on_gpu = gpu_available() if use_gpu is None else use_gpu
        self.exact = ExactKeys.of(index)  # flat shards: searched as a torch matmul + top-k
        if self.on_gpu and self.exact is None:
            self._gpu_resources = faiss.StandardGpuResources()  # must outlive the GPU index
            index = faiss.index_cpu_to_gpu(self._gpu_resources, 0, index)
        self.index = index
        self.ntotal = index.ntotal
        self.dim = index.d
        self._reconstructs = None

    def find(self, queries: np.ndarray, k: int, nprobe: int | None, pointers: np.ndarray | None) -> tuple[np.ndarray, ...]:
        """One step's neighbours [n, k]: rows with pointers (`pointers[i]`: candidate ids, -1 padding;
        a row follows when its first is set) are scored against them, the others searched."""
        follow = np.zeros(len(queries), dtype=bool) if pointers is None else pointers[:, 0] >= 0
        if not follow.any():
            return self.search(queries, k, nprobe)
        n = len(queries)
        out = (np.full((n, k), np.inf, np.float32), np.full((n, k), -1, np.int32), np.full((n, k), -1, np.int64))
        if not follow.all():
            for column, values in zip(out, self.search(queries[~follow], k, nprobe)):
                column[~follow] = values
        for column, values in zip(out, self.lookup(queries[follow], pointers[follow])):
            width = min(k, values.shape[1])
            column[follow, :width] = values[:, :width]
        return out

    def search(self, queries: np.ndarray, k: int, nprobe: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if self.exact is not None:
            distances, ids = self.exact.search(queries, k)
            tokens = np.where(ids >= 0, self.values[np.maximum(ids, 0)], -1).astype(np.int32)
            return _pad(distances, tokens, np.where(ids >= 0, ids + self.first_id, -1), k)
        return search_index(self.index, self.values, queries, k, nprobe, first_id=self.first_id)

    def lookup(self, queries: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Score row i's candidate entries `ids[i]` (global ids, -1 padding; ids of other shards are
        left out) against query i: (distances, tokens, ids) sorted by distance, padded as search's.
        The distance is the index's own (exact keys for Flat, the decoded codes for PQ)."""
        local = np.where((ids >= self.first_id) & (ids < self.first_id + self.ntotal), ids - self.first_id, -1)
        found = local >= 0
        if self._reconstructs is None:
            ivf = ivf_of(self.index)
            if ivf is not None:  # IVF lists reconstruct through a direct map (8 bytes per entry), made once
                ivf.make_direct_map()
            self._reconstructs = True
        keys = np.zeros((*ids.shape, self.dim), dtype=np.float32)
        keys[found] = self.index.reconstruct_batch(local[found].astype(np.int64))
        distances = np.where(found, np.sum((keys - queries[:, None, :]) ** 2, axis=2), np.inf).astype(np.float32)
        order = np.argsort(distances, axis=1, kind="stable")
        tokens = np.where(found, self.values[np.maximum(local, 0)], -1).astype(np.int32)
        return tuple(np.take_along_axis(a, order, axis=1) for a in (distances, tokens, np.where(found, ids, -1)))


class ExactKeys:
    """A flat shard's keys as a torch matrix: exact top-k as one matmul and `torch.topk`.

    At the k kNN-LM uses (hundreds to thousands) FAISS's flat search spends most of its time in
    top-k selection, not distances: measured here (2 threads, 576-d, batch 32, k 1024) 27 ms vs 18
    for 17k keys and 180 vs 77 for 120k, same neighbours. On CPU the matrix is a view of the FAISS
    index's own storage (no copy); on a GPU it is copied there once."""

    def __init__(self, keys: np.ndarray):
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
        self.keys = torch.from_numpy(keys).to(device)
        self.norms = (self.keys * self.keys).sum(dim=1)

    @classmethod
    def of(cls, index) -> ExactKeys | None:
        if type(index) is not faiss.IndexFlatL2 or index.ntotal == 0:
            return None
        return cls(faiss.rev_swig_ptr(index.get_xb(), index.ntotal * index.d).reshape(index.ntotal, index.d))

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(squared L2 distances, ids) [n, min(k, entries)], nearest first, as FAISS's IndexFlatL2."""
        import torch

        q = torch.from_numpy(np.ascontiguousarray(queries, dtype=np.float32)).to(self.keys.device)
        distances = torch.addmm(self.norms, q, self.keys.T, alpha=-2).add_((q * q).sum(dim=1, keepdim=True))
        values, ids = torch.topk(distances, min(k, len(self.keys)), dim=1, largest=False, sorted=True)
        return values.clamp_(min=0).cpu().numpy(), ids.cpu().numpy().astype(np.int64)


def search_index(
    index, values: np.ndarray, queries: np.ndarray, k: int, nprobe: int | None = None, keep: np.ndarray | None = None, first_id: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(distances, tokens, ids) [n, k] of the k nearest entries, padded with (+inf, -1, -1) past the
    index size; ids are `first_id` + the index's own.

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
    return _pad(np.where(ids >= 0, distances, np.inf).astype(np.float32), tokens, np.where(ids >= 0, ids + first_id, -1), k)


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


def _pad(distances: np.ndarray, tokens: np.ndarray, ids: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    missing = k - distances.shape[1]
    if missing <= 0:
        return distances, tokens, ids.astype(np.int64)
    n = distances.shape[0]
    return (
        np.concatenate([distances, np.full((n, missing), np.inf, np.float32)], axis=1),
        np.concatenate([tokens, np.full((n, missing), -1, np.int32)], axis=1),
        np.concatenate([ids.astype(np.int64), np.full((n, missing), -1, np.int64)], axis=1),
    )


def merge_topk(answers: list[tuple[np.ndarray, ...]], k: int) -> tuple[np.ndarray, ...]:
    """Merge per-shard (distances, tokens, ids) answers into the global k nearest, sorted by distance."""
    if len(answers) == 1:  # one shard's answer is already its top-k, sorted
        return tuple(a[:, :k] for a in answers[0])
    columns = [np.concatenate(column, axis=1) for column in zip(*answers)]
    order = np.argsort(columns[0], axis=1, kind="stable")[:, :k]
    return tuple(np.take_along_axis(c, order, axis=1) for c in columns)


def shard_first_ids(manifest: Manifest) -> list[int]:
    """Each shard's first global entry id (shards hold contiguous ranges, in order)."""
    return np.concatenate([[0], np.cumsum([s.entries for s in manifest.shards])[:-1]]).astype(int).tolist()


def open_shards(root: Path, manifest: Manifest, use_gpu: bool | None = None) -> list[ShardSearcher]:
    return [ShardSearcher(root, shard, first, use_gpu=use_gpu) for shard, first in zip(manifest.shards, shard_first_ids(manifest))]


SEARCH_BATCH = 2048  # queries per FAISS call in offline searches: large batches amortise top-k selection


def search_many(
    shards: list[tuple], queries: np.ndarray, k: int, nprobe: int | None = None, *, progress: bool = False, desc: str = "search"
):
    """The merged top-k (distances, tokens, ids [n, k]) of many queries over `shards`, a list of
    (index, values, keep-mask or None, first id): offline searches (calibration, knnlm-eval), in batches."""
    from tqdm import tqdm

    parts = []
    for i in tqdm(range(0, len(queries), SEARCH_BATCH), desc=desc, disable=not progress):
        q = queries[i : i + SEARCH_BATCH]
        parts.append(merge_topk([search_index(index, values, q, k, nprobe, keep, first) for index, values, keep, first in shards], k))
    return tuple(np.concatenate(column) for column in zip(*parts))
