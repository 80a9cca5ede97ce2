"""A load test's report: on/off ratios over the interleaved pairs, the Markdown table, the plots."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np


def pair_ratios(runs: list[dict], pattern: str, pairs: int) -> dict:
    """Per metric, the on/off ratio of each interleaved pair, its median and spread, and the ITL percentiles."""
    by_label = {r["label"]: r for r in runs}
    pair = [(by_label[pattern.format("on", i=i)], by_label[pattern.format("off", i=i)]) for i in range(1, pairs + 1)]
    out = {}
    for name, metric in (
        ("throughput", "output_throughput"),
        ("p50_itl", "p50_itl_ms"),
        ("p99_itl", "p99_itl_ms"),
        ("p99_e2el", "p99_e2el_ms"),
    ):
        values = [on[metric] / off[metric] for on, off in pair]
        out[name] = {"median": float(np.median(values)), "min": min(values), "max": max(values), "pairs": values}
    for side, index in (("on", 0), ("off", 1)):
        out[f"itl_ms_{side}"] = {p: float(np.median([x[index][f"{p}_itl_ms"] for x in pair])) for p in ("p50", "p99")}
    return out


def markdown(report: dict) -> str:
    lines = [
        f"# Load test ({report['created']}, {report['machine']})",
        "",
        f"Server: {report['server']} (commit {report.get('commit')}); prompts: {report['prompt_source']}"
        + (f", {report['prompt_words']} words" if report.get("prompt_words") else "")
        + ", "
        f"{report['output_len']} output tokens, streaming"
        + (f"; datastore drafts of up to {report['draft_tokens']} tokens" if report.get("draft_tokens") else "")
        + (f"; kNN-on vllm_xargs {json.dumps(report['knn_xargs'])}" if report.get("knn_xargs") else "")
        + ".",
        "",
        "| run | kNN | conc. | rate | req/s | out tok/s | TTFT p50/p99 ms | ITL p50/p99 ms | E2E p50/p99 ms | errors | kNN share of wall | kNN ms/step: all / waited / mix | search ms: slowest shard / rest of span | rows searched / skipped / pointers | server counters match |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|---|",
    ]
    for r in report["runs"]:
        s = r["server"]
        label = r["label"] + (
            f" ({r['event']['event']} at {r['event']['at_s']:g} s: {'ok' if r['event'].get('ok') else r['event'].get('error')})"
            if "event" in r
            else ""
        )
        lines.append(
            f"| {label} | {'on' if r['knn'] else 'off'} | {r['concurrency'] or '-'} | {r['rate'] or '-'} | "
            f"{r['request_throughput']:.2f} | {r['output_throughput']:.1f} | {r['p50_ttft_ms']:.0f}/{r['p99_ttft_ms']:.0f} | "
            f"{r['p50_itl_ms']:.0f}/{r['p99_itl_ms']:.0f} | {r['p50_e2el_ms']:.0f}/{r['p99_e2el_ms']:.0f} | {r['failed']} | "
            f"{s['knn_share_of_wall']:.1%} | "
            + (" / ".join(f"{v:.1f}" for v in s["ms_per_step"].values()) if s["knn_steps"] else "-")
            + " | "
            + (" / ".join(f"{v:.1f}" for v in s["search_ms"].values()) if s["search_steps"] else "-")
            + " | "
            + (" / ".join(f"{v:.0f}" for v in s["rows"].values()) if r["knn"] else "-")
            + f" | {'yes' if s['requests_match_1pct'] and s['tokens_match_1pct'] else 'NO'} |"
        )
    parted = [r for r in report["runs"] if r["knn"] and r["server"]["knn_steps"] and r["server"].get("ms_per_step_part")]
    if parted:
        parts = list(parted[0]["server"]["ms_per_step_part"])
        lines += [
            "",
            "kNN's ms per step, part by part (`knnlm_step_part_seconds`; they add up to the runs' *all*):",
            "",
            "| run | " + " | ".join(parts) + " |",
            "|---|" + "---:|" * len(parts),
        ]
        for r in parted:
            lines.append(f"| {r['label']} | " + " | ".join(f"{v:.2f}" for v in r["server"]["ms_per_step_part"].values()) + " |")
    lines += [
        "",
        "Median over the interleaved pairs (min–max), after a warm-up pair:",
        "",
        "| level | throughput on/off | ITL p50 on/off | ITL p99 on/off | E2E p99 on/off | ITL p50/p99 ms off | ITL p50/p99 ms on |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for level, r in report["on_off_ratios"].items():
        cells = " | ".join(
            f"{r[m]['median']:.3f} ({r[m]['min']:.2f}–{r[m]['max']:.2f})" for m in ("throughput", "p50_itl", "p99_itl", "p99_e2el")
        )
        lines.append(
            f"| {level} | {cells} | {r['itl_ms_off']['p50']:.0f}/{r['itl_ms_off']['p99']:.0f} | {r['itl_ms_on']['p50']:.0f}/{r['itl_ms_on']['p99']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def plots(runs: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    closed = [r for r in runs if r["concurrency"] and "event" not in r and re.fullmatch(r"c\d+-(on|off)-1", r["label"])]
    fig, ax = plt.subplots(figsize=(6, 4))
    for knn in (False, True):
        points = sorted((r["concurrency"], r["output_throughput"]) for r in closed if r["knn"] == knn)
        ax.plot(*zip(*points), marker="o", label=f"kNN {'on' if knn else 'off'}")
    ax.set(xscale="log", xlabel="concurrency", ylabel="output tokens/s", title="Throughput (CPU)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "throughput_vs_concurrency.png", dpi=120)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, metric in zip(axes, ("itl", "e2el")):
        for knn in (False, True):
            for p, style in (("50", "-"), ("99", "--")):
                points = sorted((r["concurrency"], r[f"p{p}_{metric}_ms"]) for r in closed if r["knn"] == knn)
                ax.plot(*zip(*points), style, marker="o", label=f"p{p} kNN {'on' if knn else 'off'}")
        ax.set(xscale="log", xlabel="concurrency", ylabel="ms", title={"itl": "inter-token latency", "e2el": "end-to-end latency"}[metric])
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "latency_vs_concurrency.png", dpi=120)
