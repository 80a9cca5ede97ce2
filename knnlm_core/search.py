"""Search: one datastore shard in memory, batched top-k over it, and the merge of shards' answers.

The server's shard actors, the evaluator, `knnlm-index verify` and the benchmarks all search
through `search_index`, so they agree on padding, nprobe and token lookup.

A shard answers `search(queries, k, nprobe) -> (distances, token_ids, entry_ids)`; rows with
fewer than k entries are padded with distance +inf, token -1 and id -1, so answers from shards
of any size merge. Entry ids are global (the shard's first id plus its FAISS id): entries are in
corpus order across shards, which pointer following relies on.

Exact (flat) shards are searched as one torch matmul + `torch.topk` (`torch_search`) wherever the
measured curve says that beats FAISS's own flat search (`torch_is_faster`), other indexes by FAISS;
IVF indexes take their coarse step (each query's nprobe lists) the same way (`ivf_search`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

import faiss
import numpy as np

from knnlm_core.datastore import Manifest, ShardEntry, load_values
from knnlm_core.errors import ConfigError, DatastoreError

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


def gpu_available() -> bool:
    return hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0


class ShardSearcher:
    """A FAISS shard with its values; on GPU when faiss-gpu sees a device, else on CPU.

    `mmap`: the index file is mapped read-only (FAISS `IO_FLAG_MMAP_IFC`) instead of read: loading
    copies no codes, pages come in as searches touch them, and actors on one node holding the same
    shard (replicas, versions) share them. IVF lists and flat codes map; what FAISS computes at
    load, like IVF-PQ's precomputed distance table (nlist x 64 KiB), stays private memory."""

    def __init__(self, root: Path, shard: ShardEntry, first_id: int, use_gpu: bool | None = None, mmap: bool = False):
        self.name = shard.name
        self.first_id = first_id
        index = faiss.read_index(str(root / shard.index.path), faiss.IO_FLAG_MMAP_IFC | faiss.IO_FLAG_READ_ONLY if mmap else 0)
        self.values = np.ascontiguousarray(load_values(root / shard.values.path), dtype=np.int32)
        if len(self.values) != index.ntotal:
            raise DatastoreError(f"shard {shard.name}: {index.ntotal} keys but {len(self.values)} values; rebuild the datastore")
        self.on_gpu = gpu_available() if use_gpu is None else use_gpu
        self.fast_scan = is_fast_scan(index)
        if self.on_gpu and self.fast_scan:
            logger.info("shard %s: faiss-gpu has no 4-bit fast-scan IVF-PQ; it is searched on the CPU", shard.name)
            self.on_gpu = False
        self.exact = flat_keys(index, self.on_gpu)  # flat shards: searched with torch where that is faster
        self.centroids = None if self.on_gpu else ivf_centroids(index)  # IVF shards: their coarse step likewise
        if self.on_gpu and self.exact is None:
            if not gpu_available():
                raise ConfigError(
                    f"shard {shard.name}: knn.gpu is true but this FAISS build sees no GPU to put its "
                    f"{type(faiss.downcast_index(index)).__name__} on (flat shards need only torch's CUDA; other indexes "
                    "need faiss-gpu, which the GPU flavour of make setup installs): set knn.gpu to null (automatic) or false"
                )
            self._gpu_resources = faiss.StandardGpuResources()  # must outlive the GPU index
            index = faiss.index_cpu_to_gpu(self._gpu_resources, 0, index)
        self.index = index
        self.ntotal = index.ntotal
        self.dim = index.d
        self._placed: np.ndarray | None = None  # fast-scan shards: each entry's (list << 32 | offset), made at the first lookup

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
        return search_index(self.index, self.values, queries, k, nprobe, first_id=self.first_id, exact=self.exact, centroids=self.centroids)

    def lookup(self, queries: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Score row i's candidate entries `ids[i]` (global ids, -1 padding; ids of other shards are
        left out) against query i: (distances, tokens, ids) sorted by distance, padded as search's.
        The distance is the index's own: exact keys for Flat, the decoded codes for PQ, and for 4-bit
        fast-scan PQ its own scan restricted to the candidates (`_scan_candidates`)."""
        local = np.where((ids >= self.first_id) & (ids < self.first_id + self.ntotal), ids - self.first_id, -1)
        found = local >= 0
        if self.fast_scan:
            distances = self._scan_candidates(queries, local)
        else:
            keys = np.zeros((*ids.shape, self.dim), dtype=np.float32)
            keys[found] = self.reconstruct(local[found])
            distances = np.where(found, np.sum((keys - queries[:, None, :]) ** 2, axis=2), np.inf).astype(np.float32)
        order = np.argsort(distances, axis=1, kind="stable")
        tokens = np.where(found, self.values[np.maximum(local, 0)], -1).astype(np.int32)
        return tuple(np.take_along_axis(a, order, axis=1) for a in (distances, tokens, np.where(found, ids, -1)))

    def reconstruct(self, local_ids: np.ndarray) -> np.ndarray:
        """The stored keys (as the index holds them: exact for Flat, decoded codes for PQ) of this
        shard's entries `local_ids`. FAISS 1.15 decodes 4-bit fast-scan lists wrongly (its
        `reconstruct_from_offset` hands `sa_decode` a code without its list number and reads past
        it), so those are unpacked here with FAISS's own code packer and decoded by the PQ."""
        local_ids = np.asarray(local_ids, dtype=np.int64)
        if not self.fast_scan:
            ivf = ivf_of(self.index)
            if ivf is not None and ivf.direct_map.type == faiss.DirectMap.NoMap:
                ivf.make_direct_map()  # IVF lists reconstruct through it (8 bytes an entry, made once)
            return self.index.reconstruct_batch(local_ids)
        ivf = faiss.downcast_index(ivf_of(self.index))
        placed = self._place()[local_ids]
        lists, offsets = placed >> 32, placed & 0xFFFFFFFF
        packer = ivf.get_CodePacker()
        codes = np.zeros((len(local_ids), ivf.code_size), dtype=np.uint8)
        for row, (number, offset) in enumerate(zip(lists.tolist(), offsets.tolist())):  # offset: within the list's blocks
            packer.unpack_1_c(ivf.invlists.get_codes(number), offset, faiss.swig_ptr(codes[row]))
        keys = ivf.pq.decode(codes)
        if ivf.by_residual:
            keys += ivf.quantizer.reconstruct_batch(lists)
        return _untransformed(self.index, keys)

    def _place(self) -> np.ndarray:
        """A fast-scan shard's entries' places in their IVF lists, (list << 32 | offset): a copy of
        FAISS's direct map (8 bytes an entry), made once; the map itself is dropped."""
        if self._placed is None:
            ivf = ivf_of(self.index)
            ivf.make_direct_map()
            self._placed = faiss.vector_to_array(ivf.direct_map.array)
            ivf.set_direct_map_type(faiss.DirectMap.NoMap)
        return self._placed

    def _scan_candidates(self, queries: np.ndarray, local: np.ndarray) -> np.ndarray:
        """Distances [n, m] from query i to its candidate entries `local[i]` (-1: none, +inf) by a
        fast-scan IVF-PQ's own scan of the lists holding them, restricted to them (an ID selector):
        the distances its search gives. A row is one FAISS call: 1.0 ms for 6 rows of 128 candidates
        on the real 1M store, where decoding them (`reconstruct`, ~4 µs each in Python) takes 3."""
        ivf = faiss.downcast_index(ivf_of(self.index))
        placed = self._place()
        vectors = _transformed(self.index, np.ascontiguousarray(queries, dtype=np.float32))
        out = np.full(local.shape, np.inf, dtype=np.float32)
        ptr = faiss.swig_ptr
        for row in np.flatnonzero((local >= 0).any(axis=1)):
            columns = np.flatnonzero(local[row] >= 0)
            candidates = local[row, columns].astype(np.int64)
            lists = np.unique(placed[candidates] >> 32)
            coarse = np.sum((ivf.quantizer.reconstruct_batch(lists) - vectors[row]) ** 2, axis=1, dtype=np.float32)
            selector = faiss.IDSelectorBatch(candidates)
            params = faiss.SearchParametersIVF(nprobe=len(lists))
            params.sel = selector
            n = len(candidates)
            distances, found = np.empty(n, np.float32), np.empty(n, np.int64)
            ivf.search_preassigned_c(1, ptr(vectors[row]), n, ptr(lists), ptr(coarse), ptr(distances), ptr(found), False, params)
            by_id = dict(zip(found[found >= 0].tolist(), distances[found >= 0].tolist()))
            out[row, columns] = [by_id.get(c, np.inf) for c in candidates.tolist()]
        return out


