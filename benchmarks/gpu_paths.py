"""The code paths a CUDA machine takes, checked against the CPU ones and timed, on one GPU.

CI has no GPU, so this is where the GPU branches of the shared code are exercised:
  * flat shards: `flat_keys(index, on_gpu=True)` copies the keys to the GPU and `search_index`
    searches them with torch (`torch_search`), as `ShardSearcher` does on a GPU. Checked against
    FAISS's CPU IndexFlatL2 (the same neighbours, rank by rank, and their distances), in fp32 and
    with TF32 matmuls allowed (`VLLM_FLOAT32_MATMUL_PRECISION=high` turns them on in vLLM's
    workers), and timed per decode step (batch 1, 32, 256; k 1024) beside FAISS's flat search on
    this machine's CPU;
  * shards: `ShardSearcher(use_gpu=True)` over a two-shard flat datastore from the builder answers
    searches and pointer lookups as the CPU one does, and an IVF shard with `use_gpu=True` is served
    by faiss-gpu or refused with the error naming knn.gpu (faiss-cpu);
  * forgotten entries: a flat shard on the GPU with tombstones (a forget) and zeroed rows (a forget
    with erase) never returns them, even to queries that are their own keys, and otherwise answers
    as the CPU one does;
  * shard actors: `start_shard_actors` with `knn.gpu: true` (where Ray is installed): Ray gives each
    actor a share of the GPU, and plain calls and compiled graphs answer as the in-process CPU
    search does, timed at batch 32;
  * the mixture: `interpolate` on CUDA logits (where vLLM's logits live on a GPU) against the CPU;
  * keys: `KeyEncoder` on CUDA against the CPU, for a tiny random Llama (`ffn_input` and `final`).
Keys and queries are `retrieval_latency.py`'s synthetic clustered 576-d vectors.

    python benchmarks/gpu_paths.py --out DIR     # on a CUDA machine: ~3 min, 1M keys take 2.3 GB of GPU memory

Needs torch with CUDA, faiss (CPU build suffices), numpy, pydantic and transformers; Ray for the
actors' check; not vLLM.
Writes DIR/gpu_paths.json and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
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
from retrieval_latency import KEYS_STREAM, QUERY_STREAM, ClusteredVectors  # noqa: E402

from index_builder.build import build_from_keys  # noqa: E402
from knnlm_core.config import BuildConfig  # noqa: E402
from knnlm_core.datastore import read_manifest  # noqa: E402
from knnlm_core.errors import ConfigError  # noqa: E402
from knnlm_core.keys import KeyEncoder  # noqa: E402
from knnlm_core.manifest import ModelIdentity
from knnlm_core.mixture import interpolate  # noqa: E402
from knnlm_core.search import ShardSearcher, flat_keys, merge_topk, search_index, shard_first_ids  # noqa: E402

K = 1024
BATCHES = (1, 32, 256)
CHUNK = 100_000


def median_ms(fn, repeats: int) -> float:
    """Median wall time of `fn()`; it must return host data (search_index does), so the GPU has finished."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return round(1000 * float(np.median(times)), 3)


