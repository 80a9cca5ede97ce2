"""Soak: a real server under steady mixed traffic and scheduled faults for a set time, sampled for
what grows (memory, descriptors, threads, the object store, the datastore root) and checked
request by request.

    python loadtest/soak.py                        # 60 min at 16 clients: configs/default.yaml + two tenants + the admin API
    python loadtest/soak.py --minutes 5 --record soak-5min   # also keep the report as loadtest/results/soak-5min/
    python loadtest/soak.py --report-from results/soak/<time>  # that run's report again, with this analysis

The server is the config's, plus two tenants' datastores (built here with the served model), a
keys file and the admin API. The traffic is in soak_traffic.py, the faults in soak_faults.py,
what is sampled and concluded in soak_samples.py. The report (JSON, Markdown, the plot) goes to
results/soak/<time>/.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import soak_samples  # noqa: E402
from run import git_commit  # noqa: E402
from soak_faults import Faults, fault_loop, in_fault_window  # noqa: E402
from soak_report import markdown, plot  # noqa: E402
from soak_traffic import PREFIX, SECRETS, Tenant, Traffic, client_loop  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "soak-admin"
# Open descriptors and threads move with the connections and requests in flight at a sample (the
# API server's and raylet's by about ten either way under 8 clients): a leak shows as growth past that.
GOALS = {"memory_growth": 0.05, "count_growth": 0.05, "latency_ratio": 1.2}


def tenant_datastores(root: Path, model_dir: Path) -> None:
    """alpha and beta: the shared opening sentence with each tenant's secret, and a copy of beta to swap to."""
    from index_builder.build import build_datastore
    from knnlm_core.config import BuildConfig

    for name, secret in SECRETS.items():
        (corpus := root / f"{name}-corpus").mkdir(parents=True)
        records = [
            {"id": f"{name}-vault", "text": PREFIX + secret},
            {"id": f"{name}-tide", "text": f"The {name} tide tables were mended before the boats went out again."},
        ]
        (corpus / "docs.jsonl").write_text("\n".join(json.dumps(r) for r in records))
        build_datastore([corpus], root / name, model_dir, BuildConfig(index="flat", context_length=128, stride=64), progress=False)
    shutil.copytree(root / "beta", root / "beta-copy")


def server_settings(config: Path, root: Path, workdir: Path, keys_file: Path) -> tuple[dict, str | None]:
    """The config's settings with the tenants' datastores, keys and the admin API added; and the
    name of the config's own default datastore (granted to both tenants)."""
    import yaml

    settings = yaml.safe_load(config.read_text())
    knn = settings.setdefault("knn", {})
    shared = knn.get("default_datastore") or next(iter(knn.get("datastores", {})), None)
    knn["datastores"] = {**knn.get("datastores", {}), "alpha": str(root / "alpha"), "beta": str(root / "beta")}
    knn.update(admin_token=TOKEN, datastore_root=str(root), keys_file=str(keys_file), audit_log=str(workdir / "audit.jsonl"))
    return settings, shared


def tenant_keys(shared: str | None) -> tuple[list[Tenant], list[dict]]:
    from knnlm_core.keys_file import key_hash

    tenants = [Tenant("team-a", "alpha", "sk-knn-soak-a", "beta"), Tenant("team-b", "beta", "sk-knn-soak-b", "alpha")]
    rights = ["generate", "explain", "documents"]
    keys = [
        {
            "id": t.key_id,
            "sha256": key_hash(t.key),
            "datastores": {t.datastore: rights, **({shared: ["generate"]} if shared else {})},
            "default": t.datastore,
            "requests_per_minute": 100000,  # high: the per-key windows are exercised, never refuse
        }
        for t in tenants
    ]
    return tenants, keys


def join_ray(address: str | None, namespace: str | None) -> None:
    """Join the server's Ray cluster (by its address: other clusters may run on this machine) to read its object store."""
    if address is None:
        return
    import ray

    ray.init(address=address, namespace=namespace, log_to_driver=False, logging_level="ERROR")


