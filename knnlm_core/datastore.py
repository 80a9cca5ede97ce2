"""The on-disk datastore format: `knnlm-index` writes it; the server, evaluator and benchmarks read it.

    <datastore>/manifest.json            written last; its presence means "complete"
    <datastore>/shard-000/index.faiss    FAISS index over this shard's keys (ids 0..n-1)
    <datastore>/shard-000/values.npy     int32 next-token ids, values[i] belongs to index id i
    <datastore>/shard-000/keys.npy       optional fp16 keys, for exact re-scoring / verification
    <datastore>/quantizer.faiss          the trained index with no entries, every shard a copy of it
                                         (`knnlm-index add` fills new shards from it). Absent in
                                         datastores built before it was kept.
    <datastore>/documents.npy            int64 [documents + 1]: where each document's entries begin
                                         (entries are in corpus order, shards contiguous: entry i's
                                         successor i + 1 is the next position of the same document
                                         when both lie in one document's range). Absent in
                                         datastores built from keys or before it existed.
    <datastore>/provenance.json          each document's source file, .jsonl line and id, first
                                         token and text checksum (knnlm_core/provenance.py).
                                         Absent where documents.npy is, and in older datastores:
                                         they serve, but cannot explain.

The manifest also records what `knnlm-index add`, `forget` and `compact` did (`additions`,
`forgotten`: the tombstones every search leaves out, `compactions`).

Only JSON and plain `.npy` arrays are read (`allow_pickle=False`): a datastore is data, never code.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
from pydantic import ValidationError

from knnlm_core.errors import DatastoreError, ErrorKind
from knnlm_core.files import sha256_file, write_json_atomic
from knnlm_core.manifest import FORMAT, FORMAT_VERSION, MANIFEST, FileEntry, Manifest


def manifest_sha256(path: str | os.PathLike) -> str | None:
    """The sha256 of `<path>/manifest.json`, which every new version of a datastore rewrites; None if unreadable."""
    try:
        return hashlib.sha256((Path(path) / MANIFEST).read_bytes()).hexdigest()
    except OSError:
        return None


def read_manifest(path: str | os.PathLike) -> Manifest:
    """Read and validate `<path>/manifest.json`, and check every shard file is there at its size."""
    path = Path(path)
    manifest_file = path / MANIFEST
    if not path.is_dir():
        raise DatastoreError(f"datastore {path} does not exist", ErrorKind.NOT_FOUND)
    if not manifest_file.is_file():
        raise DatastoreError(
            f"{path} has no {MANIFEST}: not a datastore, or a build that did not finish "
            "(rerun the same `knnlm-index build` command to resume it)"
        )
    try:
        raw = json.loads(manifest_file.read_text())
    except json.JSONDecodeError as e:
        raise DatastoreError(f"{manifest_file} is not valid JSON ({e})") from None
    if raw.get("format") != FORMAT or raw.get("format_version") != FORMAT_VERSION:
        raise DatastoreError(
            f"{manifest_file}: format {raw.get('format')!r} v{raw.get('format_version')} is not "
            f"{FORMAT!r} v{FORMAT_VERSION}; rebuild it with this version of knnlm-index"
        )
    if raw.get("checksum") is not None and raw["checksum"] != _manifest_checksum(raw):
        raise DatastoreError(
            f"{manifest_file} was changed after knnlm-index wrote it (its checksum does not match its content): "
            "a hand edit or a damaged copy; restore it, or rebuild the datastore"
        )
    try:
        manifest = Manifest.model_validate(raw)
    except ValidationError as e:
        error = e.errors()[0]
        field = ".".join(str(part) for part in error["loc"])
        raise DatastoreError(
            f"{manifest_file}: field {field} is invalid: {error['msg']} (got {error.get('input')!r}); rebuild the datastore"
        ) from None
    for entry in manifest.files():
        file = path / entry.path
        if not file.is_file():
            raise DatastoreError(f"datastore {path}: file {entry.path} is missing")
        if file.stat().st_size != entry.bytes:
            raise DatastoreError(
                f"datastore {path}: {entry.path} has {file.stat().st_size} bytes, manifest says "
                f"{entry.bytes} (truncated or replaced); rebuild the datastore"
            )
    return manifest


def verify_checksums(path: str | os.PathLike, manifest: Manifest, hashed: dict | None = None) -> None:
    """Re-hash every data file; raise on the first that does not match the manifest. `hashed`
    remembers each file's hash by its inode, size and mtime, so a later version whose files are
    hard links of this one's (`knnlm-index add`, `forget`) hashes only its new files."""
    for entry in manifest.files():
        file = Path(path) / entry.path
        stat = file.stat()
        identity = (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)
        digest = hashed.get(identity) if hashed is not None else None
        if digest is None:
            digest = sha256_file(file)
            if hashed is not None:
                hashed[identity] = digest
        if digest != entry.sha256:
            raise DatastoreError(f"datastore {path}: checksum mismatch in {entry.path}; the file is corrupt")