def kernel_ms(exact, queries: np.ndarray, repeats: int) -> float:
    """The GPU's own work in a step (torch_search's matmul and top-k), by CUDA events: what the
    step costs past the host's share (copies, launches, NumPy)."""
    q = torch.from_numpy(queries).cuda()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats + 3):
        start.record()
        torch.topk(torch.addmm(exact.norms, q, exact.keys.T, alpha=-2), K, dim=1, largest=False, sorted=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return round(float(np.median(times[3:])), 3)


def agreement(distances: np.ndarray, ids: np.ndarray, ref_distances: np.ndarray, ref_ids: np.ndarray) -> dict:
    """How far a search's answer is from FAISS's exact one: the share of its k ids FAISS also
    returned (ties at the k-th distance may swap), and the largest distance gap rank by rank."""
    overlap = [len(np.intersect1d(a, b)) / len(b) for a, b in zip(ids, ref_ids)]
    gap = np.abs(distances - ref_distances)
    return {
        "id_overlap_min": round(float(np.min(overlap)), 5),
        "id_overlap_mean": round(float(np.mean(overlap)), 5),
        "max_distance_gap": float(gap.max()),
        "max_relative_distance_gap": float((gap / np.maximum(ref_distances, 1e-6)).max()),
    }


def check_flat(entries: int, generator: ClusteredVectors, repeats: int) -> dict:
    keys = np.concatenate([generator.draw(min(CHUNK, entries - s), KEYS_STREAM, s // CHUNK) for s in range(0, entries, CHUNK)])
    values = np.arange(entries, dtype=np.int32)
    queries = generator.draw(max(BATCHES), QUERY_STREAM, 0)
    index = faiss.IndexFlatL2(keys.shape[1])
    index.add(keys)
    exact = flat_keys(index, on_gpu=True)
    assert exact.keys.device.type == "cuda", "flat_keys did not place the keys on the GPU"
    ref_distances, ref_ids = index.search(queries[:32], K)
    row = {"entries": entries}
    for precision in ("fp32", "tf32"):
        torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
        distances, _, ids = search_index(index, values, queries[:32], K, exact=exact)
        row[precision] = agreement(distances, ids, ref_distances, ref_ids)
        row[precision]["ms"] = {b: median_ms(lambda: search_index(index, values, queries[:b], K, exact=exact), repeats) for b in BATCHES}
    torch.backends.cuda.matmul.allow_tf32 = False
    row["gpu_kernels_ms"] = {32: kernel_ms(exact, queries[:32], repeats)}
    row["faiss_cpu_ms"] = {32: median_ms(lambda: index.search(queries[:32], K), max(3, repeats // 10))}
    return row


STORE_ENTRIES, STORE_VOCAB = 40_000, 49_152


def build_store(keys: np.ndarray, root: Path, index: str = "flat") -> None:
    """A datastore of `keys` with random values, built as `knnlm-index` builds one (two shards if flat)."""
    values = np.random.default_rng(0).integers(0, STORE_VOCAB, len(keys))
    model = ModelIdentity(name="synthetic", fingerprint="-", hidden_size=keys.shape[1], vocab_size=STORE_VOCAB, dtype="float32")
    config = BuildConfig(index=index, shards=2 if index == "flat" else 1)
    build_from_keys(keys, values, root, model, config, source="gpu_paths", progress=False)


def check_shards(generator: ClusteredVectors) -> dict:
    """What a shard actor holds on a GPU, against the same shards on the CPU."""
    keys = generator.draw(STORE_ENTRIES, KEYS_STREAM, 0)
    queries = generator.draw(32, QUERY_STREAM, 1)
    pointers = np.tile(np.arange(19_990, 20_030), (32, 1))  # across the two shards' boundary
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for index in ("flat", "IVF256,PQ48"):
            root = Path(tmp) / index
            build_store(keys, root, index)
            manifest = read_manifest(root)
            try:
                on = [ShardSearcher(root, s, first, use_gpu=True) for s, first in zip(manifest.shards, shard_first_ids(manifest))]
            except ConfigError as e:
                out[index] = {"refused": str(e)}
                continue
            off = [ShardSearcher(root, s, first, use_gpu=False) for s, first in zip(manifest.shards, shard_first_ids(manifest))]
            found = [merge_topk([s.search(queries, K, 8) for s in shards], K) for shards in (on, off)]
            followed = [merge_topk([s.find(queries, K, 8, pointers) for s in shards], K) for shards in (on, off)]
            out[index] = {
                "on_gpu": [s.on_gpu for s in on],
                "keys_on": [s.exact.keys.device.type if s.exact is not None else None for s in on],
                "search": agreement(found[0][0], found[0][2], found[1][0], found[1][2]),
                "pointers_same": all(np.array_equal(a, b) for a, b in zip(*followed)),  # scored on the CPU either way
            }
    return out


def check_forgotten(generator: ClusteredVectors) -> dict:
    """Tombstoned and erased entries of flat shards on the GPU (the torch search's +inf norms)
    against the same shards on the CPU, queried with the forgotten entries' own keys."""
    from index_builder.erase import erase_entries

    keys = generator.draw(STORE_ENTRIES, KEYS_STREAM, 0)
    tombstoned, erased = (19_000, 21_000), (5_000, 6_000)  # the first across the two shards' boundary
    queries = np.concatenate([keys[19_980:20_010], keys[5_000:5_002], generator.draw(32, QUERY_STREAM, 1)])
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "flat"
        build_store(keys, root)
        manifest = read_manifest(root)
        gone = np.zeros(len(keys), dtype=bool)
        for lo, hi in (tombstoned, erased):
            gone[lo:hi] = True
        first_ids = shard_first_ids(manifest)
        shard0 = root / manifest.shards[0].index.path
        index = faiss.read_index(str(shard0))
        erase_entries(index, [erased])
        faiss.write_index(index, str(shard0))
        searchers = [
            [
                ShardSearcher(root, s, first, use_gpu=gpu, keep=~gone[first : first + s.entries])
                for s, first in zip(manifest.shards, first_ids)
            ]
            for gpu in (True, False)
        ]
        found = [merge_topk([s.search(queries, K, 8) for s in shards], K) for shards in searchers]
        pointers = np.tile(np.arange(19_990, 20_030), (len(queries), 1))  # into the tombstones, and past them
        followed = [merge_topk([s.find(queries, K, 8, pointers) for s in shards], K) for shards in searchers]
        ids = found[0][2]
        return {
            "keys_on": [s.exact.keys.device.type if s.exact is not None else None for s in searchers[0]],
            "forgotten_ids_found_on_gpu": int(gone[ids[ids >= 0]].sum()),
            "forgotten_ids_followed_on_gpu": int(gone[followed[0][2][followed[0][2] >= 0]].sum()),
            "search": agreement(found[0][0], found[0][2], found[1][0], found[1][2]),
            "pointers_same": all(np.array_equal(a, b) for a, b in zip(*followed)),
        }


def check_ray_actors(generator: ClusteredVectors, repeats: int) -> dict:
    """What the server starts with `knn.gpu: true`: one Ray actor per shard, each on a share of the GPU."""
    try:
        import ray
    except ImportError:
        return {"skipped": "Ray is not installed here"}
    from knnlm_core.config import KnnConfig
    from knnlm_serve.retrieval import LocalRetriever, RayRetriever, start_shard_actors
    from knnlm_serve.runtime import DatastoreInfo

    keys = generator.draw(STORE_ENTRIES, KEYS_STREAM, 0)
    queries = generator.draw(32, QUERY_STREAM, 1)
    knn = KnnConfig(backend="ray", ray_namespace="gpu-paths", gpu=True, k=K, max_k=K, shard_timeout_s=30.0)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "flat"
        build_store(keys, root)
        info = DatastoreInfo.of("gpu", root, read_manifest(root))
        ray.init(include_dashboard=False, log_to_driver=False, namespace=knn.ray_namespace)
        try:
            actors = start_shard_actors(info, knn)
            described = [ray.get(a.describe.remote()) for replicas in actors for a in replicas]
            expected = LocalRetriever(knn.model_copy(update={"gpu": False})).search(info, queries, K, None)
            out = {"actors_on_gpu": [d["on_gpu"] for d in described], "gpu_left_after_actors": ray.available_resources().get("GPU")}
            for transport, compiled in (("plain_calls", False), ("compiled_graphs", True)):
                retriever = RayRetriever(knn.model_copy(update={"compiled_graphs": compiled}), None)
                deadline = time.monotonic() + 60
                while compiled and retriever.compiled_shards(info) != info.shards and time.monotonic() < deadline:
                    retriever.search(info, queries[:1], 1, None)  # the first searches build the graphs
                    time.sleep(0.2)
                found = retriever.search(info, queries, K, None)
                out[transport] = {
                    **agreement(found.distances, found.ids, expected.distances, expected.ids),
                    "transports": sorted(set(found.transports.values())),
                    "ms": median_ms(lambda: retriever.search(info, queries, K, None), repeats),
                }
                retriever.release(set())
            return out
        finally:
            ray.shutdown()


def check_mixture() -> dict:
    """`interpolate` on CUDA against the CPU: a decode step's rows, real-sized vocabulary and k,
    compared as the log-probabilities vLLM takes from the mixed logits."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(32, 49_152, generator=g) * 3
    rows, log_z = np.arange(32), torch.logsumexp(logits, dim=-1).numpy()
    distances = (torch.rand(32, K, generator=g).cumsum(dim=1) * 5).numpy()
    tokens = torch.randint(0, 200, (32, K), generator=g).int().numpy()  # few distinct tokens: duplicates are summed
    tokens[3] = -1  # a row with no neighbour keeps p_LM
    tokens[5, K // 2 :] = -1  # padding past the shard's size
    neighbours = (distances, tokens, np.full(32, 0.25, np.float32), np.full(32, 2.0, np.float32))
    cpu = torch.log_softmax(interpolate(logits.clone(), rows, log_z, *neighbours), dim=-1)
    on = logits.cuda()
    gpu = torch.log_softmax(interpolate(on.clone(), rows, log_z, *neighbours), dim=-1).cpu()
    finite = torch.isfinite(cpu)
    return {
        "max_abs_diff": float((gpu[finite] - cpu[finite]).abs().max()),
        "same_infinities": bool(torch.equal(torch.isfinite(gpu), finite)),
        "ms": median_ms(lambda: interpolate(on.clone(), rows, log_z, *neighbours).sum().item(), 50),
    }


def check_keys() -> dict:
    """`KeyEncoder` keys on CUDA against the CPU, for right-padded windows of different lengths."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
    )
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    windows = [rng.integers(0, 1000, n).astype(np.int64) for n in (64, 17, 40)]
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        LlamaForCausalLM(config).save_pretrained(tmp)
        for key_type in ("ffn_input", "final"):
            cpu = KeyEncoder(Path(tmp), key_type, "float32", device="cpu").encode(windows)
            gpu = KeyEncoder(Path(tmp), key_type, "float32", device="cuda").encode(windows)
            out[key_type] = max(float(np.abs(a - b).max() / np.abs(a).max()) for a, b in zip(cpu, gpu))
    return {"max_relative_diff": out}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results")
    parser.add_argument("--sizes", type=int, nargs="+", default=[17_000, 120_000, 1_000_000])
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_paths.py checks the GPU paths: torch sees no CUDA device here", file=sys.stderr)
        return 2
    faiss.omp_set_num_threads(faiss.omp_get_max_threads())
    generator = ClusteredVectors(seed=0)
    flat = []
    for entries in args.sizes:
        flat.append(check_flat(entries, generator, args.repeats))
        print(f"flat {entries}: {json.dumps(flat[-1])}", flush=True)
    result = {
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "gpu": torch.cuda.get_device_name(),
            "cpu_threads": faiss.omp_get_max_threads(),
            "torch": torch.__version__,
            "faiss": faiss.__version__,
            "python": platform.python_version(),
        },
        "k": K,
        "flat_search": flat,
        "shards": check_shards(generator),
        "forgotten": check_forgotten(generator),
        "ray_actors": check_ray_actors(generator, args.repeats),
        "mixture": check_mixture(),
        "keys": check_keys(),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_paths.json").write_text(json.dumps(result, indent=1) + "\n")
    print(
        f"\n{result['machine']['gpu']}, k {K}: torch flat search on the GPU (ms per step) against FAISS on {result['machine']['cpu_threads']} CPU threads"
    )
    print(
        "| entries | batch 1 | batch 32 | batch 256 | GPU kernels batch 32 | TF32 batch 32 | FAISS CPU batch 32 | ids as FAISS (min) | TF32 ids (min) |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in flat:
        ms, tf = row["fp32"]["ms"], row["tf32"]["ms"]
        print(
            f"| {row['entries']:,} | {ms[1]} | {ms[32]} | {ms[256]} | {row['gpu_kernels_ms'][32]} | {tf[32]} | {row['faiss_cpu_ms'][32]} "
            f"| {row['fp32']['id_overlap_min']} | {row['tf32']['id_overlap_min']} |"
        )
    print(f"shards on the GPU vs CPU: {result['shards']}")
    print(f"forgotten entries on the GPU vs CPU: {result['forgotten']}")
    print(f"Ray shard actors on the GPU: {result['ray_actors']}")
    print(f"mixture on CUDA vs CPU: {result['mixture']}")
    print(f"keys on CUDA vs CPU: {result['keys']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