def is_fast_scan(index) -> bool:
    """Whether `index` is (or wraps) an IVF index with 4-bit fast-scan codes (`PQ{m}x4fs`)."""
    ivf = ivf_of(index)
    return ivf is not None and isinstance(faiss.downcast_index(ivf), faiss.IndexIVFFastScan)


def _transforms(index) -> list:
    if not isinstance(index, faiss.IndexPreTransform):
        return []
    return [faiss.downcast_VectorTransform(index.chain.at(i)) for i in range(index.chain.size())]


def _transformed(index, vectors: np.ndarray) -> np.ndarray:
    """`vectors` in the space of the IVF index inside `index` (through its PCA, if any)."""
    for transform in _transforms(index):
        vectors = transform.apply(vectors)
    return np.ascontiguousarray(vectors, dtype=np.float32)


def _untransformed(index, vectors: np.ndarray) -> np.ndarray:
    for transform in reversed(_transforms(index)):
        vectors = transform.reverse_transform(vectors)
    return vectors


@dataclass(frozen=True)
class FlatKeys:
    """An exact L2 index's keys [N, d] and squared norms [N] as torch tensors, for `torch_search`.
    `low`: a bf16 copy of the keys where the CPU multiplies bf16 natively, for `preselect`."""

    keys: torch.Tensor
    norms: torch.Tensor
    low: torch.Tensor | None = None


