"""Forgetting by tombstone against erasing, and what tombstones cost a search: the measurements
behind `knnlm-index forget`'s design, its `--erase`, and `compact`'s threshold.

    .venv/bin/python benchmarks/tombstones.py          # ~15 min on 2 CPU cores, ~8 GB of /tmp
    .venv/bin/python benchmarks/tombstones.py --no-search --out benchmarks/results/forget_erase.json

Two synthetic stores of `--entries` keys (Gaussian, 576-d, SmolLM2's width) in 4 shards, one
exact (flat) and one 4-bit fast-scan IVF-PQ (the `auto` index at this size), with documents of
1,000 entries. For each, in one run:
  * forget one document (`forget_documents`: values rewritten, manifest, atomic swap) and load
    the new version as a server does (`DatastoreRegistry.load`: checks, hashing the files it has
    not hashed, opening the shards in-process, a probe); then forget another with `erase=True`
    (its entries also leave the shard's index file, which is written again) and load that;
  * unless --no-search, one shard's search at batch 32, k 1024 (nprobe 32), with 0, 1, 5, 10, 30
    and 50% of its entries tombstoned, as a ratio to the same search without a mask (medians of
    interleaved repeats).
Writes benchmarks/results/tombstones.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from run_record import run_record  # noqa: E402

from index_builder.build import build_from_keys  # noqa: E402
from index_builder.corpus_keys import document_starts  # noqa: E402
from index_builder.forget import forget_documents  # noqa: E402
from knnlm_core.config import BuildConfig, KnnConfig  # noqa: E402
from knnlm_core.datastore import file_entry, read_manifest, write_manifest  # noqa: E402
from knnlm_core.manifest import ModelIdentity  # noqa: E402
from knnlm_core.provenance import PROVENANCE, DocumentTable  # noqa: E402
from knnlm_core.search import open_shards  # noqa: E402
from knnlm_serve.runtime import ServedModel  # noqa: E402
from knnlm_serve.server.registry import DatastoreRegistry  # noqa: E402

DIM, DOCUMENT = 576, 1000
SERVED = ServedModel(Path("synthetic"), "LlamaForCausalLM", "-", DIM, True)  # what serves the synthetic stores
SHARES = (0.01, 0.05, 0.1, 0.3, 0.5)


def with_documents(root: Path, entries: int) -> None:
    """Give a store built from keys a document table: documents of DOCUMENT entries each."""
    documents = entries // DOCUMENT
    offsets = np.arange(documents + 1, dtype=np.int64) * (DOCUMENT + 1)
    np.save(root / "documents.npy", document_starts(offsets))
    origins = [(f"/synthetic/doc-{d:05d}.txt", None, None, f"{d:064x}") for d in range(documents)]
    DocumentTable.of(origins, [0] * documents).write(root / PROVENANCE)
    manifest = read_manifest(root)
    write_manifest(
        root,
        manifest.model_copy(
            update={"documents": file_entry(root, root / "documents.npy"), "provenance": file_entry(root, root / PROVENANCE)}
        ),
    )


def synthetic_stores(work: Path, entries: int):
    """Build each store in `work` in turn, from the same Gaussian keys (4 shards, documents of
    DOCUMENT entries); yield (name, index factory, directory) once it is built."""
    work.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    keys = np.lib.format.open_memmap(work / "keys.npy", mode="w+", dtype=np.float16, shape=(entries, DIM))
    for start in range(0, entries, 100_000):
        keys[start : start + 100_000] = rng.standard_normal((min(100_000, entries - start), DIM))
    values = rng.integers(0, 49_152, entries).astype(np.int32)
    model = ModelIdentity(name="synthetic", fingerprint="-", hidden_size=DIM, vocab_size=49_152, dtype="float32")
    for name, factory in (("flat", "Flat"), ("fast_scan", "IVF1024,PQ144x4fs")):
        root = work / name
        config = BuildConfig(index=factory, shards=4, train_sample=65_536)
        build_from_keys(keys, values, root, model, config, source="synthetic", overwrite=True, progress=False)
        with_documents(root, entries)
        yield name, factory, root


def timed(fn, *args, **kwargs) -> float:
    started = time.monotonic()
    fn(*args, **kwargs)
    return round(time.monotonic() - started, 3)


def search_costs(root: Path, repeats: int) -> dict:
    (searcher,) = open_shards(root, read_manifest(root), use_gpu=False, names={"shard-000"})
    rng = np.random.default_rng(1)
    queries = rng.standard_normal((32, DIM)).astype(np.float32)
    masks = {0.0: None}
    for share in SHARES:
        keep = np.ones(searcher.ntotal, dtype=bool)
        keep[rng.choice(searcher.ntotal, int(share * searcher.ntotal), replace=False)] = False
        masks[share] = keep
    times = {share: [] for share in masks}
    for _ in range(2):  # warm-up
        searcher.search(queries, 1024, 32)
    for _ in range(repeats):
        for share, keep in masks.items():
            searcher.keep = keep
            started = time.perf_counter()
            searcher.search(queries, 1024, 32)
            times[share].append(time.perf_counter() - started)
    base = np.median(times[0.0])
    return {
        "shard_entries": searcher.ntotal,
        "unmasked_ms": round(1000 * base, 2),
        "ratio_to_unmasked": {f"{share:g}": round(float(np.median(t) / base), 3) for share, t in times.items() if share},
        "spread": {
            f"{share:g}": [round(float(np.min(t) / base), 3), round(float(np.max(t) / base), 3)] for share, t in times.items() if share
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entries", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--no-search", action="store_true", help="time the forgets only, not tombstones' search cost")
    parser.add_argument("--work", type=Path, default=Path("/tmp/knnlm-tombstones"))
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/tombstones.json")
    args = parser.parse_args()
    record = run_record("tombstones")  # the commit whose code runs, whatever is committed meanwhile

    report = {
        **record,
        "entries": args.entries,
        "stores": {},
    }
    for name, factory, root in synthetic_stores(args.work, args.entries):
        document = args.entries // DOCUMENT // 10  # in shard-000 (the first quarter)
        registry = DatastoreRegistry(KnnConfig(backend="local"), SERVED, None)
        first_load = timed(registry.load, name, root)
        forget = timed(forget_documents, root, documents=[document])
        reload = timed(registry.load, name, root)
        erase = timed(forget_documents, root, documents=[document + 1], erase=True)
        erase_reload = timed(registry.load, name, root)
        report["stores"][name] = {
            "index": factory,
            "forget_tombstone_s": forget,
            "forget_erase_s": erase,
            "load_s": {"first": first_load, "after_forget": reload, "after_erase": erase_reload},
            "forget_to_serving_s": round(forget + reload, 3),
            "erase_to_serving_s": round(erase + erase_reload, 3),
            **({} if args.no_search else {"search_with_tombstones": search_costs(root, args.repeats)}),
        }
        print(name, json.dumps(report["stores"][name]), flush=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
