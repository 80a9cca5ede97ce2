"""The shard actors of the datastore versions the registry holds. Actors are named per shard state
(`actor_name`), so a version made by an add or a forget reaches the actors of the shards it left
unchanged. Ray ends an actor once the handle that started it is gone (a handle found by name does
not keep it), so that handle is held while any version uses the actor, which is then killed."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from knnlm_core.config import KnnConfig
from knnlm_core.datastore import read_manifest
from knnlm_core.errors import DatastoreError
from knnlm_core.search import open_shards
from knnlm_serve.retrieval import actor_name, start_shard_actors
from knnlm_serve.runtime import DatastoreInfo

Key = tuple[str, int]  # (datastore, version)


class VersionActors:
    def __init__(self) -> None:
        self._held: dict[str, object] = {}  # actor name -> the handle that started it
        self._names: dict[Key, list[list[str]]] = {}  # per version: per shard, its replicas' names

    def start(self, info: DatastoreInfo, knn: KnnConfig) -> int:
        """Start this version's actors, loaded when this returns; how many another version holds already."""
        actors = start_shard_actors(info, knn)
        names = [[actor_name(info, shard, r) for r in range(knn.replicas)] for shard in info.shards]
        kept = sum(name in self._held for replicas in names for name in replicas)
        for replica_names, replicas in zip(names, actors):
            for name, actor in zip(replica_names, replicas):
                self._held.setdefault(name, actor)
        self._names[info.key] = names
        return kept

    def of(self, key: Key) -> list[list]:
        """Per shard of this version, its replicas' actors."""
        return [[self._held[name] for name in replicas] for replicas in self._names.get(key, [])]

    def named(self, key: Key) -> list[tuple[str, object]]:
        """(name, actor) of each of this version's actors."""
        return [(name, self._held[name]) for replicas in self._names.get(key, []) for name in replicas]

    def every(self) -> list[list[list]]:
        return [self.of(key) for key in self._names]

    def kill(self, key: Key) -> list[str]:
        """Forget this version's actors and kill those no other version holds; their names."""
        import ray

        names = [name for replicas in self._names.pop(key, []) for name in replicas]
        shared = {name for versions in self._names.values() for replicas in versions for name in replicas}
        killed = [name for name in names if name not in shared and name in self._held]
        for name in killed:
            ray.kill(self._held.pop(name), no_restart=True)
        return killed


def probe(info: DatastoreInfo, actors: VersionActors, knn: KnnConfig, hidden_size: int) -> dict[str, int]:
    """One real query through a new version before it may serve; each of its actors' pid."""
    query = np.random.default_rng(0).normal(size=(1, hidden_size)).astype(np.float32)
    pids: dict[str, int] = {}
    try:
        if knn.backend == "ray" and not info.in_process:
            import ray

            names, handles = zip(*actors.named(info.key))
            answers = ray.get([a.search.remote(query, 1, None) for a in handles], timeout=knn.shard_timeout_s)
            ok = all(a[1].shape == (1, 1) for a in answers)
            described = ray.get([a.describe.remote() for a in handles], timeout=knn.shard_timeout_s)
            pids = {name: d["pid"] for name, d in zip(names, described)}
        else:
            ok = all(s.search(query, 1)[1].shape == (1, 1) for s in open_shards(Path(info.path), read_manifest(info.path)))
    except Exception as e:  # noqa: BLE001 - any failure of the probe rejects the load
        raise DatastoreError(f"datastore {info.name!r}: probe query failed: {type(e).__name__}: {e}") from None
    if not ok:
        raise DatastoreError(f"datastore {info.name!r}: probe query returned a malformed answer")
    return pids
