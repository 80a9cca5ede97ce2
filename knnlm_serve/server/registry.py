"""The serving datastores, owned by the API-server process: load, hot-swap, unload, default.

A load checks the new version completely (manifest, checksums, model fingerprint, dimension, key
type), starts its shard actors beside the serving ones (an add's or a forget's new version keeps
the actors of the shards it left unchanged) and probes them; only then is the new runtime pushed
to every vLLM worker (through `EngineLink`, vLLM's worker RPC), which applies it between two
steps. A replaced version is retired and its actors are killed, but those the versions still in
use share, once no worker reports a running request pinned to it. Any failure leaves the serving
state untouched.
"""

from __future__ import annotations

import itertools
import logging
import os
import secrets
import threading
import time
from pathlib import Path
from typing import Protocol

from knnlm_core.config import KeyType, KnnConfig, datastore_name_problem
from knnlm_core.datastore import verify_checksums
from knnlm_core.errors import DatastoreError, ErrorKind
from knnlm_core.provenance import check_served_files
from knnlm_core.vector_store_records import is_store_datastore, is_vector_store
from knnlm_serve import metrics
from knnlm_serve.runtime import DatastoreInfo, Runtime, ServedModel, check_datastore, mix_defaults
from knnlm_serve.server.shard_health import ShardPids
from knnlm_serve.server.version_actors import VersionActors, probe

logger = logging.getLogger("knnlm_serve")

RELEASE_GRACE_S = 5.0
WORKER_POLL_TICKS = 20  # while requests come, the reaper asks the workers for their state every this many half-second ticks
# How long after the last admitted request the reaper keeps asking. Each RPC keeps vLLM's worker
# polling its message queue on a spinning core for a second, so an idle server does not ask.
POLL_AFTER_REQUEST_S = 60.0


class EngineLink(Protocol):
    """The registry's line to every vLLM worker (server/admin.py implements it with collective_rpc)."""

    def set_runtime(self, runtime: Runtime) -> None: ...

    def worker_state(self) -> tuple[set[tuple[str, int]], dict[tuple[str, int], str]]:
        """(versions a running request is pinned to, versions a worker stopped using after repeated errors -> the error)."""
        ...


