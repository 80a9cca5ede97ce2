"""IVF-PQ codes for kNN-LM: the `ivfpq` preset's 8-bit PQ against FAISS's 4-bit fast-scan PQ.

Fast-scan PQ keeps 4-bit codes and scans an IVF list with SIMD lookups, several times faster than
8-bit PQ; but its codes are coarser (16 centroids per sub-quantizer), encode the keys rather than
their residuals from the list centroid (FAISS's factory default for fast-scan), and its distances
come from lookup tables rounded to 8 bits. kNN-LM turns distances into a softmax, so what decides is
perplexity, not recall. This encodes WikiText-2 valid (the datastore) and test (the queries, with
the LM's log-probs) once through the builder's key path, builds each index over the same keys with
the builder's training, and reports per index:

  * a decode step's search (batch 32, one thread as a shard actor on this host has, the serving
    path `search_index`, torch coarse step included) at `--k` and `--nprobe`, p50 of 30 batches;
  * recall of the exact top-k, and the absolute error of the squared L2 distances it returns
    for its 32 nearest against those entries' exact distances: the softmax sees d / τ, so an
    error of τ changes a neighbour's weight e-fold;
  * the kNN-LM perplexity on the test text at its best (τ, λ), tuned on 20% of the tokens and
    reported on the rest (calibration's sweep), beside exact search's and the LM's own.

    .venv/bin/python benchmarks/pq_codes.py            # ~12 min on 2 cores (encoding ~5 of it)

Writes benchmarks/results/pq_codes.json and .png and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import faiss  # noqa: E402
import torch  # noqa: E402
from wikitext import WIKITEXT, prepare_corpus  # noqa: E402

from index_builder.faiss_index import index_factory_string, train_index  # noqa: E402
from knnlm_core.calibration import fitting_half, perplexity, sweep  # noqa: E402
from knnlm_core.config import BuildConfig, SweepGrid  # noqa: E402
from knnlm_core.corpus import tokenize_files  # noqa: E402
from knnlm_core.default_model import prepare_default_model  # noqa: E402
from knnlm_core.keys import KeyEncoder, encode_windows  # noqa: E402
from knnlm_core.search import flat_keys, ivf_centroids, search_index, search_many  # noqa: E402
from knnlm_core.windows import plan_windows, window_values  # noqa: E402

RESULTS = ROOT / "benchmarks/results/pq_codes.json"
NEAREST = 32  # the returned neighbours whose distance error is measured
logger = logging.getLogger("pq_codes")


def encode(path: Path, model_dir: Path, scored: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(keys [N, d], next tokens [N], log p_LM of them or None) of a text, windowed as the builder does."""
    config = BuildConfig()
    tokens, offsets = tokenize_files([path], model_dir)
    plan = plan_windows(offsets, config.context_length, config.stride)
    encoder = KeyEncoder(model_dir, config.key_type, config.dtype)
    keys = np.empty((plan.entries, encoder.dim), dtype=np.float32)
    log_p = np.empty(plan.entries, dtype=np.float64) if scored else None
    encode_windows(encoder, tokens, plan, keys, config.batch_size, log_p_out=log_p, desc=path.name)
    return keys, window_values(tokens, plan), log_p


