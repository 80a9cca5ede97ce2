"""What a soak samples every interval, and what it concludes from the samples.

A sample is the server's process tree (the launcher, vLLM's engine core, Ray's GCS, raylet and
actors, a document job's child) by role: RSS, USS, anonymous memory, open descriptors and threads; plus the Ray
object store's use, the datastore root's bytes and the requests that ended since the last sample.
Trends are least-squares lines over the samples after warm-up, so one spike neither hides nor
fakes growth.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import numpy as np
import psutil

# Roles whose processes come and go by design: their sums jump, they do not creep.
TRANSIENT = ("document job", "ray worker starting")


def role(process: psutil.Process) -> str:
    """What a process of the server is, from its name and command line (Ray renames its workers
    `ray::<Class>.<method>` while they run one; the class is the role)."""
    try:
        cmdline = process.cmdline()
        name = process.name()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return "gone"
    first = cmdline[0] if cmdline else name
    if first.startswith("ray::"):
        return "ray " + first[5:].split(".")[0].split(" ")[0]
    joined = " ".join(cmdline)
    if any(arg.endswith("default_worker.py") for arg in cmdline):  # not yet renamed; its flags name the raylet
        return "ray worker starting"
    if "index_builder.cli" in joined:
        return "document job"
    if "knnlm_serve.server.launcher" in joined:
        return "api server"
    if "EngineCore" in name or "EngineCore" in first:
        return "engine core"
    for ray_part in ("gcs_server", "raylet", "dashboard", "log_monitor", "runtime_env", "monitor.py"):
        if ray_part in joined:
            return "ray " + ray_part.removesuffix(".py")
    return name


def anonymous_bytes(pid: int) -> int:
    """The process's anonymous memory (heaps, arenas, stacks): what a leak grows. USS also holds
    the pages of the libraries it has read in, which leave its USS while another process maps the
    same ones (another server of the same installation beside the soak) and come back after."""
    with open(f"/proc/{pid}/smaps_rollup") as rollup:
        for line in rollup:
            if line.startswith("Anonymous:"):
                return int(line.split()[1]) * 1024
    return 0


def process_sample(root_pid: int) -> dict[str, dict]:
    """role -> summed rss, uss, anon (bytes), fds, threads and process count, over `root_pid`'s tree."""
    try:
        top = psutil.Process(root_pid)
        tree = [top, *top.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {}
    roles: dict[str, dict] = {}
    for process in tree:
        try:
            with process.oneshot():
                memory = process.memory_full_info()
                entry = {"rss": memory.rss, "uss": memory.uss, "anon": anonymous_bytes(process.pid)}
                entry.update(fds=process.num_fds(), threads=process.num_threads())
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
            continue
        total = roles.setdefault(role(process), {"rss": 0, "uss": 0, "anon": 0, "fds": 0, "threads": 0, "processes": 0})
        for key, value in entry.items():
            total[key] += value
        total["processes"] += 1
    return roles


def object_store_bytes() -> int | None:
    """Bytes in Ray's object store, from the cluster this process joined (None without one)."""
    try:
        import ray
        from ray._private.internal_api import memory_summary

        if not ray.is_initialized():
            return None
        text = memory_summary(stats_only=True)
    except Exception:  # noqa: BLE001 - a sample without this figure beats no sample
        return None
    match = re.search(r"Plasma memory usage (\d+) MiB", text)
    return int(match.group(1)) * 2**20 if match else None


def tree_bytes(path: Path) -> int:
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except OSError:
                continue
    return total


def sample(root_pid: int, started: float, datastore_root: Path) -> dict:
    return {
        "t_s": round(time.monotonic() - started, 1),
        "roles": process_sample(root_pid),
        "object_store_bytes": object_store_bytes(),
        "datastore_root_bytes": tree_bytes(datastore_root),
        "shm_entries": len(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else None,
    }


def trend(times: list[float], values: list[float]) -> dict:
    """Least-squares line through (t, value): slope per hour and growth over the span as a
    fraction of the line's value at its start."""
    t, v = np.asarray(times, dtype=float), np.asarray(values, dtype=float)
    if len(t) < 3 or np.ptp(t) == 0:
        return {"samples": len(t), "slope_per_hour": None, "growth": None}
    slope, intercept = np.polyfit(t, v, 1)
    start = slope * t[0] + intercept
    growth = slope * (t[-1] - t[0]) / start if start else None
    return {"samples": len(t), "slope_per_hour": float(slope * 3600), "growth": None if growth is None else float(growth)}


def after_warmup(samples: list[dict], warmup_fraction: float = 0.25) -> list[dict]:
    """The samples of the last three quarters of the run."""
    end = samples[-1]["t_s"] if samples else 0.0
    return [s for s in samples if s["t_s"] >= warmup_fraction * end]


def memory_trends(samples: list[dict], field: str) -> dict[str, dict]:
    """role -> the trend of `field` (rss, uss or anon) per process of the role over the samples after
    warm-up, for the roles present in every one of them (an add starts a shard actor, a compact
    ends some: their count changes by design, each one's memory should not grow)."""
    kept = after_warmup(samples)
    roles = set.intersection(*(set(s["roles"]) for s in kept)) if kept else set()
    return {
        name: trend([s["t_s"] for s in kept], [s["roles"][name][field] / s["roles"][name]["processes"] for s in kept])
        for name in sorted(roles)
        if name not in TRANSIENT
    }


# Bounded by Ray: its log monitor keeps the log files of workers started so far open, up to
# RAY_LOG_MONITOR_MAX_OPEN_FILES; every actor a fault restarts or an add starts adds some.
RAY_BOUNDED = ("ray log_monitor",)


def totals(samples: list[dict], field: str) -> list[float]:
    """`field` (fds, threads) per sample: summed over the server's lasting roles, each role's per
    process (an add or a swap runs a second version's shard actors for a while, a compact ends
    some: their count changes by design, each one's descriptors should not grow)."""
    return [sum(v[field] / v["processes"] for name, v in s["roles"].items() if name not in TRANSIENT + RAY_BOUNDED) for s in samples]


def counts_growth(samples: list[dict], field: str) -> dict:
    """Descriptors or threads after warm-up: the median of the first three samples against the
    last three (a stream open at the moment of a sample is not a leak), and the trend."""
    kept = after_warmup(samples)
    values = totals(kept, field)
    if len(values) < 3:
        return {"start": None, "end": None, "growth": None, "slope_per_hour": None}
    start, end = float(np.median(values[:3])), float(np.median(values[-3:]))
    line = trend([s["t_s"] for s in kept], values)
    return {"start": start, "end": end, "growth": end - start, "slope_per_hour": line["slope_per_hour"]}


def latency_windows(requests: list[dict], duration_s: float) -> dict:
    """p99 latency of the requests that ended in the first and the last sixth of the run (ten
    minutes of an hour), counting only those that run to their end (no disconnects, no refusals)."""
    window = duration_s / 6

    def p99(lo: float, hi: float) -> float | None:
        values = [r["seconds"] for r in requests if r["measured"] and lo <= r["end_s"] < hi]
        return float(np.percentile(values, 99)) if values else None

    first, last = p99(0, window), p99(duration_s - window, duration_s + 1)
    return {"window_s": window, "first_p99_s": first, "last_p99_s": last, "ratio": last / first if first and last else None}