def audit_leaks(path: Path, tenants: list[Tenant]) -> list[dict]:
    """Allowed audit lines of one key that name the other's datastore or documents."""
    others = {t.key_id: t.other for t in tenants}
    lines = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [
        line
        for line in lines
        if line.get("key_id") in others
        and line.get("decision") == "allowed"
        and (
            line.get("datastore") == others[line["key_id"]]
            or any(d["id"].startswith(others[line["key_id"]]) for d in line.get("documents", []))
        )
    ]


def conclusions(samples: list[dict], requests: list[dict], faults: list[dict], duration_s: float, leaks: list[dict]) -> dict:
    failures = [r for r in requests if not r["ok"] and not (r["excusable"] and in_fault_window(r, faults))]
    # A leak grows anonymous memory; runs recorded before it was sampled are judged on USS.
    judged = "anon" if all("anon" in r for s in samples for r in s["roles"].values()) else "uss"
    memory = {field: soak_samples.memory_trends(samples, field) for field in ("rss", "uss", judged)}
    counts = {field: soak_samples.counts_growth(samples, field) for field in ("fds", "threads")}
    latency = soak_samples.latency_windows(requests, duration_s)
    disk = [s["datastore_root_bytes"] for s in samples]
    shm = [s.get("shm_entries") or 0 for s in soak_samples.after_warmup(samples)]
    worst = max((t["growth"] or 0 for t in memory[judged].values()), default=0)
    return {
        "requests": len(requests),
        "failures": len(failures),
        "failure_examples": failures[:20],
        "served_without_knn_during_faults": sum(1 for r in requests if not r["ok"] and r not in failures),
        "audit_leaks": len(leaks),
        "faults": len(faults),
        "faults_failed": [f for f in faults if not f["ok"]],
        "memory": memory,
        "memory_judged_on": judged,
        "counts": counts,
        "latency": latency,
        "shm_entries": {"start": shm[0] if shm else None, "end": shm[-1] if shm else None},
        "datastore_root_bytes": {"start": disk[0] if disk else None, "end": disk[-1] if disk else None, "max": max(disk, default=None)},
        "checks": {
            "no_unplanned_failures": not failures,
            "no_cross_tenant_data": not leaks and not any(r["error"] and r["error"].startswith("leak") for r in requests),
            "faults_recovered": all(f["ok"] for f in faults),
            "memory_growth_below_goal": worst < GOALS["memory_growth"],
            "descriptors_flat": (counts["fds"]["growth"] or 0) <= GOALS["count_growth"] * (counts["fds"]["start"] or 0),
            "threads_flat": (counts["threads"]["growth"] or 0) <= GOALS["count_growth"] * (counts["threads"]["start"] or 0),
            "shared_memory_files_flat": not shm or shm[-1] <= shm[0],
            "latency_p99_ratio_within_goal": latency["ratio"] is None or latency["ratio"] <= GOALS["latency_ratio"],
        },
    }


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # The server's Ray authenticates with a token unless RAY_AUTH_MODE says otherwise (Ray's default
    # for the clusters it starts); join_ray joins it by address, which uses one only when told to,
    # and Ray reads the mode once per process.
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=ROOT / "configs/default.yaml", help="server config to start")
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--concurrency", type=int, default=16, help="clients sending requests back to back")
    parser.add_argument("--rate", type=float, default=0.0, help="requests a second from all clients at most (default: back to back)")
    parser.add_argument("--sample-every", type=float, default=30.0, help="seconds between samples")
    parser.add_argument("--fault-every", type=float, help="seconds between faults (default: each kind three times in the run)")
    parser.add_argument("--out", type=Path, default=ROOT / "results/soak", help="where each run's report and logs go (untracked)")
    parser.add_argument("--record", metavar="NAME", help="also keep the report as loadtest/results/NAME/ (tracked)")
    parser.add_argument(
        "--report-from", type=Path, metavar="RUN", help="write RUN's report again (its report.json) with this analysis; no run"
    )
    args = parser.parse_args()
    if args.report_from:
        write_report(args.report_from, json.loads((args.report_from / "report.json").read_text()), args.record)
        return
    duration_s = args.minutes * 60
    every_s = args.fault_every or duration_s / 22

    from knnlm_core.default_model import resolve_model
    from knnlm_serve.server.process import RunningServer

    workdir = args.out / datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    root = workdir / "root"
    keys_file = workdir / "keys.yaml"
    settings, shared = server_settings(args.config, root, workdir, keys_file)
    tenants, keys = tenant_keys(shared)
    print(f"soak: building the tenants' datastores in {root} ...", flush=True)
    tenant_datastores(root, resolve_model(settings.get("model", "default")))
    keys_file.write_text(json.dumps({"keys": keys}))
    print(f"soak: starting the server ({args.config}) ...", flush=True)
    with RunningServer(settings, workdir, api_key=tenants[0].key) as server:
        health = requests_json(server.base_url, "/v1/knn/health")
        join_ray(health.get("ray_address"), health.get("ray_namespace"))
        traffic = Traffic(server.base_url, settings.get("served_model_name") or "default", shared, tenants)
        faults = Faults(traffic, TOKEN, root, keys_file, keys)
        stop = threading.Event()
        request_every_s = args.concurrency / args.rate if args.rate else 0.0
        clients = [(traffic, i, stop, request_every_s) for i in range(args.concurrency)]
        threads = [threading.Thread(target=client_loop, args=client, daemon=True) for client in clients]
        threads.append(threading.Thread(target=fault_loop, args=(faults, every_s, stop), daemon=True))
        for thread in threads:
            thread.start()
        samples = []
        while traffic.now() < duration_s:
            samples.append(soak_samples.sample(server.proc.pid, traffic.started, root))
            progress(samples[-1], traffic, duration_s)
            time.sleep(max(0.0, min(args.sample_every, duration_s - traffic.now())))
        samples.append(soak_samples.sample(server.proc.pid, traffic.started, root))
        stop.set()
        for thread in threads:
            thread.join(timeout=900)
    report = {
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{os.cpu_count()} CPU cores, no GPU",
        "commit": git_commit(),
        "config": str(args.config.resolve().relative_to(ROOT)) if args.config.resolve().is_relative_to(ROOT) else args.config.name,
        "minutes": args.minutes,
        "concurrency": args.concurrency,
        "rate": args.rate or None,
        "fault_every_s": round(every_s, 1),
        "faults": faults.records,
        "samples": samples,
        "requests": traffic.records,
    }
    write_report(workdir, report, args.record)


