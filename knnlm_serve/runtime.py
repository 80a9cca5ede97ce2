"""What the launcher hands to every vLLM process: the kNN config plus the checked datastores.

The launcher validates the datastores (manifest, model fingerprint, dimension), writes this as
JSON and points `KNNLM_SERVE_CONFIG` at it; the plugin in each vLLM process reads it. Admin
changes (hot-swap, unload, default) rewrite the file atomically with a new `generation`; vLLM
processes notice at their next step (a `stat`, no IPC).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from pydantic import BaseModel

from knnlm_serve.config import KeyType, KnnConfig
from knnlm_serve.datastore import DatastoreError, Manifest, check_compatible, read_manifest, shard_files
from knnlm_serve.model import model_fingerprint

CONFIG_ENV = "KNNLM_SERVE_CONFIG"


class DatastoreInfo(BaseModel):
    name: str
    version: int = 1  # bumped by every hot-swap of this name; shard actors are per version
    path: str
    key_type: KeyType
    nprobe: int | None
    entries: int
    shards: list[str]
    index: str
    fingerprint: str
    bytes: int


class Runtime(BaseModel):
    knn: KnnConfig
    datastores: dict[str, DatastoreInfo]
    ray_address: str | None = None
    generation: int = 0

    def save(self, path: Path | None = None) -> Path:
        """Write atomically (readers never see half a file); a new temp file when no path."""
        if path is None:
            fd, name = tempfile.mkstemp(prefix="knnlm-runtime-", suffix=".json")
            os.close(fd)
            path = Path(name)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(self.model_dump_json(by_alias=True))
        os.replace(tmp, path)
        return path


def runtime_path() -> Path | None:
    path = os.environ.get(CONFIG_ENV)
    return Path(path) if path else None


class RuntimeWatcher:
    """The current runtime, re-read only when the file was replaced (one `stat` per call)."""

    def __init__(self, path: Path):
        self.path = path
        self._stamp: tuple | None = None
        self._runtime: Runtime | None = None

    def current(self) -> Runtime:
        st = os.stat(self.path)
        stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        if stamp != self._stamp:
            self._runtime = Runtime.model_validate_json(self.path.read_text())
            self._stamp = stamp
        return self._runtime


def check_datastore(name: str, path: str | Path, model_dir: Path, hidden_size: int) -> tuple[DatastoreInfo, Manifest]:
    """Refuse a datastore built for another model, or of another dimension."""
    path = Path(path).expanduser().resolve()
    manifest = read_manifest(path)
    check_compatible(manifest, fingerprint=model_fingerprint(model_dir), where=f"datastore {name!r} ({path})")
    if manifest.dim != hidden_size:
        raise DatastoreError(f"datastore {name!r} has keys of dimension {manifest.dim}, the model's hidden size is {hidden_size}")
    info = DatastoreInfo(
        name=name, path=str(path), key_type=manifest.key_type, nprobe=manifest.index.nprobe,
        entries=manifest.entries, shards=[s.name for s in manifest.shards], index=manifest.index.factory,
        fingerprint=manifest.model.fingerprint, bytes=sum(f.bytes for s in manifest.shards for f in shard_files(s)),
    )
    return info, manifest


def hidden_size_of(model_dir: Path) -> int:
    return json.loads((model_dir / "config.json").read_text())["hidden_size"]


def in_use_file(runtime_file: Path, pid: int) -> Path:
    """Where vLLM worker `pid` lists the datastore versions its running requests are pinned to."""
    return runtime_file.with_name(f"{runtime_file.name}.in-use.{pid}.json")


def in_use_files(runtime_file: Path) -> list[tuple[int, Path]]:
    return [(int(f.name.rsplit(".", 2)[-2]), f) for f in runtime_file.parent.glob(f"{runtime_file.name}.in-use.*.json")]
