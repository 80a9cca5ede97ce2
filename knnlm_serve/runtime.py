"""What the launcher hands to every vLLM process: the kNN config plus the checked datastores.

The launcher validates the datastores once (manifest, model fingerprint, dimension), writes
this as JSON and points `KNNLM_SERVE_CONFIG` at it; the plugin in each vLLM process reads it.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from pydantic import BaseModel

from knnlm_serve.config import KeyType, KnnConfig
from knnlm_serve.datastore import DatastoreError, Manifest, check_compatible, read_manifest
from knnlm_serve.model import model_fingerprint

CONFIG_ENV = "KNNLM_SERVE_CONFIG"


class DatastoreInfo(BaseModel):
    name: str
    path: str
    key_type: KeyType
    nprobe: int | None
    entries: int
    shards: list[str]


class Runtime(BaseModel):
    knn: KnnConfig
    datastores: dict[str, DatastoreInfo]
    ray_address: str | None = None

    def save(self) -> Path:
        fd, path = tempfile.mkstemp(prefix="knnlm-runtime-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            f.write(self.model_dump_json(by_alias=True))
        return Path(path)


def load_runtime() -> Runtime | None:
    path = os.environ.get(CONFIG_ENV)
    return Runtime.model_validate_json(Path(path).read_text()) if path else None


def check_datastore(name: str, path: str | Path, model_dir: Path, hidden_size: int) -> tuple[DatastoreInfo, Manifest]:
    """Refuse a datastore built for another model, or of another dimension."""
    path = Path(path).expanduser().resolve()
    manifest = read_manifest(path)
    check_compatible(manifest, fingerprint=model_fingerprint(model_dir), where=f"datastore {name!r} ({path})")
    if manifest.dim != hidden_size:
        raise DatastoreError(f"datastore {name!r} has keys of dimension {manifest.dim}, the model's hidden size is {hidden_size}")
    info = DatastoreInfo(
        name=name, path=str(path), key_type=manifest.key_type, nprobe=manifest.index.nprobe,
        entries=manifest.entries, shards=[s.name for s in manifest.shards],
    )
    return info, manifest


def hidden_size_of(model_dir: Path) -> int:
    return json.loads((model_dir / "config.json").read_text())["hidden_size"]
