"""A forget's time to serving through Ray shard actors: the new version keeping the actors of the
shards the forget left unchanged (what the admin API's forget, add and compact do) against starting
every actor afresh (a load through `POST /v1/knn/datastores`).

    .venv/bin/python benchmarks/swap_actors.py          # ~10 min on 2 CPU cores, ~5 GB of /tmp

The synthetic stores of benchmarks/tombstones.py (`--entries` Gaussian 576-d keys in 4 shards,
documents of 1,000 entries; exact and fast-scan IVF-PQ), served by a `DatastoreRegistry` with the
Ray backend, as the server's, with the server's defaults (one actor per shard, memory-mapped
indexes). For each store, `--repeats` interleaved pairs: forget a document of the first shard
(`forget_documents`), then time `registry.load` with the actors kept; forget another, then time it
with every actor started afresh. Between two loads the retired version is released, as the
server's reaper does once no request is pinned to it. Each load checks and hashes the new files,
starts the actors it needs, and probes every shard, as a server's does; the workers' side (a
runtime pushed between two steps) is the same either way and is left out.
Writes benchmarks/results/swap_actors.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from run_record import run_record  # noqa: E402
from tombstones import SERVED, synthetic_stores  # noqa: E402

from index_builder.forget import forget_documents  # noqa: E402
from knnlm_core.config import KnnConfig  # noqa: E402
from knnlm_serve.server.registry import DatastoreRegistry  # noqa: E402


class NoWorkers:
    """The registry's line to vLLM's workers, with no engine: nothing is pinned, so a retired
    version is released after the grace period."""

    def set_runtime(self, runtime) -> None:
        pass

    def worker_state(self):
        return set(), {}


def released(registry: DatastoreRegistry, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while any(d["status"] == "draining" for d in registry.describe()["datastores"]):
        assert time.monotonic() < deadline, "a retired version was never released"
        time.sleep(0.5)


def pids(registry: DatastoreRegistry, name: str) -> dict[str, int]:
    return {s["shard"]: s["pid"] for s in registry.health()["shards"] if s["datastore"] == name}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entries", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--work", type=Path, default=Path("/tmp/knnlm-swap-actors"))
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/swap_actors.json")
    args = parser.parse_args()
    record = run_record("swap_actors")
    import ray

    ray.init(include_dashboard=False, log_to_driver=False)
    report = {**record, "entries": args.entries, "shards": 4, "repeats": args.repeats, "stores": {}}
    for name, factory, root in synthetic_stores(args.work, args.entries):
        registry = DatastoreRegistry(KnnConfig(), SERVED, None)
        registry.connect(NoWorkers())
        started = time.monotonic()
        registry.load(name, root)
        first = time.monotonic() - started
        times: dict[str, list[float]] = {"kept": [], "fresh": []}
        forgets, kept_shards = [], []
        document = 0  # documents of the first shard, one per forget
        for _ in range(args.repeats):
            for mode in ("kept", "fresh"):
                before = pids(registry, name)
                started = time.monotonic()
                forget_documents(root, documents=[document])
                forgets.append(time.monotonic() - started)
                started = time.monotonic()
                registry.load(name, root, keep_actors=mode == "kept")
                times[mode].append(time.monotonic() - started)
                if mode == "kept":
                    after = pids(registry, name)
                    kept_shards.append(sum(after[s] == pid for s, pid in before.items()))
                document += 1
                released(registry)
        registry.close()
        report["stores"][name] = {
            "index": factory,
            "first_load_s": round(first, 3),
            "forget_s": round(float(np.median(forgets)), 3),
            "load_after_forget_s": {
                mode: {"median": round(float(np.median(t)), 3), "min": round(min(t), 3), "max": round(max(t), 3)}
                for mode, t in times.items()
            },
            "kept_over_fresh": round(float(np.median(times["kept"]) / np.median(times["fresh"])), 3),
            "actors_kept_of_4": kept_shards,
        }
        print(name, json.dumps(report["stores"][name]), flush=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
