"""Ray's GCS and raylet memory while one actor answers many small calls, each call reporting its
task event or not (docs/performance.md#soak). Ray alone, no knnlm-serve code.

    .venv/bin/python loadtest/task_events_memory.py --calls 60000 --events on
    .venv/bin/python loadtest/task_events_memory.py --calls 60000 --events off
    .venv/bin/python loadtest/task_events_memory.py --calls 0       # an idle cluster, 3 minutes
    .venv/bin/python loadtest/task_events_memory.py --calls 0 --idle-minutes 60 --out loadtest/results/ray-idle-60min.json
    RAY_enable_metrics_collection=0 .venv/bin/python loadtest/task_events_memory.py --calls 0 --idle-minutes 60 --out ...
    .venv/bin/python loadtest/task_events_memory.py --plot-runs A.json B.json --out runs.png   # no run: their raylets on one chart

The samples are printed as JSON at the end, and with --out written there with a plot beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import ray

SAMPLES = 20


def private_mib(process_name: str) -> tuple[float, float]:
    """(USS, of it its pages of files: the executable's code read in as it runs, which the kernel
    can drop and read again) of this script's own Ray process of that name, in MiB. Pages another
    process maps too are in neither: a second Ray from the same files (a server's) shares the
    executables' code, and this process's USS drops while it runs."""
    (info,) = ray._private.worker._global_node.all_processes[process_name]  # private: Ray lists its processes nowhere else
    fields = dict(line.split(":") for line in Path(f"/proc/{info.process.pid}/smaps_rollup").read_text().splitlines()[1:])
    kib = {name: int(value.split()[0]) for name, value in fields.items()}
    return round((kib["Private_Clean"] + kib["Private_Dirty"]) / 1024, 1), round(kib["Private_Clean"] / 1024, 1)


class Shard:
    def search(self, queries: np.ndarray, k: int) -> np.ndarray:
        return np.zeros((queries.shape[0], k), np.float32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=60_000)
    parser.add_argument("--events", choices=("on", "off"), default="on", help="whether each call reports its task event")
    parser.add_argument("--idle-minutes", type=float, default=3.0, help="with --calls 0: how long the idle cluster is watched")
    parser.add_argument("--out", type=Path, help="write the samples here as JSON, and a plot of them beside it (.png)")
    parser.add_argument("--plot-runs", type=Path, nargs="+", help="no run: plot these runs' raylets on one chart, to --out (.png)")
    args = parser.parse_args()
    if args.plot_runs:
        return plot_runs([json.loads(p.read_text()) for p in args.plot_runs], args.out)
    os.environ.setdefault("RAY_task_events_max_num_task_in_gcs", "10000")  # as a cluster the server starts
    ray.init(address="local", include_dashboard=False, log_to_driver=False)  # its own cluster, never another on this machine
    actor = ray.remote(Shard).options(num_cpus=0).remote()
    method = actor.search if args.events == "on" else actor.search.options(enable_task_events=False)
    queries = np.random.default_rng(0).random((8, 576), dtype=np.float32)
    ray.get(method.remote(queries, 32))
    samples, start = [], time.monotonic()

    def sample(calls: int) -> None:
        time.sleep(1.5)  # events reach the GCS about once a second
        (gcs, gcs_files), (raylet, raylet_files) = private_mib("gcs_server"), private_mib("raylet")
        samples.append(
            {"calls": calls, "s": round(time.monotonic() - start, 1), "gcs_mib": gcs, "gcs_files_mib": gcs_files}
            | {"raylet_mib": raylet, "raylet_files_mib": raylet_files}
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
    settings = {k: v for k, v in os.environ.items() if k.startswith(("RAY_", "MALLOC_"))}  # what the run changed of Ray's defaults
    record = {"events": args.events, "calls": args.calls, "ray": ray.__version__, "environment": settings, "samples": samples}
    print(json.dumps(record))
    ray.shutdown()
    if args.out:
        args.out.write_text(json.dumps(record, indent=1) + "\n")
        plot(record, args.out.with_suffix(".png"))


def plot(record: dict, path: Path) -> None:
    fig, ax = _figure()
    minutes = [s["s"] / 60 for s in record["samples"]]
    for process in ("gcs", "raylet"):
        line = ax.plot(minutes, [s[f"{process}_mib"] for s in record["samples"]], marker=".", label=f"{process}: USS")[0]
        if f"{process}_files_mib" in record["samples"][0]:
            anonymous = [s[f"{process}_mib"] - s[f"{process}_files_mib"] for s in record["samples"]]
            ax.plot(minutes, anonymous, linestyle="--", color=line.get_color(), label=f"{process}: USS less its files' pages")
    _save(fig, ax, path, "USS, MiB", f"Ray {record['ray']}: {record['calls']:,} calls, task events {record['events']}")


def plot_runs(records: list[dict], path: Path) -> None:
    """Each run's raylet, USS less its executable's pages (what two raylets of one installation
    running side by side do not share), labelled by the variables it alone ran with."""
    fig, ax = _figure()
    shared = set.intersection(*(set(r.get("environment", {}).items()) for r in records))
    for record in records:
        label = ", ".join(f"{k}={v}" for k, v in sorted(set(record.get("environment", {}).items()) - shared)) or "Ray's defaults"
        minutes = [s["s"] / 60 for s in record["samples"]]
        ax.plot(minutes, [s["raylet_mib"] - s["raylet_files_mib"] for s in record["samples"]], marker=".", label=label)
    _save(fig, ax, path, "raylet: USS less its files' pages, MiB", f"Ray {records[0]['ray']}, idle: one actor, no call")


def _figure():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(6, 3.5))


def _save(fig, ax, path: Path, ylabel: str, title: str) -> None:
    ax.set_xlabel("minutes since Ray started")
    ax.set_ylabel(ylabel)
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=9)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
