"""The serving contract between the API-server process and vLLM's workers.

`Runtime` is everything a worker needs to serve kNN: the settings, the serving datastore versions
and the default. The registry owns it and pushes every change to the workers through vLLM's worker
RPC (engine/worker_extension.py); a worker applies it between two steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel

from knnlm_core.config import AdaptiveLambda, KeyType, KnnConfig
from knnlm_core.datastore import check_compatible, load_document_starts, manifest_sha256, read_manifest
from knnlm_core.errors import DatastoreError
from knnlm_core.keys import no_ffn_input_error, supports_ffn_input
from knnlm_core.manifest import Calibration, Manifest, PassageIndexEntry, served_nprobe
from knnlm_core.model_dir import architecture_of, hidden_size_of, model_fingerprint
from knnlm_core.shard_keys import shard_keys
from knnlm_core.tombstones import forgotten_share


class MixDefaults(BaseModel):
    """What a request that sets no knob gets from one datastore, and where each value comes from."""

    model_config = {"frozen": True}

    lambda_: float | None  # None: adaptive λ from the nearest distance
    adaptive_lambda: AdaptiveLambda | None
    k: int
    temperature: float
    skip_threshold: float  # rows whose LM top probability exceeds this skip the search
    min_pointers: int  # decode rows follow pointers when this many survive (0: off)
    source: dict[str, str]  # "lambda" / "k" / ... -> "config override" | "calibration" | "config default"


def mix_defaults(knn: KnnConfig, name: str, calibration: Calibration | None) -> MixDefaults:
    """Per datastore: the config's overrides beat the datastore's calibration, which beats the config's
    defaults. A calibrated k or min_pointers is held to this server's knn.max_k."""
    values = {
        "lambda": knn.lambda_,
        "k": knn.k,
        "temperature": knn.temperature,
        "skip_threshold": knn.skip_threshold,
        "min_pointers": knn.min_pointers,
    }
    source = dict.fromkeys(values, "config default")
    adaptive = None
    if calibration is not None:
        values.update({"lambda": calibration.lambda_, "k": min(calibration.k, knn.max_k), "temperature": calibration.temperature})
        source.update(dict.fromkeys(("lambda", "k", "temperature"), "calibration"))
        if calibration.mode == "adaptive":
            adaptive = calibration.adaptive_lambda
        if calibration.skip is not None:
            values["skip_threshold"], source["skip_threshold"] = calibration.skip.threshold, "calibration"
        if calibration.pointers is not None:
            values["min_pointers"], source["min_pointers"] = min(calibration.pointers.min_pointers, knn.max_k), "calibration"
    override = knn.overrides.get(name)
    for field in values:
        value = getattr(override, "lambda_" if field == "lambda" else field, None) if override else None
        if value is not None:
            values[field], source[field] = value, "config override"
            if field == "lambda":
                adaptive = None
    if name in knn.adaptive_lambda and not (override and override.lambda_ is not None):
        adaptive, source["lambda"] = knn.adaptive_lambda[name], "config override"
    return MixDefaults(
        lambda_=None if adaptive else values["lambda"],
        adaptive_lambda=adaptive,
        k=values["k"],
        temperature=values["temperature"],
        skip_threshold=values["skip_threshold"],
        min_pointers=values["min_pointers"],
        source=source,
    )


class DatastoreInfo(BaseModel):
    model_config = {"frozen": True}

    name: str
    version: int = 1  # bumped by every hot-swap of this name
    actors: int = 1  # the version whose load started its shard actors (an add or forget keeps them: `shard_keys`)
    path: str
    key_type: KeyType
    nprobe: int | None
    entries: int
    shards: list[str]
    shard_keys: list[str] = []  # per shard, what its actor holds (knnlm_core.shard_keys)
    index: str
    fingerprint: str
    bytes: int
    calibration: Calibration | None = None
    defaults: MixDefaults | None = None  # set by the registry from the config and the calibration
    documents: int | None = None  # live documents (None: not recorded, a datastore built from keys)
    forgotten: int = 0  # documents forgotten since the build or the last compact
    tombstone_share: float = 0.0  # the share of entries they hold (knnlm-index compact removes them)
    last_add: str | None = None  # when documents were last added, and forgotten
    last_forget: str | None = None
    passages: PassageIndexEntry | None = None  # in-context retrieval's passages; None: built before passages existed
    manifest_sha256: str | None = None  # of the manifest it was loaded from: what other servers and knnlm-index see as the version
    in_process: bool = False  # searched in vLLM's worker process whatever knn.backend is (a vector store's: knn.files.store_search)

    @property
    def key(self) -> tuple[str, int]:
        return self.name, self.version

    def listed(self) -> dict:
        """What the admin API shows of it: not which actors serve it."""
        return self.model_dump(exclude={"actors", "shard_keys"})

    @classmethod
    def of(cls, name: str, path: Path, manifest: Manifest) -> DatastoreInfo:
        starts = load_document_starts(Path(path), manifest)
        return cls(
            name=name,
            path=str(path),
            key_type=manifest.key_type,
            nprobe=served_nprobe(manifest),
            entries=manifest.entries,
            shards=[s.name for s in manifest.shards],
            shard_keys=shard_keys(manifest),
            index=manifest.index.factory,
            fingerprint=manifest.model.fingerprint,
            bytes=sum(f.bytes for f in manifest.files()),
            calibration=manifest.calibration,
            documents=None if starts is None else len(starts) - 1 - len(manifest.forgotten),
            forgotten=len(manifest.forgotten),
            tombstone_share=round(forgotten_share(manifest), 6),
            last_add=manifest.additions[-1].at if manifest.additions else None,
            last_forget=manifest.forgotten[-1].at if manifest.forgotten else None,
            passages=manifest.passages,
        )


class Runtime(BaseModel):
    knn: KnnConfig  # the settings; `knn.datastores` is empty: `datastores` is the serving set
    datastores: dict[str, DatastoreInfo] = {}
    default: str | None = None
    ray_address: str | None = None
    generation: int = 0
    # With tenants (knn.keys_file): a random token the API server puts in the knobs of each request
    # it admitted; the workers serve any other request LM-only (a wire key forged through another
    # vLLM route reaches no datastore).
    admission_token: str | None = None


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
            hidden_size_of(model_dir),
            supports_ffn_input(model_dir),
        )


def check_datastore(name: str, path: str | Path, model: ServedModel) -> tuple[DatastoreInfo, Manifest]:
    """Refuse a datastore built for another model, of another dimension, or of a key type the model lacks."""
    path = Path(path).expanduser().resolve()
    sha256 = manifest_sha256(path)  # before the read: a version written meanwhile shows as a change later
    manifest = read_manifest(path)
    check_compatible(manifest, fingerprint=model.fingerprint, where=f"datastore {name!r} ({path})")
    if manifest.dim != model.hidden_size:
        raise DatastoreError(f"datastore {name!r} has keys of dimension {manifest.dim}, the model's hidden size is {model.hidden_size}")
    if manifest.key_type == "ffn_input" and not model.has_ffn_input:
        raise DatastoreError(str(no_ffn_input_error(model.architecture)))
    return DatastoreInfo.of(name, path, manifest).model_copy(update={"manifest_sha256": sha256}), manifest
