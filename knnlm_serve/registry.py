"""The serving datastores, owned by the API-server process: load, hot-swap, unload, default.

A load checks the new version completely (manifest, checksums, model fingerprint, dimension, key
type), starts its shard actors beside the serving ones and probes them; only then is the runtime
file rewritten (one atomic rename), which vLLM's workers pick up at their next step. A replaced
version is retired and its actors are killed once no worker lists it as in use by a running
request. Any failure leaves the serving state untouched.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import threading
import time
from pathlib import Path

import numpy as np

from knnlm_serve import metrics
from knnlm_serve.config import KeyType, KnnConfig
from knnlm_serve.datastore import DatastoreError, read_manifest, verify_checksums
from knnlm_serve.retrieval import actor_name, start_shard_actors
from knnlm_serve.runtime import DatastoreInfo, Runtime, check_datastore, in_use_files
from knnlm_serve.shard import open_shards

NAME_PATTERN = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
RELEASE_GRACE_S = 5.0
REGISTRY: "DatastoreRegistry | None" = None  # the API-server process's registry (admin routes use it)


class AdminError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class DatastoreRegistry:
    def __init__(self, knn: KnnConfig, model_dir: Path, hidden_size: int, runtime_file: Path, ray_address: str | None):
        self.model_dir, self.hidden_size, self.runtime_file = model_dir, hidden_size, runtime_file
        empty = knn.model_copy(update={"datastores": {}, "default_datastore": None})  # filled by load()
        self.runtime = Runtime(knn=empty, datastores={}, ray_address=ray_address)
        self._actors: dict[tuple[str, int], list] = {}
        self._retired: dict[tuple[str, int], tuple[DatastoreInfo, float]] = {}
        self._versions: dict[str, int] = {}
        self._pids: dict[str, int] = {}
        self._info_labels: set[tuple[str, ...]] = set()
        self._lock = threading.RLock()
        self.runtime.save(runtime_file)
        threading.Thread(target=self._reap_forever, daemon=True, name="knnlm-reaper").start()

    # -- changes ---------------------------------------------------------------------------------
    def load(self, name: str, path: str | Path, *, make_default: bool = False, key_type: KeyType | None = None) -> DatastoreInfo:
        if not NAME_PATTERN.match(name):
            raise AdminError(400, f"datastore name {name!r} must match {NAME_PATTERN.pattern}")
        started = time.monotonic()
        with self._lock:
            try:
                info = self._check(name, Path(path), key_type)
                if self.runtime.knn.backend == "ray":
                    self._actors[(name, info.version)] = start_shard_actors(info, self.runtime.knn)
                self._probe(info)
            except AdminError:
                metrics.SWAPS.labels(name, "rejected").inc()
                raise
            old = self.runtime.datastores.get(name)
            default = name if make_default or not self.runtime.datastores else self.runtime.knn.default_datastore
            self._publish({**self.runtime.datastores, name: info}, default)
            if old is not None:
                self._retire(old)
            metrics.SWAPS.labels(name, "swapped" if old else "loaded").inc()
            metrics.SWAP_SECONDS.labels(name).observe(time.monotonic() - started)
            return info

    def unload(self, name: str) -> None:
        with self._lock:
            info = self._get(name)
            remaining = {n: i for n, i in self.runtime.datastores.items() if n != name}
            default = self.runtime.knn.default_datastore
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
            return {"default": self.runtime.knn.default_datastore, "datastores": serving + draining}

    def health(self) -> dict:
        """Ask every serving shard actor who it is; a changed pid means Ray restarted it."""
        import ray

        with self._lock:
            items = [(info, shard, actor) for info in self.runtime.datastores.values()
                     for shard, actor in zip(info.shards, self._actors.get((info.name, info.version), []))]
        refs = [actor.describe.remote() for _, _, actor in items]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.runtime.knn.shard_timeout_s) if refs else ([], [])
        shards = []
        for (info, shard, _), ref in zip(items, refs):
            entry = {"datastore": info.name, "version": info.version, "shard": shard, "actor": actor_name(info, shard)}
            try:
                described = ray.get(ref) if ref in ready else None
            except ray.exceptions.RayError as e:
                described, entry["error"] = None, type(e).__name__
            if described is None:
                entry["status"] = "unavailable"
            else:
                entry.update(status="ok", pid=described["pid"], entries=described["entries"], on_gpu=described["on_gpu"])
                previous = self._pids.setdefault(entry["actor"], described["pid"])
                if previous != described["pid"]:
                    metrics.SHARD_RESTARTS.labels(info.name, shard).inc()
                    self._pids[entry["actor"]] = described["pid"]
            shards.append(entry)
        return {"healthy": all(s["status"] == "ok" for s in shards), "shards": shards}

    # -- internals -------------------------------------------------------------------------------
    def _get(self, name: str) -> DatastoreInfo:
        if name not in self.runtime.datastores:
            raise AdminError(404, f"no datastore named {name!r}; serving: {sorted(self.runtime.datastores)}")
        return self.runtime.datastores[name]

    def _check(self, name: str, path: Path, key_type: KeyType | None) -> DatastoreInfo:
        try:
            info, manifest = check_datastore(name, path, self.model_dir, self.hidden_size)
            verify_checksums(info.path, manifest)
        except DatastoreError as e:
            status = 404 if "does not exist" in str(e) else 422
            raise AdminError(status, str(e)) from None
        serving = self.runtime.datastores.get(name)
        expected = key_type or (serving.key_type if serving else None)
        if expected is not None and manifest.key_type != expected:
            raise AdminError(422, f"datastore at {path} has key type {manifest.key_type!r}, expected {expected!r}")
        self._versions[name] = self._versions.get(name, 0) + 1
        return info.model_copy(update={"version": self._versions[name]})

    def _probe(self, info: DatastoreInfo) -> None:
        """One real query through the new version before it may serve."""
        query = np.random.default_rng(0).normal(size=(1, self.hidden_size)).astype(np.float32)
        try:
            if self.runtime.knn.backend == "ray":
                import ray

                actors = self._actors[(info.name, info.version)]
                timeout = self.runtime.knn.shard_timeout_s
                answers = ray.get([a.search.remote(query, 1, None) for a in actors], timeout=timeout)
                ok = all(a[1].shape == (1, 1) for a in answers)
                for shard, described in zip(info.shards, ray.get([a.describe.remote() for a in actors], timeout=timeout)):
                    self._pids[actor_name(info, shard)] = described["pid"]  # to notice restarts
            else:
                ok = all(s.search(query, 1)[1].shape == (1, 1) for s in open_shards(Path(info.path), read_manifest(info.path)))
        except Exception as e:  # noqa: BLE001 - any failure of the probe rejects the load
            self._kill((info.name, info.version))
            raise AdminError(422, f"datastore {info.name!r}: probe query failed: {type(e).__name__}: {e}") from None
        if not ok:
            self._kill((info.name, info.version))
            raise AdminError(422, f"datastore {info.name!r}: probe query returned a malformed answer")

    def _publish(self, datastores: dict[str, DatastoreInfo], default: str | None) -> None:
        knn = self.runtime.knn.model_copy(
            update={"datastores": {n: i.path for n, i in datastores.items()}, "default_datastore": default}
        )
        self.runtime = self.runtime.model_copy(
            update={"knn": knn, "datastores": datastores, "generation": self.runtime.generation + 1}
        )
        self.runtime.save(self.runtime_file)
        # Multiprocess files keep every label set ever written: retire old ones with 0, not clear().
        labels = {(i.name, str(i.version), str(i.entries), str(len(i.shards)), i.key_type) for i in datastores.values()}
        for old in self._info_labels - labels:
            metrics.DATASTORE_INFO.labels(*old).set(0)
        for new in labels:
            metrics.DATASTORE_INFO.labels(*new).set(1)
        self._info_labels = labels

    def _retire(self, info: DatastoreInfo) -> None:
        self._retired[(info.name, info.version)] = (info, time.monotonic())

    def _in_use(self) -> set[tuple[str, int]]:
        used = set()
        for pid, file in in_use_files(self.runtime_file):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                continue  # a worker that exited holds nothing
            try:
                used |= {tuple(x) for x in json.loads(file.read_text())}
            except (OSError, ValueError):
                continue
        return used

    def _reap_forever(self) -> None:
        """Kill retired versions' actors once no worker lists them. The grace period covers a
        request pinned in the very step that raced the swap (workers report pins a step later).
        Every few seconds, also check the shards' health, which counts actor restarts."""
        for tick in itertools.count():
            time.sleep(0.5)
            if tick % 10 == 0 and self.runtime.knn.backend == "ray":
                self.health()
            with self._lock:
                if not self._retired:
                    continue
                in_use, now = self._in_use(), time.monotonic()
                for key, (_, retired_at) in list(self._retired.items()):
                    if key not in in_use and now - retired_at > RELEASE_GRACE_S:
                        del self._retired[key]
                        self._kill(key)

    def _kill(self, key: tuple[str, int]) -> None:
        import ray

        for actor in self._actors.pop(key, []):
            ray.kill(actor, no_restart=True)

    @staticmethod
    def _describe(info: DatastoreInfo, status: str) -> dict:
        return {**info.model_dump(), "status": status}
