"""Erase entries from a FAISS shard index, keeping every other entry's id.

A forget with erase (`knnlm-index forget --erase`) takes a forgotten document's codes out of the
index files, not just out of every search. Entry ids are positions in corpus order and pointer
following, explanations and requests pinned to the previous version rely on them, so no other
entry may move:
- IVF indexes (IVF-PQ, fast-scan, behind a PCA or not) store each entry's id in its list, so the
  entries are removed from their lists (ids and codes); the index holds fewer entries than the
  shard's id range, which the shard's `removed` count records.
- Flat indexes (behind a PCA or not) have their rows overwritten with zeros: the vectors are
  gone, the positions stay, masked as tombstones.
Anything else is refused (an HNSW graph walks through its nodes, so a zeroed node would change
other entries' answers): forget without erase, then `knnlm-index compact`.
"""

from __future__ import annotations

import faiss
import numpy as np

from knnlm_core.errors import DatastoreError, ErrorKind
from knnlm_core.search import ivf_of


def check_erasable(factory: str, dim: int) -> None:
    """Refuse, before any work, an index type that cannot erase in place (see above)."""
    index = faiss.index_factory(dim, factory, faiss.METRIC_L2)
    if ivf_of(index) is None and stored_vectors(index) is None:
        raise DatastoreError(
            f"a {type(faiss.downcast_index(index)).__name__} index ({factory}) cannot erase entries in place: "
            "forget without --erase, then run `knnlm-index compact`, which rewrites the index files without them",
            ErrorKind.INVALID,
        )


def erase_entries(index, ranges: list[tuple[int, int]]) -> int:
    """Erase the entries with local ids in `ranges` ([lo, hi) each) from `index` (a type
    `check_erasable` accepts), in place; how many left the index (0 where rows were zeroed)."""
    if ivf_of(index) is not None:
        return sum(index.remove_ids(faiss.IDSelectorRange(lo, hi)) for lo, hi in ranges)
    vectors = stored_vectors(index)
    for lo, hi in ranges:
        vectors[lo:hi] = 0
    return 0


def _flat_storage(index):
    """The IndexFlat holding `index`'s vectors by position (itself, or behind a transform)."""
    index = faiss.downcast_index(index)
    if isinstance(index, faiss.IndexPreTransform):
        index = faiss.downcast_index(index.index)
    return index if isinstance(index, faiss.IndexFlat) else None


def stored_vectors(index) -> np.ndarray | None:
    """The vectors [ntotal, d] an index stores by position (a writable view); None for other indexes."""
    flat = _flat_storage(index)
    return None if flat is None else faiss.rev_swig_ptr(flat.get_xb(), flat.ntotal * flat.d).reshape(flat.ntotal, flat.d)
