"""Reports of an evaluation: results.json, a Markdown table and plots."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from knnlm_serve.eval.run import EvalRun


def markdown_table(summary: dict) -> str:
    """One row per setting: base LM, each variant at its tuned best, adaptive λ, and the vLLM check."""
    rows = ["| setting | k | τ | λ | tune ppl | report ppl |", "|---|---|---|---|---|---|"]
    base = summary["base"]
    rows.append(f"| base LM (kNN off, vLLM) | | | | {base['tune_ppl']:.3f} | {base['report_ppl']:.3f} |")
    for r in summary["variants"]:
        b = r["best"]
        rows.append(
            f"| kNN-LM {r['label']} | {b['k']} | {b['temperature']:g} | {b['lambda']:g} | {b['tune_ppl']:.3f} | {b['report_ppl']:.3f} |"
        )
    a = summary["adaptive"]
    rows.append(
        f"| adaptive λ on {a['variant']}: λ = {a['lambda_max']:g}·σ({a['slope']:.3g}·({a['center']:.4g} − d₁)) | {a['k']} | "
        f"{a['temperature']:g} | mean {a['mean_lambda_report']:.3f} | {a['tune_ppl']:.3f} | {a['report_ppl']:.3f} |"
    )
    sd = summary["served_defaults"]
    lam = sd["lambda"] if sd["lambda"] == "adaptive" else f"{sd['lambda']:g}"
    rows.append(
        f"| served defaults (no knobs; λ from {sd['source']['lambda']}; searches skipped where p_LM(top) > {sd['skip_threshold']:.3g}: "
        f"{sd['skipped_report']:.0%}; pointers followed from {sd['min_pointers']} survivors: {sd['followed_report']:.0%}; "
        f"report ppl {sd['report_ppl_every_search']:.3f} with every search, {sd['full_retrieval']['report_ppl']:.3f} with every "
        f"search at the build's nprobe: {sd['full_retrieval']['gap_pct']:+.2f}% vs full retrieval), "
        f"{sd['gap_to_best_pct']:+.2f}% vs tuned best | {sd['k']} | "
        f"{sd['temperature']:g} | {lam} | {sd['tune_ppl']:.3f} | {sd['report_ppl']:.3f} |"
    )
    s = summary["served"]
    rows.append(
        f"| served through vLLM: {s['variant']}, searches skipped where p_LM(top) > {s['skip_threshold']:.3g} "
        f"({s['skipped_report']:.0%} of report tokens) | {s['k']} | {s['temperature']:g} | {s['lambda']:g} | "
        f"{s['vllm_tune_ppl']:.3f} | {s['vllm_report_ppl']:.3f} |"
    )
    ar = summary["adaptive_retrieval"]
    rows += ["", "Adaptive retrieval on the served setting (skip the search where the LM's top probability exceeds a threshold):", ""]
    rows += ["| threshold | tune skipped | tune ppl | report skipped | report ppl |", "|---|---|---|---|---|"]
    rows += [
        f"| {c['threshold']:.3g} | {c['tune_skipped']:.0%} | {c['tune_ppl']:.3f} | {c['report_skipped']:.0%} | {c['report_ppl']:.3f} |"
        for c in ar["curve"]
    ]
    rows.append(
        f"\nFitted (tuning ppl within {ar['tolerance']:.1%} of full retrieval): threshold {ar['threshold']:.3g}, "
        f"{ar['skipped']:.0%} of report searches skipped, report ppl {ar['ppl']:.3f} vs {ar['full_ppl']:.3f} "
        f"with every search ({100 * (ar['ppl'] / ar['full_ppl'] - 1):+.2f}%)."
    )
    if summary["pointers"]:
        pt = summary["pointers"]
        rows += ["", f"Pointer following on the served setting (every search: report ppl {pt['full_ppl']:.3f}):", ""]
        rows += ["| min pointers | tune saved | tune ppl | report saved | report ppl |", "|---|---|---|---|---|"]
        rows += [
            f"| {c['min_pointers']} | {c['tune_saved']:.0%} | {c['tune_ppl']:.3f} | {c['report_saved']:.0%} | {c['report_ppl']:.3f} |"
            for c in pt["curve"]
        ]
    t = summary["text"]
    return "\n".join(rows) + (
        f"\n\nText: {t['tokens']:,} tokens, {t['scored_tokens']:,} scored in {t['windows']} windows "
        f"(context {t['context_length']}, stride {t['stride']}); {t['split']}: {t['tune_tokens']:,} tune, "
        f"{t['report_tokens']:,} report. Best on the tuning part: {summary['best']['variant']}, k={summary['best']['k']}, "
        f"τ={summary['best']['temperature']:g}, λ={summary['best']['lambda']:g}. NumPy recomputation of the served "
        f"setting: report ppl {s['numpy_report_ppl']:.3f} (max |Δ log p| {s['max_abs_logprob_diff']:.2e}).\n"
    )


def write_report(run: EvalRun, out_dir: Path, per_token: bool = False) -> list[Path]:
    """results.json, results.md, the plots, and optionally tokens.npz (per-token records)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [out_dir / "results.json", out_dir / "results.md"]
    # Indented, but each innermost list of numbers on one line: the grids stay readable and small.
    text = re.sub(r"\[\s+([-+\d.,eEnul\s]+?)\s+\]", lambda m: "[" + " ".join(m.group(1).split()) + "]", json.dumps(run.summary, indent=1))
    written[0].write_text(text)
    written[1].write_text(markdown_table(run.summary))
    written += plot_results(run.summary, out_dir)
    if per_token:
        np.savez_compressed(out_dir / "tokens.npz", **run.arrays)
        written.append(out_dir / "tokens.npz")
    return written