def flat_keys(index, on_gpu: bool, bf16: bool = True) -> FlatKeys | None:
    """An exact L2 index's keys for `torch_search`; None for other indexes (IVF, PQ, HNSW, a PCA
    transform in front).

    On CPU the keys are a view of the index's own storage, so they cost no memory but are only valid
    while the index lives (callers keep both); a CPU with native bf16 gets a bf16 copy beside them
    (half the keys' size) unless `bf16` is False. With `on_gpu` and a GPU torch sees, they are
    copied there once (the CPU index stays, for `ShardSearcher.lookup` and the FAISS path)."""
    import torch

    if not isinstance(index, faiss.IndexFlat) or index.metric_type != faiss.METRIC_L2 or index.ntotal == 0:
        return None
    keys = torch.from_numpy(faiss.rev_swig_ptr(index.get_xb(), index.ntotal * index.d).reshape(index.ntotal, index.d))
    keys = keys.to("cuda" if on_gpu and torch.cuda.is_available() else "cpu")
    norms = torch.linalg.vector_norm(keys, dim=1).square_()  # no [N, d] temporary, unlike (keys * keys).sum
    return FlatKeys(keys, norms, keys.bfloat16() if bf16 and keys.device.type == "cpu" and cpu_has_bf16() else None)


def ivf_centroids(index) -> FlatKeys | None:
    """An IVF index's coarse centroids for `torch_search`, which finds each query's nprobe lists
    faster than FAISS's flat quantizer at a decode step's batch (see `ivf_search`); None for other
    indexes, IVF indexes behind a transform (PCA) and non-flat quantizers (HNSW).

    In fp32 only: over a few thousand centroids the exact matmul is cheap (1.7 ms, 4,096 x 576,
    batch 32, 1 thread), and bf16 candidates cost more in re-scoring them, whose gathered
    [batch, candidates, d] copy made the step 1.9-4.5 ms."""
    if not isinstance(index, faiss.IndexIVF) or index.metric_type != faiss.METRIC_L2:
        return None
    return flat_keys(faiss.downcast_index(index.quantizer), on_gpu=False, bf16=False)


