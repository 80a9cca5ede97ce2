"""Scale: a synthetic IVF-PQ datastore of `--entries` keys in `--shards` shards (the issue's: 10M in 4).

The keys are the retrieval benchmark's (576-d clustered, `retrieval_latency.ClusteredVectors`),
built by the index builder itself and cached under `--workdir`. Measured, into one JSON:
  * build: key generation, training and adding, as `build_from_keys` does it;
  * per shard: load time and private memory (USS) of a fresh process opening it, read into
    memory against memory-mapped (`knn.mmap`), then after one batch-32 search;
  * swap: starting a new version's shard actors and answering a probe (what a hot-swap waits for);
  * per step at batch 32 (k 1024, nprobe 32): Ray shard actors on this node, with 1 and 2 replicas,
    and on a second node of a Ray test cluster (two raylets on this machine: same cores, so this
    shows the transport and placement, not more compute).

    .venv/bin/python benchmarks/scale.py --entries 10000000 --shards 4 --factory IVF16384_HNSW32,PQ64np
    .venv/bin/python benchmarks/scale.py --entries 2000000 --shards 4
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from retrieval_latency import QUERY_STREAM, ROOT, ClusteredVectors, ensure_datastores, log, machine_info, stats_ms, timed  # noqa: E402

from knnlm_core.config import BuildConfig, KnnConfig  # noqa: E402
from knnlm_core.datastore import read_manifest  # noqa: E402
from knnlm_core.files import write_json_atomic  # noqa: E402
from knnlm_serve.runtime import DatastoreInfo  # noqa: E402

RESULTS = ROOT / "benchmarks/results/scale.json"
BATCH, K, NPROBE = 32, 1024, 32

LOAD_ONE_SHARD = """
import json, sys, time, numpy as np, psutil
from pathlib import Path
from knnlm_core.datastore import read_manifest
from knnlm_core.search import ShardSearcher, shard_first_ids
root, number, mmap = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "mmap"
manifest = read_manifest(root)
shard, first = list(zip(manifest.shards, shard_first_ids(manifest)))[number]
process = psutil.Process()
before = process.memory_full_info().uss
t0 = time.perf_counter()
searcher = ShardSearcher(root, shard, first, use_gpu=False, mmap=mmap)
load_s = time.perf_counter() - t0
loaded = process.memory_full_info().uss
searcher.search(np.random.default_rng(0).normal(size=(32, searcher.dim)).astype(np.float32), 1024, 32)
print(json.dumps({"load_s": load_s, "uss_mib": (loaded - before) / 2**20,
                  "uss_after_search_mib": (process.memory_full_info().uss - before) / 2**20}))
"""


def shard_loads(root: Path, shards: int) -> list[dict]:
    rows = []
    for number in range(shards):
        for mode in ("read", "mmap"):
            out = subprocess.run(
                [sys.executable, "-c", LOAD_ONE_SHARD, str(root), str(number), mode], capture_output=True, text=True, check=True
            )
            rows.append({"shard": number, "mode": mode, **{k: round(v, 3) for k, v in json.loads(out.stdout.splitlines()[-1]).items()}})
            log(f"shard {number} {mode}: {rows[-1]}")
    return rows


def knn_config(**settings) -> KnnConfig:
    return KnnConfig(backend="ray", ray_namespace="knnlm-scale", gpu=False, shard_timeout_s=30.0, **settings)


def per_step(info: DatastoreInfo, knn: KnnConfig, queries: ClusteredVectors, repeats: int) -> dict:
    """Start the version's actors (timed: a swap's wait), then time batch-32 steps through RayRetriever."""
    import ray

    from knnlm_serve.retrieval import RayRetriever, start_shard_actors

    t0 = time.perf_counter()
    actors = start_shard_actors(info, knn)
    retriever = RayRetriever(knn, None)
    retriever.search(info, queries.draw(1, QUERY_STREAM, 0), 1, NPROBE)  # the probe
    start_s = time.perf_counter() - t0
    chunks = iter(range(1, 10**6))
    samples = timed(lambda q: retriever.search(info, q, K, NPROBE), lambda: (queries.draw(BATCH, QUERY_STREAM, next(chunks)),), 3, repeats)
    nodes = sorted({ray.get(a.describe.remote())["node"][:8] for replicas in actors for a in replicas})
    retriever.release(set())
    for replicas in actors:
        for actor in replicas:
            ray.kill(actor)
    return {"start_and_probe_s": round(start_s, 2), "nodes": nodes, **stats_ms(samples, BATCH)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--entries", type=int, default=10_000_000)
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--repeats", type=int, default=20, help="timed steps per layout")
    p.add_argument("--train-sample", type=int, default=BuildConfig().train_sample, help="keys to train on (the builder's default)")
    p.add_argument("--factory", help="FAISS factory string (default: the builder's ivfpq preset for --entries)")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/knnlm-bench"))
    p.add_argument("--output", type=Path, default=RESULTS)
    args = p.parse_args(argv)

    import ray
    from ray.cluster_utils import Cluster

    record = ensure_datastores(
        args.workdir, args.entries, args.train_sample, 0, False, args.factory, build_threads=2, shard_counts=(args.shards,)
    )
    root = args.workdir / f"synthetic-{args.entries}" / f"shards-{args.shards}"
    manifest = read_manifest(root)
    info = DatastoreInfo.of("scale", root, manifest)
    report = {
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "entries": args.entries,
        "shards": args.shards,
        "index": manifest.index.factory,
        "bytes": {"total": info.bytes, "per_entry": round(info.bytes / args.entries, 1)},
        "build": record,
        "shard_load": shard_loads(root, args.shards),
    }
    queries = ClusteredVectors(0)
    steps = {}
    ray.init(namespace="knnlm-scale", include_dashboard=False, log_to_driver=False)
    for replicas in (1, 2):
        steps[f"one node, {replicas} replica(s)"] = per_step(info, knn_config(replicas=replicas), queries, args.repeats)
        log(f"one node, {replicas} replica(s): {steps[f'one node, {replicas} replica(s)']}")
    ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False, "resources": {"knn_any": 1}})
    cluster.add_node(num_cpus=1, resources={"knn_shards": 1, "knn_any": 1})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace="knnlm-scale", log_to_driver=False)
    try:
        for name, settings in (
            ("shards on a second node", {"shard_resources": {"knn_shards": 0.01}}),
            ("a replica on each node", {"shard_resources": {"knn_any": 0.01}, "replicas": 2}),
        ):
            steps[name] = per_step(info, knn_config(**settings), queries, args.repeats)
            log(f"{name}: {steps[name]}")
    finally:
        ray.shutdown()
        cluster.shutdown()
    report["per_step_batch32"] = steps
    write_json_atomic(args.output, report)
    log(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
