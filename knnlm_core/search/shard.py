"""One datastore shard in memory: its FAISS index and values, searched and looked up.

`ShardSearcher.find` is what a shard actor answers a step with: the rows that follow pointers are
scored against their candidates (`lookup`), the others searched (`search`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import faiss
import numpy as np

from knnlm_core.datastore import load_values
from knnlm_core.errors import ConfigError, DatastoreError
from knnlm_core.manifest import Manifest, ShardEntry
from knnlm_core.search.exact import flat_keys
from knnlm_core.search.index import gpu_available, search_index
from knnlm_core.search.ivf import is_fast_scan, ivf_centroids, ivf_of
from knnlm_core.shard_keys import shard_first_ids
from knnlm_core.tombstones import live_mask

logger = logging.getLogger(__name__)


class ShardSearcher:
    """A FAISS shard with its values; on GPU when faiss-gpu sees a device, else on CPU.

    `mmap`: the index file is mapped read-only (FAISS `IO_FLAG_MMAP_IFC`) instead of read: loading
    copies no codes, pages come in as searches touch them, and actors on one node holding the same
    shard (replicas, versions) share them. IVF lists and flat codes map; what FAISS computes at
    load, like IVF-PQ's precomputed distance table (nlist x 64 KiB), stays private memory."""

    def __init__(
        self, root: Path, shard: ShardEntry, first_id: int, use_gpu: bool | None = None, mmap: bool = False, keep: np.ndarray | None = None
    ):
        self.name = shard.name
        self.first_id = first_id
        self.keep = keep  # False: a forgotten document's entry (knnlm_core/tombstones.py), never found
        index = faiss.read_index(str(root / shard.index.path), faiss.IO_FLAG_MMAP_IFC | faiss.IO_FLAG_READ_ONLY if mmap else 0)
        self.values = np.ascontiguousarray(load_values(root / shard.values.path), dtype=np.int32)
        if len(self.values) != index.ntotal + shard.removed:
            raise DatastoreError(
                f"shard {shard.name}: {index.ntotal} keys ({shard.removed} erased) but {len(self.values)} values; rebuild the datastore"
            )
        self.removed = shard.removed  # entries an erasing forget took out of the IVF lists: their ids are gaps
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
        self.ntotal = len(self.values)  # the shard's id range, erased entries included
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
        return search_index(
            self.index, self.values, queries, k, nprobe, self.keep, first_id=self.first_id, exact=self.exact, centroids=self.centroids
        )

    def lookup(self, queries: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Score row i's candidate entries `ids[i]` (global ids, -1 padding; ids of other shards are
        left out) against query i: (distances, tokens, ids) sorted by distance, padded as search's.
        The distance is the index's own: exact keys for Flat, the decoded codes for PQ, and for 4-bit
        fast-scan PQ its own scan restricted to the candidates (`_scan_candidates`)."""
        local = np.where((ids >= self.first_id) & (ids < self.first_id + self.ntotal), ids - self.first_id, -1)
        if self.keep is not None:
            local = np.where(self.keep[np.maximum(local, 0)], local, -1)
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
                # IVF lists reconstruct through it, made once: an array (8 bytes an entry) while the
                # ids are 0..ntotal-1, a hash table once an erase left gaps
                ivf.set_direct_map_type(faiss.DirectMap.Hashtable if self.removed else faiss.DirectMap.Array)
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
        """A fast-scan shard's entries' places in their IVF lists, (list << 32 | offset), -1 for an
        erased entry: read from the lists' ids once (8 bytes an entry)."""
        if self._placed is None:
            ivf = ivf_of(self.index)
            placed = np.full(self.ntotal, -1, dtype=np.int64)
            for number in range(ivf.nlist):
                size = ivf.invlists.list_size(number)
                if size:
                    ids = faiss.rev_swig_ptr(ivf.invlists.get_ids(number), size)
                    placed[ids] = (number << 32) | np.arange(size, dtype=np.int64)
            self._placed = placed
        return self._placed

    def _scan_candidates(self, queries: np.ndarray, local: np.ndarray) -> np.ndarray:
        """Distances [n, m] from query i to its candidate entries `local[i]` (-1: none, +inf) by a
        fast-scan IVF-PQ's own scan of the lists holding them, restricted to them (an ID selector):
        the distances its search gives. A row is one FAISS call, cheaper than decoding its
        candidates one by one (`reconstruct`)."""
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


def open_shards(
    root: Path,
    manifest: Manifest,
    use_gpu: bool | None = None,
    mmap: bool = False,
    names: set[str] | None = None,
    excluded: Sequence[tuple[int, int]] = (),
) -> list[ShardSearcher]:
    """The datastore's shards (those in `names`, if given), each with its tombstones and the
    `excluded` id ranges masked."""
    return [
        ShardSearcher(root, shard, first, use_gpu, mmap, live_mask(manifest, first, shard.entries, excluded))
        for shard, first in zip(manifest.shards, shard_first_ids(manifest))
        if names is None or shard.name in names
    ]
