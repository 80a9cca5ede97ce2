"""The serving contract between the API-server process and vLLM's workers.

`Runtime` is everything a worker needs to serve kNN: the settings, the serving datastore versions
and the default. The registry owns it and pushes every change to the workers through vLLM's worker
RPC (engine/vllm_adapter.py); a worker applies it between two steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel

from knnlm_core.config import KeyType, KnnConfig
from knnlm_core.datastore import Manifest, check_compatible, read_manifest, shard_files
from knnlm_core.errors import DatastoreError
from knnlm_core.keys import no_ffn_input_error, supports_ffn_input
from knnlm_core.model_dir import architecture_of, model_config, model_fingerprint


class DatastoreInfo(BaseModel):
    model_config = {"frozen": True}

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

    @property
    def key(self) -> tuple[str, int]:
        return self.name, self.version

    @classmethod
    def of(cls, name: str, path: Path, manifest: Manifest) -> DatastoreInfo:
        return cls(
            name=name,
            path=str(path),
            key_type=manifest.key_type,
            nprobe=manifest.index.nprobe,
            entries=manifest.entries,
            shards=[s.name for s in manifest.shards],
            index=manifest.index.factory,
            fingerprint=manifest.model.fingerprint,
            bytes=sum(f.bytes for s in manifest.shards for f in shard_files(s)),
        )


class Runtime(BaseModel):
    knn: KnnConfig  # the settings; `knn.datastores` is empty: `datastores` is the serving set
    datastores: dict[str, DatastoreInfo] = {}
    default: str | None = None
    ray_address: str | None = None
    generation: int = 0


@dataclass(frozen=True)
class ServedModel:
    """What a datastore must match: read once from the model directory."""

    path: Path
    architecture: str
    fingerprint: str
    hidden_size: int
    has_ffn_input: bool

    @classmethod
    def inspect(cls, model_dir: Path) -> ServedModel:
        return cls(
            Path(model_dir),
            architecture_of(model_dir),
            model_fingerprint(model_dir),
            model_config(model_dir)["hidden_size"],
            supports_ffn_input(model_dir),
        )


def check_datastore(name: str, path: str | Path, model: ServedModel) -> tuple[DatastoreInfo, Manifest]:
    """Refuse a datastore built for another model, of another dimension, or of a key type the model lacks."""
    path = Path(path).expanduser().resolve()
    manifest = read_manifest(path)
    check_compatible(manifest, fingerprint=model.fingerprint, where=f"datastore {name!r} ({path})")
    if manifest.dim != model.hidden_size:
        raise DatastoreError(f"datastore {name!r} has keys of dimension {manifest.dim}, the model's hidden size is {model.hidden_size}")
    if manifest.key_type == "ffn_input" and not model.has_ffn_input:
        raise DatastoreError(str(no_ffn_input_error(model.architecture)))
    return DatastoreInfo.of(name, path, manifest), manifest