def check_compatible(manifest: Manifest, *, fingerprint: str, where: str = "datastore") -> None:
    """Refuse a datastore whose keys were computed by another model."""
    if manifest.model.fingerprint != fingerprint:
        raise DatastoreError(
            f"{where} was built for model {manifest.model.name!r} (fingerprint {manifest.model.fingerprint}), "
            f"not the served model (fingerprint {fingerprint}); rebuild it with `knnlm-index build --model ...`"
        )


def file_entry(root: Path, file: Path) -> FileEntry:
    return FileEntry(path=str(file.relative_to(root)), bytes=file.stat().st_size, sha256=sha256_file(file))


def load_values(path: Path, entries: int | None = None, vocab_size: int | None = None) -> np.ndarray:
    """A shard's values.npy, memory-mapped: int32 token ids, checked to be `entries` ids of a
    vocabulary of `vocab_size` when those are given."""
    values = _load_array(path)
    where = f"{path.parent.name}/{path.name}"
    if values.dtype != np.int32 or values.ndim != 1 or (entries is not None and len(values) != entries):
        expected = f"({entries},)" if entries is not None else "(entries,)"
        raise DatastoreError(f"{where}: holds {values.dtype} {values.shape}, expected int32 {expected}; rebuild the datastore")
    if vocab_size is not None and len(values) and not 0 <= int(values.min()) <= int(values.max()) < vocab_size:
        raise DatastoreError(f"{where}: token ids outside the vocabulary [0, {vocab_size}); rebuild the datastore")
    return values


class EntryValues:
    """A datastore's values by global entry id: every shard's values.npy, memory-mapped, shards
    holding consecutive ids in order."""

    def __init__(self, values: list[np.ndarray]):
        self._values = values
        self._first_ids = np.cumsum([0] + [len(v) for v in values])

    @classmethod
    def open(cls, root: Path, manifest: Manifest) -> EntryValues:
        return cls([load_values(root / s.values.path, s.entries, manifest.model.vocab_size) for s in manifest.shards])

    def range(self, lo: int, hi: int) -> np.ndarray:
        """The values of entries [lo, hi)."""
        parts = []
        for shard, values in enumerate(self._values):
            self._check_unchanged(values)
            a, b = max(lo, self._first_ids[shard]), min(hi, self._first_ids[shard + 1])
            if a < b:
                parts.append(np.asarray(values[a - self._first_ids[shard] : b - self._first_ids[shard]], dtype=np.int32))
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)

    def at(self, ids: np.ndarray) -> np.ndarray:
        """The values of entries `ids` (each in [0, entries))."""
        shards = np.searchsorted(self._first_ids, ids, side="right") - 1
        out = np.empty(len(ids), dtype=np.int32)
        for shard in np.unique(shards).tolist():
            values, chosen = self._values[shard], shards == shard
            self._check_unchanged(values)
            out[chosen] = values[ids[chosen] - self._first_ids[shard]]
        return out

    @staticmethod
    def _check_unchanged(values: np.ndarray) -> None:
        if os.stat(values.filename).st_size != values.offset + values.nbytes:  # reading a truncated map would kill the process
            raise DatastoreError(
                f"{Path(values.filename).parent.name}/values.npy changed on disk after it was loaded; reload the datastore"
            )


def load_document_starts(root: Path, manifest: Manifest) -> np.ndarray | None:
    """documents.npy (where each document's entries begin, and the total), or None when not recorded;
    checked to run from 0 to the datastore's entries in order."""
    if manifest.documents is None:
        return None
    starts = _load_array(root / manifest.documents.path, mmap=False)
    if starts.dtype != np.int64 or starts.ndim != 1 or len(starts) < 2:
        problem = f"holds {starts.dtype} {starts.shape}, expected int64 (documents + 1,)"
    elif starts[0] != 0 or starts[-1] != manifest.entries:
        problem = f"runs from {starts[0]} to {starts[-1]}, expected 0 to the datastore's {manifest.entries} entries"
    elif np.any(np.diff(starts) < 0):
        problem = "document starts are not in order"
    else:
        return starts
    raise DatastoreError(f"{manifest.documents.path}: {problem}; rebuild the datastore")


def _load_array(path: Path, mmap: bool = True) -> np.ndarray:
    try:
        return np.load(path, allow_pickle=False, mmap_mode="r" if mmap else None)
    except (OSError, ValueError) as e:  # object arrays (pickles), truncated or foreign files
        raise DatastoreError(f"{path.name}: not a plain .npy array ({e}); rebuild the datastore") from None


def write_manifest(root: Path, manifest: Manifest) -> None:
    """Written last and atomically: a manifest on disk means the datastore is complete. It carries
    a checksum of its own content, so an edit after the fact (say, of the key type) is refused."""
    write_json_atomic(root / MANIFEST, sealed(manifest.model_dump(mode="json", by_alias=True)))


def sealed(raw: dict) -> dict:
    """A manifest's JSON with the checksum of its content."""
    return {**raw, "checksum": _manifest_checksum(raw)}


def _manifest_checksum(raw: dict) -> str:
    content = {key: value for key, value in raw.items() if key != "checksum"}
    return hashlib.sha256(json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()).hexdigest()
