"""Ray's GCS and raylet memory while one actor answers many small calls, each call reporting its
task event or not (docs/performance.md#soak). Ray alone, no knnlm-serve code.

    .venv/bin/python loadtest/task_events_memory.py --calls 60000 --events on
    .venv/bin/python loadtest/task_events_memory.py --calls 60000 --events off
    .venv/bin/python loadtest/task_events_memory.py --calls 0       # an idle cluster, 3 minutes
    .venv/bin/python loadtest/task_events_memory.py --calls 0 --idle-minutes 60
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import psutil
import ray

SAMPLES = 20


def uss_mib(process_name: str) -> float:
    """USS of this script's own Ray process of that name (a server's Ray may run beside it)."""
    (info,) = ray._private.worker._global_node.all_processes[process_name]  # private: Ray lists its processes nowhere else
    return round(psutil.Process(info.process.pid).memory_full_info().uss / 2**20, 1)


class Shard:
    def search(self, queries: np.ndarray, k: int) -> np.ndarray:
        return np.zeros((queries.shape[0], k), np.float32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=60_000)
    parser.add_argument("--events", choices=("on", "off"), default="on", help="whether each call reports its task event")
    parser.add_argument("--idle-minutes", type=float, default=3.0, help="with --calls 0: how long the idle cluster is watched")
    args = parser.parse_args()
    os.environ.setdefault("RAY_task_events_max_num_task_in_gcs", "10000")  # as a cluster the server starts
    ray.init(include_dashboard=False, log_to_driver=False)
    actor = ray.remote(Shard).options(num_cpus=0).remote()
    method = actor.search if args.events == "on" else actor.search.options(enable_task_events=False)
    queries = np.random.default_rng(0).random((8, 576), dtype=np.float32)
    ray.get(method.remote(queries, 32))
    samples, start = [], time.monotonic()

    def sample(calls: int) -> None:
        time.sleep(1.5)  # events reach the GCS about once a second
        samples.append(
            {"calls": calls, "s": round(time.monotonic() - start, 1), "gcs_mib": uss_mib("gcs_server"), "raylet_mib": uss_mib("raylet")}
        )
        print(samples[-1], flush=True)

    if args.calls == 0:
        for _ in range(SAMPLES):
            sample(0)
            time.sleep(args.idle_minutes * 60 / SAMPLES - 1.5)
    for call in range(args.calls):
        if call % max(1, args.calls // SAMPLES) == 0:
            sample(call)
        ray.get(method.remote(queries, 32))
    sample(args.calls)
    print(json.dumps({"events": args.events, "calls": args.calls, "ray": ray.__version__, "samples": samples}))
    ray.shutdown()


if __name__ == "__main__":
    main()