def step_ms(index, values: np.ndarray, queries: np.ndarray, k: int, nprobe: int | None, batches: int = 30) -> float:
    """p50 ms of one decode step's search on one thread, as a shard actor here runs it."""
    threads = faiss.omp_get_max_threads(), torch.get_num_threads()
    faiss.omp_set_num_threads(1)
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    exact, coarse = flat_keys(index, False), ivf_centroids(index)
    times = []
    for b in range(batches + 3):
        batch = queries[rng.choice(len(queries), 32, replace=False)]
        start = time.perf_counter()
        search_index(index, values, batch, k, nprobe, exact=exact, centroids=coarse)
        if b >= 3:  # warm-up
            times.append(time.perf_counter() - start)
    faiss.omp_set_num_threads(threads[0])
    torch.set_num_threads(threads[1])
    return 1e3 * float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--valid-chars", type=int, default=420_000, help="datastore text: the first this many of valid (~100k entries)")
    parser.add_argument("--test-chars", type=int, default=100_000, help="query text: the first this many of test")
    parser.add_argument("--k", type=int, default=512)
    parser.add_argument("--nprobe", type=int, default=16)
    parser.add_argument(
        "--codes", nargs="+", default=["PQ64np", "PQ64x4fs", "PQ96x4fs", "PQ144x4fs"], help="PQ parts of the factory string compared"
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="[pq_codes %(asctime)s] %(message)s", datefmt="%H:%M:%S")
    started = time.monotonic()
    model_dir = prepare_default_model()
    with tempfile.TemporaryDirectory() as work:
        valid = prepare_corpus(WIKITEXT / "valid.txt", args.valid_chars, Path(work))
        test = prepare_corpus(WIKITEXT / "test.txt", args.test_chars, Path(work))
        keys, values, _ = encode(valid, model_dir, scored=False)
        queries, targets, log_p_lm = encode(test, model_dir, scored=True)
    values = values.astype(np.int32)
    tune = fitting_half(len(queries))
    grid = SweepGrid(ks=(args.k,))
    ivf_part = index_factory_string("ivfpq", len(keys), keys.shape[1]).split(",")[0]  # the preset's IVF{nlist}
    logger.info("%d keys, %d queries; %s with %s", len(keys), len(queries), ivf_part, ", ".join(args.codes))

    flat = faiss.IndexFlatL2(keys.shape[1])
    flat.add(keys)
    exact_d, exact_tokens, exact_ids = search_many([(flat, values, None, 0)], queries, args.k, progress=True, desc="exact")
    exact_nearest = float(np.median(exact_d[:, 0]))
    exact_ppl = sweep(log_p_lm, exact_d, exact_tokens == targets[:, None], tune, grid)["best"]
    rows = [
        {
            "index": "Flat (exact)",
            "bytes_per_entry": 4 * keys.shape[1],
            "step_ms": step_ms(flat, values, queries, args.k, None),
            "recall": 1.0,
            "distance_error_p50": 0.0,
            "distance_error_p90": 0.0,
            **{f"knn_{key}": exact_ppl[key] for key in ("report_ppl", "temperature", "lambda")},
        }
    ]
    for code in args.codes:
        factory = f"{ivf_part},{code}"
        t0 = time.monotonic()
        index, _ = train_index(
            factory, keys[np.random.default_rng(0).choice(len(keys), min(len(keys), BuildConfig().train_sample), replace=False)]
        )
        index.add(keys)
        build_s = time.monotonic() - t0
        d, tokens, ids = search_many([(index, values, None, 0)], queries, args.k, args.nprobe, progress=True, desc=factory)
        near = ids[:, :NEAREST]
        true_d = np.sum((keys[np.maximum(near, 0)] - queries[:, None, :]) ** 2, axis=2)
        error = np.abs(d[:, :NEAREST] - true_d)[near >= 0]
        recall = np.mean([len(np.intersect1d(a[a >= 0], b)) / args.k for a, b in zip(ids, exact_ids)])
        best = sweep(log_p_lm, d, tokens == targets[:, None], tune, grid)["best"]
        rows.append(
            {
                "index": factory,
                "bytes_per_entry": index.code_size,
                "build_s": round(build_s, 1),
                "step_ms": step_ms(index, values, queries, args.k, args.nprobe),
                "recall": float(recall),
                "distance_error_p50": float(np.median(error)),
                "distance_error_p90": float(np.percentile(error, 90)),
                **{f"knn_{key}": best[key] for key in ("report_ppl", "temperature", "lambda")},
            }
        )
        logger.info("%s", rows[-1])
    base_ppl = perplexity(log_p_lm[~tune])
    report = {
        "benchmark": "pq_codes",
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": "python " + " ".join(sys.argv),
        "machine": {"cpu_count": len(os.sched_getaffinity(0)), "platform": platform.platform(), "faiss": faiss.__version__},
        "settings": {
            "datastore": f"WikiText-2 valid, first {args.valid_chars:,} chars: {len(keys):,} entries",
            "queries": f"WikiText-2 test, first {args.test_chars:,} chars: {len(queries):,} tokens (tune 20%, report the rest)",
            "k": args.k,
            "nprobe": args.nprobe,
            "step": "batch 32, 1 thread, search_index (the serving path), p50 of 30",
            "distance_error": f"|returned - exact| squared L2 distance of the same entry, over each query's {NEAREST} nearest returned",
            "exact_nearest_distance_p50": exact_nearest,
        },
        "base_ppl": base_ppl,
        "rows": rows,
        "seconds": round(time.monotonic() - started, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    plot(report, args.out.with_suffix(".png"))
    print(f"\nLM alone: ppl {base_ppl:.3f} on the reported part; exact nearest distance p50 {exact_nearest:.2f}\n")
    print("| index | bytes/entry | step ms | recall@k | distance error p50 / p90 | kNN-LM ppl (τ, λ) |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['index']} | {r['bytes_per_entry']} | {r['step_ms']:.1f} | {r['recall']:.3f} | "
            f"{r['distance_error_p50']:.2f} / {r['distance_error_p90']:.2f} | "
            f"{r['knn_report_ppl']:.3f} ({r['knn_temperature']:g}, {r['knn_lambda']:g}) |"
        )


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for r in report["rows"]:
        ax.scatter(r["step_ms"], r["knn_report_ppl"], s=50, label=f"{r['index']}, {r['bytes_per_entry']} B/entry")
    ax.set_xscale("log")
    s = report["settings"]
    ax.set_xlabel(f"search per decode step, ms, log scale (batch 32, 1 thread, k {s['k']}, nprobe {s['nprobe']})")
    ax.set_ylabel("kNN-LM perplexity, WikiText-2 test")
    ax.set_title(f"8-bit PQ vs 4-bit fast-scan PQ over the same keys (LM alone: {report['base_ppl']:.2f})", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
