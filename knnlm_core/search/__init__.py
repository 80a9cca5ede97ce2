"""Search: one datastore shard in memory, batched top-k over it, and the merge of shards' answers.

The server's shard actors, the evaluator, `knnlm-index verify` and the benchmarks all search
through `search_index`, so they agree on padding, nprobe and token lookup.

A shard answers `search(queries, k, nprobe) -> (distances, token_ids, entry_ids)`; rows with
fewer than k entries are padded with distance +inf, token -1 and id -1, so answers from shards
of any size merge. Entry ids are global (the shard's first id plus its FAISS id): entries are in
corpus order across shards, which pointer following relies on.

Exact (flat) shards are searched as one torch matmul + `torch.topk` (`torch_search`) wherever the
search-backend benchmark says that beats FAISS's own flat search (`torch_is_faster`), other indexes by FAISS;
IVF indexes take their coarse step (each query's nprobe lists) the same way (`ivf_search`).

    shard.py   a shard in memory: search, pointer lookup, reconstruction
    index.py   top-k over one index with its values (online and offline)
    exact.py   exact search with torch, for flat shards
    ivf.py     IVF indexes: nprobe, their coarse step by torch
    merge.py   padding and the merge of shards' answers
"""

from __future__ import annotations

from knnlm_core.search.exact import FlatKeys, flat_keys, torch_is_faster, torch_search
from knnlm_core.search.index import faiss_search, gpu_available, search_index, search_many
from knnlm_core.search.ivf import coarse_by_torch, is_fast_scan, ivf_centroids, ivf_of, omp_spins_briefly, set_nprobe
from knnlm_core.search.merge import merge_topk
from knnlm_core.search.shard import ShardSearcher, open_shards, shard_first_ids

__all__ = [
    "FlatKeys",
    "ShardSearcher",
    "coarse_by_torch",
    "faiss_search",
    "flat_keys",
    "gpu_available",
    "is_fast_scan",
    "ivf_centroids",
    "ivf_of",
    "merge_topk",
    "omp_spins_briefly",
    "open_shards",
    "search_index",
    "search_many",
    "set_nprobe",
    "shard_first_ids",
    "torch_is_faster",
    "torch_search",
]
