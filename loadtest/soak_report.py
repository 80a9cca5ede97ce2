"""A soak's report: the checks, each process's memory trend, the faults, and the plot of memory,
descriptors and latency over time."""

from __future__ import annotations

import numpy as np

FIELDS = {"anon": "anonymous", "uss": "USS", "rss": "RSS"}


def markdown(report: dict) -> str:
    c = report["conclusions"]
    fields = [f for f in FIELDS if f in c["memory"]]  # the one the goal is judged on first
    lines = [
        f"# Soak ({report['created']}, {report['machine']})",
        "",
        f"`python loadtest/soak.py --minutes {report['minutes']:g}` at commit {report['commit']}: {report['config']} with two tenants "
        f"and the admin API, {clients(report)}, a fault every {report['fault_every_s']:g} s.",
        "",
        f"{c['requests']} requests, **{c['failures']} failures not caused on purpose**, {c['served_without_knn_during_faults']} served "
        f"without their stored answer while a fault took a shard away, {c['audit_leaks']} audit lines of one key naming the other's data; "
        f"{c['faults']} faults, {len(c['faults_failed'])} of them failed.",
        "",
        "| check | holds |",
        "|---|---|",
        *(f"| {name.replace('_', ' ')} | {'yes' if ok else '**no**'} |" for name, ok in c["checks"].items()),
        "",
        "Memory per process after warm-up (the last three quarters; least-squares line; a role of several processes: their mean; "
        f"the goal is judged on {FIELDS[c.get('memory_judged_on', 'uss')]} memory):",
        "",
        "| process | " + " | ".join(f"{FIELDS[f]} MiB/h | {FIELDS[f]} growth" for f in fields) + " |",
        "|---|" + "---|---|" * len(fields),
    ]
    for name in c["memory"]["uss"]:
        cells = [f"{mib(t['slope_per_hour'])} | {pct(t['growth'])}" for t in (c["memory"][f][name] for f in fields)]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    latency = c["latency"]
    lines += [
        "",
        f"Descriptors {c['counts']['fds']['start']} → {c['counts']['fds']['end']}, threads {c['counts']['threads']['start']} → "
        f"{c['counts']['threads']['end']} (per process of each lasting role, summed; medians of the first and last three samples after "
        "warm-up; flat: within 5 %).",
        f"p99 latency: {seconds(latency['first_p99_s'])} in the first {latency['window_s'] / 60:.0f} min, {seconds(latency['last_p99_s'])} in the last "
        f"(ratio {latency['ratio']:.2f})."
        if latency["ratio"]
        else "p99 latency: not enough requests in a window.",
        f"Entries in /dev/shm after warm-up: {c['shm_entries']['start']} → {c['shm_entries']['end']}.",
        f"Datastore root: {c['datastore_root_bytes']['start']} → {c['datastore_root_bytes']['end']} bytes (max {c['datastore_root_bytes']['max']}).",
        "",
        "| fault | at s | ok | recovered s | detail |",
        "|---|---|---|---|---|",
    ]
    for f in report["faults"]:
        detail = {k: v for k, v in f.items() if k not in ("fault", "start_s", "end_s", "ok", "recovered_s")}
        lines.append(f"| {f['fault']} | {f['start_s']:.0f} | {'yes' if f['ok'] else '**no**'} | {f.get('recovered_s', '')} | {detail} |")
    if c["failure_examples"]:
        lines += ["", "Failures:", "", *(f"- {r['kind']} at {r['end_s']} s ({r['tenant']}): {r['error']}" for r in c["failure_examples"])]
    return "\n".join(lines) + "\n"


def clients(report: dict) -> str:
    rate = report.get("rate")
    return f"{report['concurrency']} clients" + (f" at {rate:g} requests a second in all" if rate else "")


def mib(value: float | None) -> str:
    return "" if value is None else f"{value / 2**20:+.1f}"


def pct(value: float | None) -> str:
    return "" if value is None else f"{value:+.1%}"


def seconds(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f} s"


def plot(report: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = report["samples"]
    minutes = np.array([s["t_s"] / 60 for s in samples])
    figure, (memory, counts, latency) = plt.subplots(3, 1, figsize=(10, 11), sharex=True)
    for name in sorted({n for s in samples for n in s["roles"]}):
        values = [s["roles"][name]["uss"] / 2**20 if name in s["roles"] else np.nan for s in samples]
        memory.plot(minutes, values, label=name)
    memory.set_ylabel("USS, MiB")
    memory.set_yscale("log")
    memory.legend(fontsize=7, ncol=2)
    memory.set_title(f"Soak: {report['minutes']:g} min, {clients(report)}, commit {report['commit']}")
    for field, style in (("fds", "-"), ("threads", "--")):
        counts.plot(minutes, [sum(v[field] for v in s["roles"].values()) for s in samples], style, label=f"open {field}")
    counts.set_ylabel("count, all processes")
    counts.legend(fontsize=8)
    ends = np.array([r["end_s"] for r in report["requests"] if r["measured"]])
    took = np.array([r["seconds"] for r in report["requests"] if r["measured"]])
    edges = minutes * 60
    for q, style in ((50, "-"), (99, "--")):
        windows = [(ends >= a) & (ends < b) for a, b in zip(edges[:-1], edges[1:])]
        latency.plot(minutes[1:], [np.percentile(took[w], q) if w.any() else np.nan for w in windows], style, label=f"p{q}")
    latency.set_ylabel("request seconds")
    latency.set_xlabel("minutes")
    for fault in report["faults"]:
        for axis in (memory, counts, latency):
            axis.axvline(fault["start_s"] / 60, color="grey", alpha=0.25)
        latency.annotate(fault["fault"], (fault["start_s"] / 60, 0), xycoords=("data", "axes fraction"), fontsize=6, rotation=90)
    latency.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
