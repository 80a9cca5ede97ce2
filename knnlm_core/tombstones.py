"""Tombstones: the entries of forgotten documents (`Manifest.forgotten`), left out of every search
and pointer lookup of a shard until `knnlm-index compact` removes them from its files.

A forgotten document's entries are one contiguous range of global ids, so a mask per shard is
all a search needs: FAISS applies it inside the scan (an ID selector), the torch exact search as
+inf norms. Neither costs a row its k neighbours while the shard holds k live entries.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from knnlm_core.manifest import Manifest


def live_mask(manifest: Manifest, first_id: int, entries: int, excluded: Sequence[tuple[int, int]] = ()) -> np.ndarray | None:
    """True for each live entry of the shard holding ids [first_id, first_id + entries); None when
    none is forgotten or in the `excluded` id ranges (the build's held-out slice, while calibrating)."""
    mask = None
    for first, end in [*(record.entries for record in manifest.forgotten), *excluded]:
        lo, hi = max(first, first_id), min(end, first_id + entries)
        if lo < hi:
            mask = np.ones(entries, dtype=bool) if mask is None else mask
            mask[lo - first_id : hi - first_id] = False
    return mask


def forgotten_entries(manifest: Manifest) -> int:
    """How many of the datastore's entries are tombstones."""
    return sum(r.entries[1] - r.entries[0] for r in manifest.forgotten)


def forgotten_share(manifest: Manifest) -> float:
    """The share of the datastore's entries that are tombstones."""
    return forgotten_entries(manifest) / manifest.entries if manifest.entries else 0.0
