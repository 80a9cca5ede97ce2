"""Where each shard's entries begin, and what its actor holds: a new version of a datastore shares
a shard's actor with the version before it where that is unchanged."""

from __future__ import annotations

import hashlib
import json

import numpy as np

from knnlm_core.manifest import Manifest


def shard_first_ids(manifest: Manifest) -> list[int]:
    """Each shard's first global entry id (shards hold contiguous ranges, in order)."""
    return np.concatenate([[0], np.cumsum([s.entries for s in manifest.shards])[:-1]]).astype(int).tolist()


def shard_keys(manifest: Manifest) -> list[str]:
    """Each shard's loaded state as a short hash: its files and entry range, the tombstones within
    it, and in a datastore of one shard (whose actor also reads them) the document starts."""
    keys = []
    for shard, first in zip(manifest.shards, shard_first_ids(manifest)):
        end = first + shard.entries
        tombstones = [(max(lo, first), min(hi, end)) for lo, hi in (r.entries for r in manifest.forgotten) if lo < end and hi > first]
        alone = len(manifest.shards) == 1 and manifest.documents is not None
        held = {
            "shard": shard.model_dump(mode="json"),
            "first": first,
            "tombstones": tombstones,
            "documents": alone and manifest.documents.sha256,
        }
        keys.append(hashlib.sha256(json.dumps(held, sort_keys=True).encode()).hexdigest()[:12])
    return keys
