"""What every serving shard actor says of itself (`GET /v1/knn/health`), and its restarts: a
changed pid means Ray restarted the actor under its name."""

from __future__ import annotations

from knnlm_serve import metrics
from knnlm_serve.retrieval import actor_name


class ShardPids:
    def __init__(self) -> None:
        self._pids: dict[str, int] = {}  # actor name -> the pid it answered with last

    def remember(self, name: str, pid: int) -> None:
        self._pids[name] = pid

    def forget(self, names: list[str]) -> None:
        """Killed actors: a name that comes back is a new actor, not a restart."""
        for name in names:
            self._pids.pop(name, None)

    def check(self, items: list[tuple], timeout: float, on_restart) -> list[dict]:
        """Each (info, shard, replica, actor)'s status within `timeout` seconds, counting restarts
        and handing each restarted actor to `on_restart`."""
        import ray

        # Asked at every health check: no task event of each in Ray's GCS (see fanout.py's search).
        refs = [actor.describe.options(enable_task_events=False).remote() for *_, actor in items]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout) if refs else ([], [])
        shards = []
        for (info, shard, replica, actor), ref in zip(items, refs):
            entry = {
                "datastore": info.name,
                "version": info.version,
                "shard": shard,
                "replica": replica,
                "actor": actor_name(info, shard, replica),
            }
            try:
                described = ray.get(ref) if ref in ready else None
            except ray.exceptions.RayError as e:
                described, entry["error"] = None, type(e).__name__
            if described is None:
                entry["status"] = "unavailable"
            else:
                entry.update(
                    status="ok",
                    pid=described["pid"],
                    node=described["node"],
                    cpus=described["cpus"],
                    nice=described["nice"],
                    entries=described["entries"],
                    on_gpu=described["on_gpu"],
                )
                previous = self._pids.setdefault(entry["actor"], described["pid"])
                if previous != described["pid"]:
                    metrics.SHARD_RESTARTS.labels(metrics.datastore_label(info.name), shard, str(replica)).inc()
                    self._pids[entry["actor"]] = described["pid"]
                    on_restart(actor)  # a restarted actor starts on every CPU again
            shards.append(entry)
        return shards
