"""Datastores as a buggy tool or a made-up calibration would leave them, for tests."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from knnlm_core.datastore import sealed
from knnlm_core.files import sha256_file
from knnlm_core.manifest import MANIFEST

CALIBRATION = {
    "lambda": 1.0,
    "temperature": 1.0,
    "k": 8,
    "adaptive_lambda": {"lambda_max": 1.0, "slope": 1.0, "center": 0.0},
    "mode": "fixed",
    "tokens": 100,
    "base_ppl": 20.0,
    "knn_ppl": 10.0,
    "adaptive_ppl": 10.0,
    "heldout": "a test's made-up calibration",
    "nprobe": None,
    "created": "2026-11-25T00:00:00",
}


def rewritten(root: Path, name: str, source: str, edit) -> None:
    """A copy of datastore `source` as a buggy tool or a half-finished copy would leave it:
    `edit(directory, manifest)` changes files or the manifest, and the manifest's sizes, checksums
    and its own checksum are then recomputed to match."""
    shutil.copytree(root / source, root / name)
    manifest = json.loads((root / name / MANIFEST).read_text())
    edit(root / name, manifest)
    entries = [manifest["documents"], manifest["provenance"], *(s[f] for s in manifest["shards"] for f in ("index", "values"))]
    for entry in entries:
        entry.update(bytes=(root / name / entry["path"]).stat().st_size, sha256=sha256_file(root / name / entry["path"]))
    manifest.pop("checksum")
    (root / name / MANIFEST).write_text(json.dumps(sealed(manifest)))


def save(path: Path, array: np.ndarray) -> None:
    with open(path, "wb") as f:
        np.save(f, array, allow_pickle=True)


def calibrated(**changes):
    def edit(directory, manifest):
        manifest["calibration"] = {**CALIBRATION, **changes}

    return edit