def write_report(workdir: Path, report: dict, record: str | None) -> None:
    """The run's conclusions, JSON, Markdown and plot in `workdir`; with `record`, a copy kept in
    loadtest/results/<record>/."""
    tenants, _ = tenant_keys(None)
    duration_s = report["minutes"] * 60
    leaks = audit_leaks(workdir / "audit.jsonl", tenants)
    report.update(goals=GOALS, conclusions=conclusions(report["samples"], report["requests"], report["faults"], duration_s, leaks))
    (workdir / "report.json").write_text(json.dumps(report, indent=1))
    (workdir / "report.md").write_text(markdown(report))
    plot(report, workdir / "soak.png")
    print(markdown(report))
    print(f"soak: report in {workdir}")
    if record:
        kept = ROOT / "loadtest/results" / record
        shutil.rmtree(kept, ignore_errors=True)
        kept.mkdir(parents=True)
        for name in ("report.json", "report.md", "soak.png"):
            shutil.copy(workdir / name, kept / name)
        print(f"soak: kept as {kept.relative_to(ROOT)}")


def requests_json(base_url: str, route: str) -> dict:
    import requests

    return requests.get(f"{base_url}{route}", headers={"X-Admin-Token": TOKEN}, timeout=120).json()


def progress(sample: dict, traffic: Traffic, duration_s: float) -> None:
    with traffic.lock:
        done, failed = len(traffic.records), sum(1 for r in traffic.records if not r["ok"])
    memory = ", ".join(f"{name} {v['uss'] / 2**20:.0f}" for name, v in sorted(sample["roles"].items()))
    print(f"soak: {sample['t_s'] / 60:5.1f}/{duration_s / 60:.0f} min, {done} requests ({failed} not ok), USS MiB: {memory}", flush=True)


if __name__ == "__main__":
    main()
