"""Top-k over one FAISS index with its values: the one search every caller goes through, online
(a shard's step) and offline (calibration, knnlm-eval, in batches)."""

from __future__ import annotations

import faiss
import numpy as np

from knnlm_core.search.exact import FlatKeys, flat_keys, torch_is_faster, torch_search
from knnlm_core.search.ivf import coarse_by_torch, ivf_centroids, ivf_of, ivf_search
from knnlm_core.search.merge import merge_topk, pad


def gpu_available() -> bool:
    return hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0


def search_index(
    index,
    values: np.ndarray,
    queries: np.ndarray,
    k: int,
    nprobe: int | None = None,
    keep: np.ndarray | None = None,
    first_id: int = 0,
    exact: FlatKeys | None = None,
    centroids: FlatKeys | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(distances, tokens, ids) [n, k] of the k nearest entries, padded with (+inf, -1, -1) past the
    index size; ids are `first_id` + the index's own.

    `nprobe` overrides the index's own for IVF indexes; `keep` (bool per entry) restricts the
    search to a subset, e.g. a random fraction of the datastore. `exact`: a flat index's keys from
    `flat_keys`, searched with torch instead of FAISS where `torch_is_faster`; `centroids`: an IVF
    index's from `ivf_centroids`, for its coarse step where `coarse_by_torch`."""
    queries = np.ascontiguousarray(queries, dtype=np.float32)
    if exact is not None and torch_is_faster(len(queries), index.ntotal, exact.keys.device.type):
        distances, ids = torch_search(exact, queries, k, keep)
    else:
        distances, ids = faiss_search(index, queries, k, nprobe, keep, centroids)
    # Every step pays for this: one gather, and masking only where FAISS left slots empty (a third
    # of the three np.where passes' time at batch 32 and k 1024).
    tokens = np.asarray(values).take(ids, mode="clip").astype(np.int32, copy=False)  # an empty slot's -1 clips to entry 0
    distances, ids = distances.astype(np.float32, copy=False), ids.astype(np.int64, copy=False) + first_id
    empty = ids < first_id
    if empty.any():
        tokens[empty], distances[empty], ids[empty] = -1, np.inf, -1
    return pad(distances, tokens, ids, k)


def faiss_search(
    index, queries: np.ndarray, k: int, nprobe: int | None, keep: np.ndarray | None, centroids: FlatKeys | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """FAISS's (distances, ids) [n, min(k, N)], with the nprobe and subset `search_index` takes;
    with an IVF index's `centroids`, its coarse step by torch where that is faster (`coarse_by_torch`)."""
    if index.ntotal == 0:  # every entry erased (forget --erase)
        return np.empty((len(queries), 0), np.float32), np.empty((len(queries), 0), np.int64)
    bitmap = np.packbits(np.asarray(keep, dtype=bool), bitorder="little") if keep is not None else None
    selector = faiss.IDSelectorBitmap(len(keep), faiss.swig_ptr(bitmap)) if keep is not None else None  # one bit test a code
    params = None
    ivf = ivf_of(index)
    if ivf is not None:  # SearchParametersIVF defaults to nprobe 1: always say which
        params = faiss.SearchParametersIVF(nprobe=min(nprobe or ivf.nprobe, ivf.nlist))
    elif selector is not None:
        params = faiss.SearchParameters()
    if selector is not None:
        params.sel = selector
    if centroids is not None and coarse_by_torch(len(queries), ivf):
        return ivf_search(index, centroids, queries, min(k, index.ntotal), params)
    return index.search(queries, min(k, index.ntotal), params=params)


SEARCH_BATCH = 2048  # queries per FAISS call in offline searches: large batches amortise top-k selection


def search_many(
    shards: list[tuple], queries: np.ndarray, k: int, nprobe: int | None = None, *, progress: bool = False, desc: str = "search"
):
    """The merged top-k (distances, tokens, ids [n, k]) of many queries over `shards`, a list of
    (index, values, keep-mask or None, first id): offline searches (calibration, knnlm-eval), in batches.
    Flat indexes search with torch (`flat_keys`: on a GPU, a copy of their keys there while this runs)."""
    from tqdm import tqdm

    exact = [flat_keys(index, gpu_available()) for index, *_ in shards]
    centroids = [ivf_centroids(index) for index, *_ in shards]
    parts = []
    for i in tqdm(range(0, len(queries), SEARCH_BATCH), desc=desc, disable=not progress):
        q = queries[i : i + SEARCH_BATCH]
        answers = [
            search_index(index, values, q, k, nprobe, keep, first, keys, coarse)
            for (index, values, keep, first), keys, coarse in zip(shards, exact, centroids)
        ]
        parts.append(merge_topk(answers, k))
    return tuple(np.concatenate(column) for column in zip(*parts))