def plot_results(summary: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = summary["variants"]
    main = variants[0]
    grid, best = main["grid"], main["best"]
    ki, ti = grid["k"].index(best["k"]), grid["temperature"].index(best["temperature"])
    li = grid["lambda"].index(best["lambda"])
    base = summary["base"]["report_ppl"]
    files = []

    def save(fig, ax, name, title, xlabel):
        ax.axhline(base, color="grey", ls="--", label="base LM")
        ax.set(title=title, xlabel=xlabel, ylabel="report perplexity")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=110)
        plt.close(fig)
        files.append(out_dir / name)

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(
        grid["lambda"],
        np.array(grid["report_ppl"], dtype=float)[ki, ti],
        marker="o",
        ms=3,
        label=f"{main['label']}\nk={best['k']}, τ={best['temperature']:g}",
    )
    save(fig, ax, "ppl_vs_lambda.png", "Perplexity vs λ", "λ")

    fig, ax = plt.subplots(figsize=(6, 4))
    for a, k in enumerate(grid["k"]):
        ax.plot(
            grid["temperature"], np.array(grid["report_ppl"], dtype=float)[a, :, li], marker="o", ms=3, label=f"k={k}, λ={best['lambda']:g}"
        )
    ax.set_xscale("log")
    save(fig, ax, "ppl_vs_temperature.png", "Perplexity vs τ", "τ (softmax temperature over −distance)")

    sized = [v for v in variants if v["datastore"] == main["datastore"] and v["index"] == main["index"] and v["nprobe"] == main["nprobe"]]
    if len(sized) > 1:
        sized.sort(key=lambda v: v["fraction"])
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot([v["fraction"] * v["entries"] for v in sized], [v["best"]["report_ppl"] for v in sized], marker="o", label="kNN-LM (tuned)")
        ax.set_xscale("log")
        save(fig, ax, "ppl_vs_fraction.png", "Perplexity vs datastore size (random fractions)", "datastore entries")

    ar = summary["adaptive_retrieval"]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(
        [c["report_skipped"] for c in ar["curve"]],
        [c["report_ppl"] for c in ar["curve"]],
        marker="o",
        ms=3,
        label="adaptive retrieval: skip where p_LM(top) > t",
    )
    ax.plot([ar["skipped"]], [ar["ppl"]], "r*", ms=12, label=f"fitted t = {ar['threshold']:.3g}")
    if summary["pointers"]:
        curve = summary["pointers"]["curve"]
        ax.plot(
            [c["report_saved"] for c in curve],
            [c["report_ppl"] for c in curve],
            marker="s",
            ms=3,
            label=f"pointer following (min pointers {curve[0]['min_pointers']}…{curve[-1]['min_pointers']})",
        )
    save(fig, ax, "ppl_vs_searches_saved.png", "Perplexity vs share of searches saved", "share of searches saved")

    fig, ax = plt.subplots(figsize=(10, 0.45 * len(variants) + 1.5))
    bars = ax.barh([v["label"] for v in variants], [v["best"]["report_ppl"] for v in variants])
    ax.bar_label(bars, fmt="%.2f", fontsize=8)
    ax.invert_yaxis()
    ax.axvline(base, color="grey", ls="--", label="base LM")
    ax.set(title="Tuned kNN-LM per datastore, index, key type, size", xlabel="report perplexity")
    ax.set_xlim(min(v["best"]["report_ppl"] for v in variants) * 0.97, base * 1.02)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "variants.png", dpi=110)
    plt.close(fig)
    files.append(out_dir / "variants.png")
    return files
