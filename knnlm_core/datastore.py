"""The on-disk datastore format: `knnlm-index` writes it; the server, evaluator and benchmarks read it.

    <datastore>/manifest.json            written last; its presence means "complete"
    <datastore>/shard-000/index.faiss    FAISS index over this shard's keys (ids 0..n-1)
    <datastore>/shard-000/values.npy     int32 next-token ids, values[i] belongs to index id i
    <datastore>/shard-000/keys.npy       optional fp16 keys, for exact re-scoring / verification
    <datastore>/documents.npy            int64 [documents + 1]: where each document's entries begin
                                         (entries are in corpus order, shards contiguous: entry i's
                                         successor i + 1 is the next position of the same document
                                         when both lie in one document's range). Absent in
                                         datastores built from keys or before it existed.
    <datastore>/provenance.json          each document's source file, .jsonl line and id, first
                                         token and text checksum (knnlm_core/provenance.py).
                                         Absent where documents.npy is, and in older datastores:
                                         they serve, but cannot explain.

Only JSON and plain `.npy` arrays are read (`allow_pickle=False`): a datastore is data, never code.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from knnlm_core.config import AdaptiveLambda, KeyType
from knnlm_core.errors import DatastoreError, ErrorKind
from knnlm_core.files import sha256_file, write_json_atomic

FORMAT = "knnlm-datastore"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # JSON's NaN and Infinity are never a setting


class FileEntry(_Record):
    path: str  # relative to the datastore directory
    bytes: int
    sha256: str


class ShardEntry(_Record):
    name: str
    entries: int
    index: FileEntry
    values: FileEntry
    keys: FileEntry | None = None


class ModelIdentity(_Record):
    name: str
    fingerprint: str
    hidden_size: int
    vocab_size: int
    dtype: str


class IndexSpec(_Record):
    factory: str  # the FAISS index_factory string, e.g. "IVF1024,PQ64"
    metric: Literal["l2"] = "l2"
    nprobe: int | None = None  # default search breadth for IVF indexes
    train_size: int = 0  # keys the quantizers were trained on (0: no training needed)


class CorpusStats(_Record):
    sources: list[str]
    documents: int
    tokens: int
    skipped_files: list[str] = []


class BuildStats(_Record):
    context_length: int
    stride: int
    seconds: float
    encode_tokens_per_s: float
    calibration_seconds: float = 0.0
    created: str
    tool_version: str


class SkipRule(_Record):
    """Adaptive retrieval: rows where the LM's top probability exceeds `threshold` skip the search
    and are served p_LM. Fitted to cost at most `tolerance` of perplexity on the fitting half."""

    threshold: float = Field(ge=0, le=1)  # 1: never skip
    skipped: float  # share of the judged half's tokens skipped,
    ppl: float  # its perplexity with the skips,
    full_ppl: float  # and with every row searched
    tolerance: float


class KPoint(_Record):
    k: int
    tune_ppl: float  # best over (τ, λ) at this k on the fitting half,
    report_ppl: float  # and that setting on the judged half


class KCurve(_Record):
    """Perplexity against k: the served k is the smallest within `tolerance` of the best on the
    fitting half (a smaller k is a cheaper search, answer, merge and mix)."""

    tolerance: float
    ks: list[KPoint]


class NprobePoint(_Record):
    nprobe: int
    tune_ppl: float  # best over (k, τ, λ) searching this many IVF lists, on the fitting half,
    report_ppl: float  # and that setting on the judged half


class NprobeCurve(_Record):
    """Perplexity against IVF lists probed: the served nprobe is the smallest within `tolerance` of
    the build's nprobe on the fitting half (fewer lists, fewer codes scanned a query)."""

    tolerance: float
    nprobes: list[NprobePoint]


class PointerRule(_Record):
    """Pointer following: a decode step follows the last step's neighbours when at least
    `min_pointers` successors survive (0: off). Fitted, after the skip rule, to cost at most
    `tolerance` of perplexity on the fitting half."""

    min_pointers: int = Field(ge=0)
    saved: float  # share of the judged half's tokens that followed pointers instead of searching,
    ppl: float  # its perplexity,
    full_ppl: float  # and with every non-skipped token searched
    tolerance: float


class Calibration(_Record):
    """The mixing settings that fit this datastore best on held-out text (served by default)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)

    lambda_: float = Field(alias="lambda", ge=0, le=1)
    temperature: float = Field(gt=0)
    k: int = Field(gt=0)
    adaptive_lambda: AdaptiveLambda
    mode: Literal["fixed", "adaptive"]  # which λ a request that sets none gets
    tokens: int  # held-out tokens fitted on (first half) and judged on (second half)
    base_ppl: float  # on the judged half: the LM alone,
    knn_ppl: float  # kNN-LM at the fitted fixed λ,
    adaptive_ppl: float  # and with the adaptive curve
    k_curve: KCurve | None = None  # None: calibrated before k was chosen for cost (the best k was served)
    skip: SkipRule | None = None  # None: calibrated before adaptive retrieval existed (never skips)
    pointers: PointerRule | None = None  # None: no document boundaries, or calibrated before pointers existed
    heldout: str  # what the held-out text was
    nprobe: int | None = Field(gt=0)  # IVF lists the fit searched, served by default (see served_nprobe)
    nprobe_curve: NprobeCurve | None = None  # None: not IVF, or calibrated before nprobe was chosen (the build's was served)
    created: str


class Manifest(_Record):
    format: Literal["knnlm-datastore"] = FORMAT
    format_version: int = FORMAT_VERSION
    model: ModelIdentity
    key_type: KeyType
    dim: int
    key_dtype: Literal["float16"] = "float16"
    index: IndexSpec
    entries: int
    shards: list[ShardEntry]
    corpus: CorpusStats
    build: BuildStats
    calibration: Calibration | None = None
    calibration_note: str | None = None  # why there is no calibration
    calibration_history: list[Calibration] = []  # earlier calibrations, oldest first
    documents: FileEntry | None = None  # documents.npy; None: no document boundaries (no pointer following)
    provenance: FileEntry | None = None  # provenance.json; None: cannot explain its neighbours
    checksum: str | None = None  # sha256 of this manifest without this field (None: written before it existed)

    def files(self) -> list[FileEntry]:
        """Every data file the manifest lists, with its size and checksum."""
        return [f for s in self.shards for f in shard_files(s)] + [f for f in (self.documents, self.provenance) if f is not None]


def served_nprobe(manifest: Manifest) -> int | None:
    """IVF lists a search probes by default: the calibration's choice, else the build's."""
    calibration = manifest.calibration
    return calibration.nprobe if calibration is not None and calibration.nprobe else manifest.index.nprobe


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


def shard_files(shard: ShardEntry) -> list[FileEntry]:
    return [f for f in (shard.index, shard.values, shard.keys) if f is not None]


def verify_checksums(path: str | os.PathLike, manifest: Manifest) -> None:
    """Re-hash every data file; raise on the first that does not match the manifest."""
    for entry in manifest.files():
        if sha256_file(Path(path) / entry.path) != entry.sha256:
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
