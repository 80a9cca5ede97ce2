"""Serve the version another server, or `knnlm-index`, wrote into a serving datastore's directory.

Servers that share a datastore directory (replicas behind a load balancer) each serve the version
they loaded, and an add, forget or compact through one of them replaces the directory. With
`knn.follow_changes_s` set, a server reads its serving datastores' manifests that often and
hot-swaps to a new version it finds there, keeping the actors of the shards it left unchanged; so
a forget made through one replica stops being served by the others within that time. A datastore
with an add, forget or compact of this server running is left to that job, which loads its own
version. A new version that does not load is logged once and the serving one stays.
"""

from __future__ import annotations

import logging
import threading

from knnlm_core.datastore import manifest_sha256
from knnlm_core.errors import ErrorKind, KnnlmError
from knnlm_serve.server.document_jobs import DocumentJobs
from knnlm_serve.server.registry import DatastoreRegistry

logger = logging.getLogger("knnlm_serve")


class DiskFollower:
    def __init__(self, registry: DatastoreRegistry, jobs: DocumentJobs, every_s: float):
        self._registry, self._jobs, self._every_s = registry, jobs, every_s
        self._refused: dict[str, str] = {}  # datastore -> the manifest sha256 whose version did not load

    def start(self) -> None:
        threading.Thread(target=self._run, daemon=True, name="knnlm-disk-follower").start()

    def _run(self) -> None:
        while not self._registry.closed.wait(self._every_s):
            try:
                self.check()
            except Exception:  # noqa: BLE001 - the follower must outlive a failed check
                logger.exception("datastore follower: check failed; retrying")

    def check(self) -> None:
        """Load each serving datastore whose directory holds another version than the one serving."""
        for name, info in list(self._registry.runtime.datastores.items()):
            found = manifest_sha256(info.path)
            if found is None or found in (info.manifest_sha256, self._refused.get(name)) or self._jobs.holds(name):
                continue
            try:
                new = self._registry.load(name, info.path, keep_actors=True, replacing=info)
            except KnnlmError as e:
                if e.kind is ErrorKind.BUSY:  # another load replaced it meanwhile: compare again next time
                    continue
                self._refused[name] = found
                logger.warning(
                    "%s: its directory holds a new version that does not serve (%s); still serving version %d", name, e, info.version
                )
                continue
            logger.info("%s: serving version %d, found in its directory (%s)", name, new.version, self._registry.public_path(new.path))