class DatastoreRegistry:
    def __init__(self, knn: KnnConfig, model: ServedModel, ray_address: str | None):
        self.model = model
        self.config = knn  # the whole kNN config, secrets included: it stays in this process
        token = secrets.token_hex(16) if knn.keys_file is not None else None
        self.runtime = Runtime(knn=knn.worker_settings(), ray_address=ray_address, admission_token=token)
        self._unhealthy: dict[tuple[str, int], str] = {}  # version -> the error its workers stopped using it for
        self._engine: EngineLink | None = None  # connected once vLLM's workers are up
        self._model_cpus: dict[str, list[int]] = {}  # host -> CPUs vLLM's workers are bound to
        self._actors = VersionActors()
        self._retired: dict[tuple[str, int], tuple[DatastoreInfo, float]] = {}
        self._last_request = 0.0  # monotonic time of the last admitted request (`note_request`)
        self._versions: dict[str, int] = {}
        self._shard_pids = ShardPids()
        self._info_labels: set[tuple[str, ...]] = set()
        self._hashed: dict[tuple, str] = {}  # file (device, inode, size, mtime) -> sha256, for versions sharing files
        self._lock = threading.RLock()
        self.closed = threading.Event()
        threading.Thread(target=self._reap_forever, daemon=True, name="knnlm-reaper").start()

    def close(self) -> None:
        """Stop the reaper. Called at exit before Ray shuts down: a Ray call after that would
        start a new local Ray cluster in a server that is going away."""
        self.closed.set()

    def connect(self, engine: EngineLink, model_cpus: dict[str, list[int]] | None = None) -> None:
        """From now on every change reaches the workers (they were attached with the current runtime).
        `model_cpus` (host -> CPUs vLLM's workers are bound to): every shard actor keeps off them."""
        with self._lock:
            self._engine = engine
            self._model_cpus = model_cpus or {}
            for actors in self._actors.every():
                self._keep_off_model(actors)

    def _keep_off_model(self, actors: list[list]) -> None:
        """Move these shard actors off the model's cores (started before the workers were
        attached, after, or restarted by Ray); without waiting: a search may come first."""
        if self._model_cpus:
            for replicas in actors:
                for actor in replicas:
                    actor.keep_off.remote(self._model_cpus)

    # -- changes ---------------------------------------------------------------------------------
    def load(
        self,
        name: str,
        path: str | Path,
        *,
        make_default: bool = False,
        key_type: KeyType | None = None,
        keep_actors: bool = False,
        replacing: DatastoreInfo | None = None,
    ) -> DatastoreInfo:
        """Serve the datastore at `path` as `name`. `keep_actors` (an add's or a forget's new version
        of the serving one): the serving version's actors serve the shards this one did not change.
        `replacing`: only in place of that version (refused as busy once another serves)."""
        if problem := datastore_name_problem(name):
            raise DatastoreError(problem, param="name")
        started = time.monotonic()
        with self._lock:
            old = self.runtime.datastores.get(name)
            if replacing is not None and old != replacing:
                raise DatastoreError(f"datastore {name!r} changed while its new version was checked", ErrorKind.BUSY)
            default = name if make_default or not self.runtime.datastores else self.runtime.default
            info = None
            try:
                info = self._check(name, Path(path), key_type)
                actors = old.actors if keep_actors and old is not None else info.version
                # A vector store's is searched by the workers themselves (knn.files.store_search: worker).
                in_process = self.config.files.store_search == "worker" and is_store_datastore(Path(path), self.config.datastore_root)
                info = info.model_copy(update={"actors": actors, "in_process": in_process})
                if self.runtime.knn.backend == "ray" and not info.in_process:
                    if kept := self._actors.start(info, self.runtime.knn):
                        logger.info("%s@%d: %d shard actor(s) kept from the version before", *info.key, kept)
                    self._keep_off_model(self._actors.of(info.key))
                for actor, pid in probe(info, self._actors, self.runtime.knn, self.model.hidden_size).items():
                    self._shard_pids.remember(actor, pid)  # to notice restarts
                self._publish({**self.runtime.datastores, name: info}, default)
            except Exception:  # a check, an actor start, the probe or the workers' RPC (a timeout too): undo, raise as it came
                if info is not None:
                    self._shard_pids.forget(self._actors.kill(info.key))
                metrics.SWAPS.labels(metrics.datastore_label(name), "rejected").inc()
                raise
            if old is not None:
                self._retire(old)
            metrics.SWAPS.labels(metrics.datastore_label(name), "swapped" if old else "loaded").inc()
            metrics.SWAP_SECONDS.labels(metrics.datastore_label(name)).observe(time.monotonic() - started)
            return info

    def unload(self, name: str) -> None:
        with self._lock:
            info = self._get(name)
            remaining = {n: i for n, i in self.runtime.datastores.items() if n != name}
            default = self.runtime.default
            self._publish(remaining, next(iter(remaining), None) if default == name else default)
            self._retire(info)

    def set_default(self, name: str) -> None:
        with self._lock:
            self._get(name)
            self._publish(self.runtime.datastores, name)

    # -- views -----------------------------------------------------------------------------------
    def describe(self) -> dict:
        with self._lock:
            serving = [self._describe(i, "serving") for i in self.runtime.datastores.values()]
            draining = [self._describe(i, "draining") for i, _ in self._retired.values()]
            return {"default": self.runtime.default, "datastores": serving + draining}

    def public(self, text: str) -> str:
        """`text` with every server path of a datastore shown as clients may see it."""
        infos = [*self.runtime.datastores.values(), *(i for i, _ in self._retired.values())]
        for path in sorted({i.path for i in infos}, key=len, reverse=True):
            text = text.replace(path, self.public_path(path))
        root = self.config.datastore_root
        return text.replace(str(Path(root).expanduser().resolve()) + "/", "") if root else text

    def public_path(self, path: str) -> str:
        """A datastore directory relative to knn.datastore_root; outside it (configured at startup), its name alone."""
        root = self.config.datastore_root
        if root and Path(path).is_relative_to(Path(root).expanduser().resolve()):
            return str(Path(path).relative_to(Path(root).expanduser().resolve()))
        return Path(path).name

    def public_source(self, name: str) -> str:
        """A document's source as clients may see it: a name relative to the build's directory as it
        is; an absolute one (a file added from elsewhere) as `public_path` shows a server path."""
        return self.public_path(name) if os.path.isabs(name) else name

    def health(self) -> dict:
        """Ask every serving shard actor who it is; a changed pid means Ray restarted it."""
        with self._lock:
            items = [
                (info, shard, replica, actor)
                for info in self.runtime.datastores.values()
                for shard, replicas in zip(info.shards, self._actors.of(info.key))
                for replica, actor in enumerate(replicas)
            ]
        shards = self._shard_pids.check(items, self.runtime.knn.shard_timeout_s, lambda actor: self._keep_off_model([[actor]]))
        with self._lock:
            datastores = [self._health(info) for info in self.runtime.datastores.values()]
        healthy = all(s["status"] == "ok" for s in shards) and all(d["healthy"] for d in datastores)
        address = self.runtime.ray_address  # None without Ray
        ray = {"ray_address": address, "ray_namespace": self.runtime.knn.ray_namespace if address else None}
        return {"healthy": healthy, **ray, "datastores": datastores, "model_cpus": self._model_cpus, "shards": shards}

    def _health(self, info: DatastoreInfo) -> dict:
        error = self._unhealthy.get(info.key)
        return {"name": info.name, "version": info.version, "healthy": error is None, "error": error}

    # -- internals -------------------------------------------------------------------------------
    def serving(self, name: str) -> DatastoreInfo:
        with self._lock:
            return self._get(name)

    def _get(self, name: str) -> DatastoreInfo:
        if name not in self.runtime.datastores:
            raise DatastoreError(f"no datastore named {name!r}; serving: {sorted(self.runtime.datastores)}", ErrorKind.NOT_FOUND)
        return self.runtime.datastores[name]

    def _check(self, name: str, path: Path, key_type: KeyType | None) -> DatastoreInfo:
        info, manifest = check_datastore(name, path, self.model)
        verify_checksums(info.path, manifest, self._hashed)
        check_served_files(Path(info.path), manifest)
        serving = self.runtime.datastores.get(name)
        expected = key_type or (serving.key_type if serving else None)
        if expected is not None and manifest.key_type != expected:
            raise DatastoreError(
                f"datastore at {path} has key type {manifest.key_type!r}, expected {expected!r}", param="key_type" if key_type else "path"
            )
        calibration, max_k = info.calibration, self.runtime.knn.max_k
        if calibration is not None:
            for field, value in (
                ("k", calibration.k),
                ("pointers.min_pointers", calibration.pointers and calibration.pointers.min_pointers),
            ):
                if value and value > max_k:
                    logger.warning(
                        "datastore %r: its calibrated %s (%d) exceeds knn.max_k (%d); serving %d", name, field, value, max_k, max_k
                    )
        self._versions[name] = self._versions.get(name, 0) + 1
        defaults = mix_defaults(self.runtime.knn, name, calibration)
        return info.model_copy(update={"version": self._versions[name], "defaults": defaults})

    def _publish(self, datastores: dict[str, DatastoreInfo], default: str | None) -> None:
        runtime = self.runtime.model_copy(update={"datastores": datastores, "default": default, "generation": self.runtime.generation + 1})
        if self._engine is not None:
            self._engine.set_runtime(runtime)  # raises if the workers did not take it: nothing changed
        self.runtime = runtime
        # Multiprocess files keep every label set ever written: retire old ones with 0, not clear().
        # A vector store's state is its own objects', not a series per store (metrics.datastore_label).
        named = [i for i in datastores.values() if not is_vector_store(i.name)]
        labels = {metrics.datastore_info_labels(i) for i in named}
        for old in self._info_labels - labels:
            metrics.DATASTORE_INFO.labels(*old).set(0)
        for new in labels:
            metrics.DATASTORE_INFO.labels(*new).set(1)
        self._info_labels = labels
        for info in named:
            metrics.DATASTORE_HEALTHY.labels(info.name).set(0 if info.key in self._unhealthy else 1)
            if info.documents is not None:
                metrics.DOCUMENTS.labels(info.name).set(info.documents)

    def note_request(self) -> None:
        """A request was admitted: the workers' state may change while it runs."""
        self._last_request = time.monotonic()

    def _retire(self, info: DatastoreInfo) -> None:
        self._retired[info.key] = (info, time.monotonic())

    def _reap_forever(self) -> None:
        """Kill retired versions' actors once no worker reports a request pinned to them (after a
        short grace period, so a version is never killed in the step that retired it).
        Every few seconds, also check the shards' health, which counts actor restarts, and while
        requests come, the versions the workers stopped using."""
        for tick in itertools.count():
            if self.closed.wait(0.5):
                return
            try:
                if tick % 10 == 0 and self.runtime.knn.backend == "ray":
                    self.health()
                recent = time.monotonic() - self._last_request < POLL_AFTER_REQUEST_S
                if (recent and tick % WORKER_POLL_TICKS == 0) or self._retired:
                    self._poll_workers()
            except Exception:  # noqa: BLE001 - the reaper must outlive a failed poll
                logger.exception("datastore reaper: poll failed; retrying")

    def _poll_workers(self) -> None:
        """Release retired versions no running request uses, and take in which versions the workers
        stopped using after repeated errors (served LM-only until reloaded)."""
        with self._lock:
            if self._engine is None:
                return
            in_use, unhealthy = self._engine.worker_state()
            serving = {info.key for info in self.runtime.datastores.values()}
            for key, error in unhealthy.items():
                if key not in self._unhealthy and key in serving:
                    logger.error("datastore %s version %d is unhealthy, served LM-only until reloaded: %s", *key, self.public(error))
                    if not is_vector_store(key[0]):
                        metrics.DATASTORE_HEALTHY.labels(key[0]).set(0)
            self._unhealthy = {key: self.public(error) for key, error in unhealthy.items()}
            now = time.monotonic()
            for key, (_, retired_at) in list(self._retired.items()):
                if key not in in_use and now - retired_at > RELEASE_GRACE_S:
                    del self._retired[key]
                    self._shard_pids.forget(self._actors.kill(key))

    def _describe(self, info: DatastoreInfo, status: str) -> dict:
        return {**info.listed(), "path": self.public_path(info.path), "status": status, **self._health(info)}
