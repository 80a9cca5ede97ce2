"""Search time per decode step against datastore size, for each search backend.

One timed call is one step's batch of queries against one shard: FAISS flat (IndexFlatL2), the
torch exact search (`knnlm_core.search.torch_search`, which flat shards use where it is faster),
IVF-Flat, IVF-PQ (the builder's `ivfpq` preset at nprobe 32, trained on a sample with the builder's
`train_index`) and HNSW32 (efSearch = k, its minimum for k results; built only up to HNSW_MAX
entries, as its construction takes minutes per 100k keys on 2 cores).
Keys are the synthetic clustered 576-d vectors of `retrieval_latency.py` (same generator), queries
a held-out stream of the same clusters. Recall is |returned ∩ exact top-k| / k. FAISS and torch
run with the same thread count (`--threads`); the two exact searches are timed again with
`--flat-threads` (default 1), as which of them is faster for a single query depends on it. The
backends take turns within each repeat and the machine's load average is recorded: other work on
a shared machine slows multi-threaded searches most, so compare within a run, and prefer min_ms.

    .venv/bin/python benchmarks/search_backends.py                 # ~10 min on 2 cores
    .venv/bin/python benchmarks/search_backends.py --sizes 10000 100000 1000000   # 1M: + ~10 min

Writes benchmarks/results/search_backends.json and .png, and prints a Markdown table. The
builder's `--index auto` and the serving path's choice for exact shards cite these numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import faiss  # noqa: E402
import torch  # noqa: E402
from retrieval_latency import DIM, KEYS_STREAM, QUERY_STREAM, ClusteredVectors  # noqa: E402
from tqdm import tqdm  # noqa: E402

from index_builder.faiss_index import DEFAULT_NPROBE, index_factory_string, train_index  # noqa: E402
from knnlm_core.search import flat_keys, torch_search  # noqa: E402

RESULTS = ROOT / "benchmarks/results/search_backends.json"
HNSW_MAX = 100_000  # HNSW32 construction on 2 cores takes minutes per 100k; larger sizes skip it
TRAIN_MAX = 65_536


def timed(calls: dict, repeats: int) -> dict:
    """name -> {p50_ms, min_ms, max_ms} of each call; the calls take turns within every repeat, so a
    burst of load from elsewhere on the machine hits all backends alike."""
    times = {name: [] for name in calls}
    for fn in calls.values():
        fn()  # warm-up
    for _ in range(repeats):
        for name, fn in calls.items():
            start = time.perf_counter()
            fn()
            times[name].append(1e3 * (time.perf_counter() - start))
    return {
        name: {"p50_ms": round(float(np.median(t)), 3), "min_ms": round(min(t), 3), "max_ms": round(max(t), 3)} for name, t in times.items()
    }


def backends(keys: np.ndarray) -> dict:
    """name -> (search(queries, k) -> ids, build seconds, factory)."""
    out = {}
    flat = faiss.IndexFlatL2(DIM)
    flat.add(keys)
    exact = flat_keys(flat, on_gpu=False)
    out["faiss flat"] = (lambda q, k: flat.search(q, k)[1], 0.0, "Flat")
    out["torch flat"] = (lambda q, k: torch_search(exact, q, k)[1], 0.0, "Flat")
    sample = keys[np.random.default_rng(0).choice(len(keys), min(len(keys), TRAIN_MAX), replace=False)]
    ivfpq = index_factory_string("ivfpq", len(keys), DIM)
    for name, factory in (("IVF-Flat", ivfpq.split(",")[0] + ",Flat"), ("IVF-PQ", ivfpq)):
        start = time.perf_counter()
        index, _ = train_index(factory, sample)
        index.add(keys)
        params = faiss.SearchParametersIVF(nprobe=DEFAULT_NPROBE)
        out[f"{name} (nprobe {DEFAULT_NPROBE})"] = (
            lambda q, k, index=index, params=params: index.search(q, k, params=params)[1],
            time.perf_counter() - start,
            factory,
        )
    if len(keys) <= HNSW_MAX:
        start = time.perf_counter()
        hnsw = faiss.IndexHNSWFlat(DIM, 32)
        hnsw.add(keys)
        out["HNSW32"] = (
            lambda q, k: hnsw.search(q, k, params=faiss.SearchParametersHNSW(efSearch=k))[1],
            time.perf_counter() - start,
            "HNSW32",
        )
    return out


def set_threads(threads: int) -> None:
    faiss.omp_set_num_threads(threads)
    torch.set_num_threads(threads)


def measure(found: dict, size: int, queries: np.ndarray, args: argparse.Namespace, threads: int) -> list[dict]:
    """One row per (backend, k, batch): times and recall@k against the exact answer."""
    rows = []
    for k in args.ks:
        exact = found["torch flat"][0](queries, k)
        recall = {
            name: float(np.mean([len(np.intersect1d(a, b)) / k for a, b in zip(search(queries, k), exact)]))
            for name, (search, *_) in found.items()
        }
        for batch in args.batches:
            q = np.ascontiguousarray(queries[:batch])
            times = timed({name: lambda search=search: search(q, k) for name, (search, *_) in found.items()}, args.repeats)
            rows += [
                {"backend": name, "factory": factory, "entries": size, "k": k, "batch": batch, "threads": threads}
                | {"recall": round(recall[name], 4), "build_s": round(build_s, 1)}
                | times[name]
                for name, (_, build_s, factory) in found.items()
            ]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[3_000, 10_000, 30_000, 100_000, 300_000])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--ks", type=int, nargs="+", default=[64, 1024])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--flat-threads", type=int, nargs="*", default=[1], help="also time the two exact searches with these threads")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    set_threads(args.threads)
    load_before = os.getloadavg()
    generator = ClusteredVectors(seed=0)
    queries = generator.draw(max(args.batches), QUERY_STREAM, 0)
    rows = []
    for size in tqdm(args.sizes, desc="sizes"):
        keys = np.concatenate([generator.draw(min(65_536, size - s), KEYS_STREAM, c) for c, s in enumerate(range(0, size, 65_536))])
        found = backends(keys)
        rows += measure(found, size, queries, args, args.threads)
        for threads in args.flat_threads:  # the choice between the two exact searches depends on threads
            set_threads(threads)
            rows += measure({name: found[name] for name in ("faiss flat", "torch flat")}, size, queries, args, threads)
        set_threads(args.threads)
        del found
    report = {
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "cpus": os.cpu_count(),
            "threads": args.threads,
            "platform": platform.platform(),
            "faiss": faiss.__version__,
            "torch": torch.__version__,
            "load_average_1_5_15_min": {"start": [round(x, 2) for x in load_before], "end": [round(x, 2) for x in os.getloadavg()]},
        },
        "dim": DIM,
        "hnsw_max_entries": HNSW_MAX,
        "flat_crossover": flat_crossover(rows),
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    plot(rows, args.out.with_suffix(".png"), max(args.ks), args.threads)
    main_rows = [r for r in rows if r["threads"] == args.threads]
    print(
        f"\n{args.threads} threads, p50 ms\n\n| backend | entries | recall@{max(args.ks)} | "
        + " | ".join(f"batch {b}" for b in args.batches)
        + " |"
    )
    print("|---|---:|---:|" + "---:|" * len(args.batches))
    for name in dict.fromkeys(r["backend"] for r in main_rows):
        for size in args.sizes:
            cells = [r for r in main_rows if r["backend"] == name and r["entries"] == size and r["k"] == max(args.ks)]
            if cells:
                print(f"| {name} | {size:,} | {cells[0]['recall']:.3f} | " + " | ".join(f"{r['p50_ms']:.1f}" for r in cells) + " |")
    print(
        "\nFAISS flat / torch flat, p50 (min) (> 1: torch faster)\n\n| threads | k | batch | "
        + " | ".join(f"{s:,}" for s in args.sizes)
        + " |"
    )
    print("|---:|---:|---:|" + "---:|" * len(args.sizes))
    for threads, k, batch in dict.fromkeys((c["threads"], c["k"], c["batch"]) for c in report["flat_crossover"]):
        cells = [c for c in report["flat_crossover"] if (c["threads"], c["k"], c["batch"]) == (threads, k, batch)]
        print(f"| {threads} | {k} | {batch} | " + " | ".join(f"{c['p50_ratio']:.2f} ({c['min_ratio']:.2f})" for c in cells) + " |")


def flat_crossover(rows: list[dict]) -> list[dict]:
    """Per (threads, k, batch, entries): FAISS flat's time over torch's (p50 and min; the min is what
    load from elsewhere on the machine distorts least), what the choice between them rests on."""
    flat = {(r["backend"], r["threads"], r["k"], r["batch"], r["entries"]): r for r in rows if r["backend"] in ("faiss flat", "torch flat")}
    return [
        {"threads": threads, "k": k, "batch": batch, "entries": size}
        | {
            f"{stat}_ratio": round(r[f"{stat}_ms"] / flat["torch flat", threads, k, batch, size][f"{stat}_ms"], 3)
            for stat in ("p50", "min")
        }
        for (name, threads, k, batch, size), r in sorted(flat.items(), key=lambda item: item[0][1:])
        if name == "faiss flat"
    ]


def plot(rows: list[dict], out: Path, k: int, threads: int) -> None:
    """Time against size per backend, a panel per batch size; exact searches at other thread counts dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r["batch"] for r in rows})
    cols = min(3, len(batches))
    fig, axes = plt.subplots(
        -(-len(batches) // cols), cols, figsize=(4.5 * cols, 3.8 * -(-len(batches) // cols)), sharey=True, squeeze=False
    )
    for ax in axes.flat[len(batches) :]:
        ax.set_visible(False)
    for ax, batch in zip(axes.flat, batches):
        for name, t in dict.fromkeys((r["backend"], r["threads"]) for r in rows):
            cells = [r for r in rows if (r["backend"], r["threads"], r["batch"], r["k"]) == (name, t, batch, k)]
            label, style = (name, "-") if t == threads else (f"{name}, {t} thread{'s' * (t > 1)}", "--")
            ax.plot([r["entries"] for r in cells], [r["p50_ms"] for r in cells], style, marker="o", ms=3, label=label)
        ax.set(xscale="log", yscale="log", title=f"batch {batch}, k = {k}", xlabel="entries in the shard")
    for ax in axes[:, 0]:
        ax.set_ylabel(f"search time per step, p50 ms ({threads} threads)")
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