@cache
def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX): emulated bf16 is slower than fp32."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


DISTANCE_BLOCK = 1 << 26  # entries of one [queries, keys] distance block (256 MiB): bounds offline batches' memory
# Below this many queries the matmul runs as keys @ queriesᵀ: MKL then streams the keys once
# instead of packing them. Measured here (100k keys, 1 thread, k 1024): 21 vs 40 ms at batch 4,
# 33 vs 46 at 8, even at 16, 105 vs 91 at 32. A single query is padded to two rows: as a matrix-
# vector product MKL takes 22 ms, as a 2-row matmul 13 (17k keys: 3.5 vs 2.5 ms).
KEYS_MAJOR_BELOW = 16
# bf16 matmuls run keys-major below this many queries: 0.9 vs 1.8 ms at batch 32, even at 64 (14k keys, 2 threads).
BF16_KEYS_MAJOR_BELOW = 64
# `preselect` for k up to this: its exact re-scoring gathers PRESELECT_CANDIDATES(k) keys a query.
PRESELECT_MAX_K = 256


def preselect_candidates(k: int) -> int:
    """Candidates the bf16 pass keeps for re-scoring: twice k, and at least 32 more than k."""
    return k + max(k, 32)


def torch_search(exact: FlatKeys, queries: np.ndarray, k: int, keep: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(squared L2 distances, ids) [n, min(k, N)], nearest first, as IndexFlatL2 answers: one matmul
    |K|² - 2 q·Kᵀ and `torch.topk`, then + |q|² and clamped at 0 like FAISS's own BLAS path, so
    distances match FAISS's to fp32 rounding. At kNN-LM's k FAISS's flat search spends most of its
    time selecting the top k; `torch_is_faster` says when this wins. Entries `keep` (bool per entry)
    leaves out lie at +inf: past the kept ones a row holds (+inf, -1). With a bf16 copy of the keys
    and k up to PRESELECT_MAX_K, candidates come from `preselect` and are re-scored exactly."""
    import torch

    norms = exact.norms
    if keep is not None:
        norms = norms.masked_fill(~torch.from_numpy(np.asarray(keep, dtype=bool)).to(norms.device), float("inf"))
    q = torch.from_numpy(np.ascontiguousarray(queries, dtype=np.float32)).to(exact.keys.device)
    width = min(k, len(exact.keys))
    if exact.low is not None and k <= PRESELECT_MAX_K and preselect_candidates(k) < len(exact.keys):
        candidates = preselect(exact.low, norms, q, preselect_candidates(k))
        distances = (exact.keys[candidates] - q[:, None, :]).square_().sum(dim=2)  # exact fp32, as FAISS's
        distances.masked_fill_(~torch.isfinite(norms[candidates]), float("inf"))
        values, order = torch.topk(distances, width, dim=1, largest=False, sorted=True)
        distances, ids = values.numpy(), candidates.gather(1, order).numpy()
        return distances, np.where(np.isfinite(distances), ids, -1)
    parts = []
    for block in q.split(max(1, DISTANCE_BLOCK // len(exact.keys))):
        rows = block.repeat(2, 1) if len(block) == 1 else block  # a 2-row matmul beats MKL's matrix-vector product
        if len(rows) < KEYS_MAJOR_BELOW:
            scores = torch.addmm(norms[:, None], exact.keys, rows.T, alpha=-2).T
        else:
            scores = torch.addmm(norms, rows, exact.keys.T, alpha=-2)
        values, ids = torch.topk(scores[: len(block)], width, dim=1, largest=False, sorted=True)
        parts.append((values.add_((block * block).sum(dim=1, keepdim=True)).clamp_(min=0), ids))
    distances = torch.cat([d for d, _ in parts]).cpu().numpy()
    ids = torch.cat([i for _, i in parts]).cpu().numpy()
    return distances, np.where(np.isfinite(distances), ids, -1)


def preselect(low: torch.Tensor, norms: torch.Tensor, queries: torch.Tensor, candidates: int) -> torch.Tensor:
    """The `candidates` nearest entry ids per query [n, candidates] by |K|² - 2 q·Kᵀ with the dot
    products taken in bf16 (fp32 accumulation): at a decode step's batch the fp32 matmul is bound by
    reading the keys, and the bf16 copy is half their bytes. Its rounding (~0.4% of a dot product)
    can only swap entries near the edge of the candidates, which are twice k."""
    import torch

    rows = queries.bfloat16()
    if len(rows) < BF16_KEYS_MAJOR_BELOW:
        dots = torch.mm(low, (rows.repeat(2, 1) if len(rows) == 1 else rows).T).T[: len(rows)]
    else:
        dots = torch.mm(rows, low.T)
    return torch.topk(norms - 2 * dots.float(), candidates, dim=1, largest=False, sorted=False).indices


def torch_is_faster(batch: int, entries: int, device: str) -> bool:
    """Whether `torch_search` beats FAISS's flat search for `batch` queries over `entries` keys.

    From benchmarks/results/search_backends.json (576-d keys, p50 ms FAISS / torch at k 1024; k 64
    alike): FAISS's scan wins on little work, torch's matmul + top-k from about 32k query-key pairs
    on: at 1 thread 1.35 / 1.52 for 4 x 3k, 3.23 / 2.63 for 4 x 10k, 11.0 / 5.7 for 2 x 30k, 153 /
    34 for 32 x 30k; at 2 threads 0.82 / 3.21 for 4 x 3k, 87 / 32 for 32 x 30k. A single query is the
    exception: FAISS splits its scan across threads and loses from 10k keys (2 threads, 2.7 / 1.4
    at 10k, 81 / 32 at 300k), though single-threaded it is as fast (39 / 40 at 300k). On a GPU
    torch always wins."""
    if device == "cuda":
        return True
    if batch == 1 and faiss.omp_get_max_threads() > 1:
        return entries >= 10_000
    return batch * entries >= 32_768


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
    return _pad(distances, tokens, ids, k)


def faiss_search(
    index, queries: np.ndarray, k: int, nprobe: int | None, keep: np.ndarray | None, centroids: FlatKeys | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """FAISS's (distances, ids) [n, min(k, N)], with the nprobe and subset `search_index` takes;
    with an IVF index's `centroids`, its coarse step by torch where that is faster (`coarse_by_torch`)."""
    selector = faiss.IDSelectorBatch(np.flatnonzero(keep).astype(np.int64)) if keep is not None else None
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


def coarse_by_torch(batch: int, ivf) -> bool:
    """Whether `ivf_search` beats FAISS's own IVF search over the IVF layer `ivf`: where `torch_is_faster`, on one thread;
    on more, only for 4-bit fast-scan lists in a process whose OpenMP threads stop spinning soon
    (`omp_spins_briefly`, as in shard actors). FAISS splits the queries over its threads, coarse
    step and scan together. `search_preassigned` scans 8-bit PQ lists on one thread, and with
    libgomp's default spin each hand-off between torch's and FAISS's thread pools costs more than
    it saves (1M entries, 4,096 lists, batch 32, k 512, nprobe 16, 2 threads; 8-bit: 7.6 ms by
    FAISS, 11.1 this way; fast-scan: 3.1 by FAISS, 8.0 this way at the default spin and 2.5 at
    GOMP_SPINCOUNT=1000, 6.1 -> 4.6 ms of CPU; 118k entries, 1,024 lists, k 64, nprobe 8: 0.78 ->
    0.62 ms, CPU 1.5 -> 1.1)."""
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
    and distances in less time (1M entries, 4,096 lists, batch 32, 1 thread, k 512, nprobe 16: a
    coarse step of 1.7 ms against FAISS's 3.7, the search 12.0 ms against 14.1)."""
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
