"""Search time per decode step against datastore size, for each search backend.

One timed call is one step's batch of queries against one shard: FAISS flat (IndexFlatL2), the
torch exact search flat shards are served with (`knnlm_core.search.ExactKeys`), IVF-Flat, IVF-PQ
(the builder's `ivfpq` preset at nprobe 32) and HNSW32 (efSearch = k, its minimum for k results).
Keys are the synthetic clustered 576-d vectors of `retrieval_latency.py` (same generator), queries
a held-out stream of the same clusters. Recall is |returned ∩ exact top-k| / k.

    .venv/bin/python benchmarks/search_backends.py                 # ~10 min on 2 cores
    .venv/bin/python benchmarks/search_backends.py --sizes 10000 100000 1000000

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
from knnlm_core.search import ExactKeys  # noqa: E402

RESULTS = ROOT / "benchmarks/results/search_backends.json"
HNSW_MAX = 100_000  # HNSW32 construction on 2 cores takes minutes per 100k; larger sizes skip it
TRAIN_MAX = 65_536


def timed(fn, repeats: int) -> dict:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - start))
    return {"p50_ms": round(float(np.median(times)), 3), "min_ms": round(min(times), 3), "max_ms": round(max(times), 3)}


def backends(keys: np.ndarray, k_max: int) -> dict:
    """name -> (search(queries, k) -> ids, build seconds, factory)."""
    out = {}
    flat = faiss.IndexFlatL2(DIM)
    flat.add(keys)
    exact = ExactKeys.of(flat)
    out["faiss flat"] = (lambda q, k: flat.search(q, k)[1], 0.0, "Flat")
    out["torch flat"] = (lambda q, k: exact.search(q, k)[1], 0.0, "Flat")
    sample = keys[np.random.default_rng(0).choice(len(keys), min(len(keys), TRAIN_MAX), replace=False)]
    ivfpq = index_factory_string("ivfpq", len(keys), DIM)
    for name, factory in (("IVF-Flat", ivfpq.split(",")[0] + ",Flat"), ("IVF-PQ", ivfpq)):
        start = time.perf_counter()
        index = train_index(factory, sample)
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
        params = faiss.SearchParametersHNSW(efSearch=k_max)
        out["HNSW32"] = (lambda q, k: hnsw.search(q, k, params=params)[1], time.perf_counter() - start, "HNSW32")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 30_000, 100_000, 300_000])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--ks", type=int, nargs="+", default=[64, 1024])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    faiss.omp_set_num_threads(args.threads)
    torch.set_num_threads(args.threads)
    generator = ClusteredVectors(seed=0)
    queries = generator.draw(max(args.batches), QUERY_STREAM, 0)
    rows = []
    for size in tqdm(args.sizes, desc="sizes"):
        keys = np.concatenate([generator.draw(min(65_536, size - s), KEYS_STREAM, c) for c, s in enumerate(range(0, size, 65_536))])
        found = backends(keys, max(args.ks))
        exact = {k: found["torch flat"][0](queries, k) for k in args.ks}
        for name, (search, build_s, factory) in found.items():
            for k in args.ks:
                ids = search(queries, k)
                recall = float(np.mean([len(np.intersect1d(a, b)) / k for a, b in zip(ids, exact[k])]))
                for batch in args.batches:
                    q = np.ascontiguousarray(queries[:batch])
                    rows.append(
                        {"backend": name, "factory": factory, "entries": size, "k": k, "batch": batch}
                        | {"recall": round(recall, 4), "build_s": round(build_s, 1)}
                        | timed(lambda q=q, k=k, search=search: search(q, k), args.repeats)
                    )
        del found
    report = {
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "threads": args.threads, "platform": platform.platform(), "faiss": faiss.__version__},
        "dim": DIM,
        "hnsw_max_entries": HNSW_MAX,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    plot(rows, args.out.with_suffix(".png"), max(args.ks))
    print(f"\n| backend | entries | recall@{max(args.ks)} | " + " | ".join(f"batch {b} ms" for b in args.batches) + " |")
    print("|---|---:|---:|" + "---:|" * len(args.batches))
    for name in dict.fromkeys(r["backend"] for r in rows):
        for size in args.sizes:
            cells = [r for r in rows if r["backend"] == name and r["entries"] == size and r["k"] == max(args.ks)]
            if cells:
                times = " | ".join(f"{r['p50_ms']:.1f}" for r in cells)
                print(f"| {name} | {size:,} | {cells[0]['recall']:.3f} | {times} |")


def plot(rows: list[dict], out: Path, k: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 4), sharey=True)
    for ax, batch in zip(np.atleast_1d(axes), batches):
        for name in dict.fromkeys(r["backend"] for r in rows):
            cells = [r for r in rows if r["backend"] == name and r["batch"] == batch and r["k"] == k]
            ax.plot([r["entries"] for r in cells], [r["p50_ms"] for r in cells], marker="o", ms=3, label=name)
        ax.set(xscale="log", yscale="log", title=f"batch {batch}, k = {k}", xlabel="entries in the shard")
    np.atleast_1d(axes)[0].set_ylabel("search time per step, p50 ms")
    np.atleast_1d(axes)[-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
