"""Per-decode-step retrieval latency: LocalRetriever vs RayRetriever, 1 vs 4 shards, batch 1/8/32.

One timed call is what one decode step does: the step's batch of queries goes to
`retriever.search(datastore, queries, k=1024, nprobe=32)` and comes back as the merged global
top-k.

The datastore is synthetic but built by the index builder itself (`build_from_keys`): keys of
dimension 576 (SmolLM2-135M's hidden size) from 4096 Gaussian clusters of uneven popularity and
spread with a power-law spectrum (see ClusteredVectors), so IVF lists are unevenly full about as
with real hidden states; values are uniform random token ids below 49,152. Keys are generated
chunk by chunk into an fp16 memmap; each shard layout (1, 2, 4) is one `build_from_keys` over the
same keys, as IVF-PQ with the project's `index_factory_string("ivfpq", entries, 576)`
(IVF4096,PQ64 at 1M) trained on `--train-sample` keys with the same seed. The builds are cached
under `--workdir` and reused when their parameters match.

Each cell times the in-process backend and a Ray one in turn on the same queries: first plain
actor calls (`knn.compiled_graphs: false`, the default, with no graph on the
actors), then `RayRetriever` on its compiled graphs (one per shard, torn down
before the next layout). Ray's overhead is reported two ways (`ray_overhead_p50_ms`, both
transports): the transport, per call the round trip minus the slowest shard's own search time
(what Ray adds to a step beyond the search), and ray p50 - local p50 of the same cell, which also
counts the search running slower or faster in the actors (negative when Ray's parallel shards beat
the in-process loop over shards; in-process searches in the compiled-graph cells share the cores
with the graphs' polling readers). At 1 shard a bare compiled graph (`BareGraph`: the same answer
shapes and wait, none of our code) is timed in turn with the same in-process search, so that the
transport splits into Ray's and this host's floor and our share. The benchmark runs itself under the shard actors'
OpenMP setting (`GOMP_SPINCOUNT`), so that its own idle search threads do not spin through the Ray calls.

Besides the end-to-end cells, batch 32 is broken down: per-shard FAISS search, `merge_topk`, and
the mix as the server runs it (the LM's log-softmax, `KnnMixer.lm_confidence`, then `knnlm_core.mixture.interpolate`) over a
49,152-token vocabulary (torch, CPU).

    .venv/bin/python benchmarks/retrieval_latency.py                       # 1M entries, ~10 min first run
    .venv/bin/python benchmarks/retrieval_latency.py --entries 200000 --batch-sizes 1 32 --repeats 20

Writes benchmarks/results/retrieval_latency.json and prints Markdown tables.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks/results/retrieval_latency.json"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no network from a benchmark

import faiss  # noqa: E402

import knnlm_core  # noqa: E402
from index_builder.build import build_from_keys  # noqa: E402
from index_builder.faiss_index import index_factory_string  # noqa: E402
from knnlm_core.config import BuildConfig  # noqa: E402
from knnlm_core.datastore import read_manifest  # noqa: E402
from knnlm_core.files import write_json_atomic  # noqa: E402
from knnlm_core.manifest import ModelIdentity

DIM = 576  # SmolLM2-135M hidden size
VOCAB = 49_152  # SmolLM2 vocabulary
N_CENTRES = 4096
K = 1024
NPROBE = 32
SHARD_COUNTS = (1, 2, 4)
CHUNK = 65_536
GENERATOR = "clustered-v2"  # bump when ClusteredVectors changes, to invalidate cached builds


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class ClusteredVectors:
    """Gaussian clusters around N_CENTRES centres, with a power-law spectrum: dimension i of both
    the centres and the noise is scaled by (1 + i)^-0.5, since LM hidden states are strongly
    anisotropic. Cluster popularity lognormal(0, 1), per-cluster noise scale uniform(0.5, 1.0).
    Draws are reproducible per (stream, chunk).

    The spectrum matters: with isotropic clusters in 576 dimensions, k-means makes "hub"
    centroids (imbalance factor ~10 at 1M entries, 20x the expected codes scanned per query);
    with the decay the lists are about as even as on real keys (imbalance ~1.5-2)."""

    DECAY = 0.5

    def __init__(self, seed: int, dim: int = DIM, n_centres: int = N_CENTRES):
        rng = np.random.default_rng([seed, 0])
        self.seed, self.dim = seed, dim
        self.scale = ((1.0 + np.arange(dim)) ** -self.DECAY).astype(np.float32)
        self.centres = rng.standard_normal((n_centres, dim), dtype=np.float32) * self.scale
        weights = rng.lognormal(0.0, 1.0, n_centres)
        self.p = weights / weights.sum()
        self.spread = rng.uniform(0.5, 1.0, n_centres).astype(np.float32)

    def draw(self, n: int, stream: int, chunk: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, stream, chunk])
        labels = rng.choice(len(self.p), n, p=self.p)
        x = rng.standard_normal((n, self.dim), dtype=np.float32)
        x *= self.scale
        x *= self.spread[labels, None]
        x += self.centres[labels]
        return x


KEYS_STREAM, QUERY_STREAM = 1, 2  # queries are held out: another random stream, same clusters


# ----------------------------------------------------------------------------------------- build


def build_params(
    entries: int,
    train_sample: int,
    seed: int,
    factory: str | None,
    build_threads: int,
    model: dict | None = None,
    shard_counts: tuple[int, ...] = SHARD_COUNTS,
) -> dict:
    return {
        "model": model or {"name": "synthetic", "fingerprint": "synthetic"},
        "generator": GENERATOR,
        "entries": entries,
        "dim": DIM,
        "centres": N_CENTRES,
        "vocab": VOCAB,
        "train_sample": min(train_sample, entries),
        "seed": seed,
        "chunk": CHUNK,
        "factory": factory or index_factory_string("ivfpq", entries, DIM),
        "shard_counts": list(shard_counts),
        "build_threads": build_threads,
    }


def ensure_datastores(
    workdir: Path,
    entries: int,
    train_sample: int,
    seed: int,
    rebuild: bool,
    factory: str | None = None,
    build_threads: int = 1,
    model: dict | None = None,
    shard_counts: tuple[int, ...] = SHARD_COUNTS,
) -> dict:
    """Build (or reuse) `<workdir>/synthetic-<entries>/shards-<n>` for each n of `shard_counts`; return the build record."""
    params = build_params(entries, train_sample, seed, factory, build_threads, model, shard_counts)
    final = workdir / f"synthetic-{entries}"
    record_file = final / "build.json"
    if final.exists() and not rebuild:
        try:
            record = json.loads(record_file.read_text())
            # The build's thread count says how fast it was built, not what: another one reuses it.
            differ = sorted(
                k for k in params.keys() | record["params"].keys() if k != "build_threads" and params.get(k) != record["params"].get(k)
            )
            if differ:
                log(f"build: cached {final} was built with other {', '.join(differ)}; rebuilding")
            else:
                for n in params["shard_counts"]:
                    read_manifest(final / f"shards-{n}")
                log(f"build: reusing {final} (built {record['created']}, {record['seconds']['total']:.0f} s)")
                record["reused"] = True
                return record
        except Exception as e:  # noqa: BLE001 - anything off: rebuild
            log(f"build: cached {final} unusable ({type(e).__name__}: {e}); rebuilding")
    shutil.rmtree(final, ignore_errors=True)
    final.mkdir(parents=True)
    threads = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(build_threads)
    try:
        record = _build(final, params)
    finally:
        faiss.omp_set_num_threads(threads)
    write_json_atomic(record_file, record)
    record["reused"] = False
    return record


def _build(final: Path, params: dict) -> dict:
    started = time.monotonic()
    entries, factory = params["entries"], params["factory"]
    gen = ClusteredVectors(params["seed"])
    seconds: dict[str, float] = {}
    log(f"build: {entries:,} synthetic keys, dim {DIM}, {factory}; {', '.join(map(str, params['shard_counts']))} shards under {final}")
    t0 = time.monotonic()
    keys = np.lib.format.open_memmap(final / "keys.npy", mode="w+", dtype=np.float16, shape=(entries, DIM))
    for c, lo in enumerate(range(0, entries, CHUNK)):
        hi = min(lo + CHUNK, entries)
        keys[lo:hi] = gen.draw(hi - lo, KEYS_STREAM, c)
    keys.flush()
    values = np.random.default_rng([params["seed"], 3]).integers(0, VOCAB, entries, dtype=np.int32)
    seconds["generate"] = time.monotonic() - t0
    model = ModelIdentity(**params["model"], hidden_size=DIM, vocab_size=VOCAB, dtype="float32")
    source = f"synthetic:{GENERATOR}:seed={params['seed']}"
    for n in params["shard_counts"]:
        t0 = time.monotonic()
        config = BuildConfig(index=factory, shards=n, train_sample=params["train_sample"], seed=params["seed"])
        build_from_keys(keys, values, final / f"shards-{n}", model, config, source=source, progress=True)
        seconds[f"build_{n}_shards"] = time.monotonic() - t0
        log(f"build: {n} shard(s) in {seconds[f'build_{n}_shards']:.0f} s")
    del keys
    (final / "keys.npy").unlink()
    seconds["total"] = time.monotonic() - started
    return {
        "params": params,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "seconds": {k: round(v, 2) for k, v in seconds.items()},
        "note": (
            f"index_builder.build_from_keys per layout, trained on {params['train_sample']:,} keys "
            f"(seed {params['seed']}); FAISS threads during the build: {params['build_threads']}"
        ),
    }


# ------------------------------------------------------------------------------------- measure


def stats_ms(samples_s: list[float], batch: int) -> dict:
    ms = np.asarray(samples_s) * 1e3
    return {
        "n": len(ms),
        "p50_ms": round(float(np.percentile(ms, 50)), 3),
        "p99_ms": round(float(np.percentile(ms, 99)), 3),
        "mean_ms": round(float(ms.mean()), 3),
        "min_ms": round(float(ms.min()), 3),
        "max_ms": round(float(ms.max()), 3),
        "queries_per_s": round(batch / float(ms.mean() / 1e3), 1),
    }


class QueryPool:
    def __init__(self, gen: ClusteredVectors, n: int = 4096):
        self.q = gen.draw(n, QUERY_STREAM, 0)
        self.pos = 0

    def next(self, batch: int) -> np.ndarray:
        if self.pos + batch > len(self.q):
            self.pos = 0
        out = self.q[self.pos : self.pos + batch]
        self.pos += batch
        return out


def timed(fn, make_args, warmup: int, repeats: int) -> list[float]:
    for _ in range(warmup):
        fn(*make_args())
    out = []
    for _ in range(repeats):
        args = make_args()
        t0 = time.perf_counter()
        fn(*args)
        out.append(time.perf_counter() - t0)
    return out


def timed_in_turn(fns: dict, make_args, warmup: int, repeats: int) -> dict[str, list[float]]:
    """`timed` for several backends at once: each repeat times every backend once on the same
    arguments, in turn (alternating the order), so load from elsewhere on the machine hits them alike."""
    names = list(fns)
    for _ in range(warmup):
        args = make_args()
        for name in names:
            fns[name](*args)
    out: dict[str, list[float]] = {name: [] for name in names}
    for i in range(repeats):
        args = make_args()
        for name in names if i % 2 == 0 else names[::-1]:
            t0 = time.perf_counter()
            fns[name](*args)
            out[name].append(time.perf_counter() - t0)
    return out


def probe_ray_worker_threads() -> dict:
    """What a worker started like a ShardActor (num_cpus=0) sees: OMP_NUM_THREADS and FAISS threads."""
    import ray

    @ray.remote(num_cpus=0)
    class Probe:
        def threads(self) -> dict:
            import faiss as f

            return {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"), "faiss_omp_threads": f.omp_get_max_threads()}

    probe = Probe.remote()
    try:
        return ray.get(probe.threads.remote())
    finally:
        ray.kill(probe)


def machine_info() -> dict:
    import ray
    import torch

    return {
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)),
        "cpu_model": _cpu_model(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "faiss_omp_threads": faiss.omp_get_max_threads(),
        "faiss_compile_options": faiss.get_compile_options(),
        "torch_threads": torch.get_num_threads(),
        "GOMP_SPINCOUNT": os.environ.get("GOMP_SPINCOUNT"),
        "platform": platform.platform(),
        "versions": {
            "python": platform.python_version(),
            "numpy": np.__version__,
            "faiss": faiss.__version__,
            "ray": ray.__version__,
            "torch": torch.__version__,
            "knnlm": knnlm_core.__version__,
        },
    }


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


class Retrievers:
    """The project's backends behind one call, `search(backend, name, queries, k, nprobe)`: `local`
    (in-process), `ray` (RayRetriever: a Ray Compiled Graph per shard actor) and `ray_plain`
    (RayRetriever without graphs: plain actor calls, the default where shard actors share cores).

    The slowest shard's in-actor search time is kept per Ray call, to split Ray's time into
    search and transport."""

    def __init__(self, runtime):
        from knnlm_serve import retrieval as r

        self.runtime = runtime
        # Keep the handles: named actors without a live handle are garbage-collected.
        self.actors = [r.start_shard_actors(info, runtime.knn) for info in runtime.datastores.values()]
        self.backends = {
            "local": r.LocalRetriever(runtime.knn),
            "ray": r.RayRetriever(runtime.knn.model_copy(update={"compiled_graphs": True}), runtime.ray_address),
            "ray_plain": r.RayRetriever(runtime.knn.model_copy(update={"compiled_graphs": False}), runtime.ray_address),
        }
        self.slowest_shard_s: dict[str, list[float]] = {"ray": [], "ray_plain": []}

    def search(self, backend: str, name: str, queries: np.ndarray, k: int, nprobe: int):
        result = self.backends[backend].search(self.runtime.datastores[name], queries, k, nprobe)
        if result.failed_shards:
            raise RuntimeError(f"{backend} search of {name}: shards failed: {result.failed_shards}")
        if backend in self.slowest_shard_s:
            self.slowest_shard_s[backend].append(max(result.shard_seconds.values()))
        return result

    def caller(self, backend: str):
        return lambda *a: self.search(backend, *a)

    def compile(self, name: str, query: np.ndarray, timeout: float = 300.0) -> float:
        """Seconds until every shard of `name` is on its compiled graph (built in the background
        from the first search; plain calls answer meanwhile)."""
        info, ray_backend = self.runtime.datastores[name], self.backends["ray"]
        t0 = time.monotonic()
        while ray_backend.compiled_shards(info) != info.shards:
            if time.monotonic() - t0 > timeout:
                raise RuntimeError(f"{name}: compiled graphs not ready after {timeout:.0f} s")
            ray_backend.search(info, query, K, NPROBE)
            time.sleep(0.1)
        return time.monotonic() - t0

    def release_graphs(self) -> None:
        """Tear the compiled graphs down, so that their idle actors stop polling before the next layout."""
        self.backends["ray"].release(set())


class BareGraph:
    """Ray's own floor: a compiled graph to an actor started like a shard actor that answers with
    arrays of a search's shape (distances, tokens, ids) after busy-waiting as long as the shard's
    search took, with none of our code on either side. It splits a 1-shard cell's transport into
    what Ray and this host cost (wake-ups, channels, serialization) and what is ours (the doze,
    copies, merge, bookkeeping). Timed after the cell's own graph is torn down: each graph's
    reader polls a core, and two would slow each other's searches."""

    def __init__(self):
        import ray
        from ray.dag import InputNode

        from knnlm_serve.retrieval import SHARD_ACTOR_ENV

        self.actor = ray.remote(_BareShard).options(num_cpus=0, runtime_env={"env_vars": SHARD_ACTOR_ENV}).remote()
        with InputNode() as step:
            self.graph = self.actor.step.bind(step).experimental_compile()
        self.graph.execute((np.zeros((1, DIM), np.float32), 1, 0.0)).get()

    def search(self, queries: np.ndarray, k: int, seconds: float) -> None:
        self.graph.execute((queries, k, seconds)).get()

    def close(self) -> None:
        import ray

        self.graph.teardown()
        ray.kill(self.actor)


class _BareShard:
    def __init__(self):
        self.answers: dict[tuple[int, int], tuple] = {}

    def step(self, step: tuple) -> tuple:
        queries, k, seconds = step
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            pass
        shape = (len(queries), k)
        if shape not in self.answers:  # a search's answer, made once: the floor copies no more than Ray does
            self.answers[shape] = (np.ones(shape, np.float32), np.ones(shape, np.int32), np.ones(shape, np.int64))
        return (*self.answers[shape], seconds)


def measure_cell(retrievers: Retrievers, backends: tuple[str, str], name: str, batch: int, repeats: int, pool, warmup: int) -> dict:
    """In-process vs one Ray backend on the same queries, in turn: each one's stats and the Ray overhead."""
    local, ray_backend = backends
    retrievers.slowest_shard_s[ray_backend].clear()
    fns = {b: retrievers.caller(b) for b in backends}
    samples = timed_in_turn(fns, lambda: (name, pool.next(batch), K, NPROBE), warmup, repeats)
    out = {"local": stats_ms(samples[local], batch), "ray": stats_ms(samples[ray_backend], batch)}
    in_actor = np.asarray(retrievers.slowest_shard_s[ray_backend][-repeats:]) * 1e3
    out["ray"]["slowest_shard_search_p50_ms"] = round(float(np.percentile(in_actor, 50)), 3)
    # Per call, what Ray added to the step beyond the search itself (the search's own speed varies
    # more between calls on a shared 2-core host than the transport does).
    transport = np.asarray(samples[ray_backend]) * 1e3 - in_actor
    out["ray"]["transport_p50_ms"] = round(float(np.percentile(transport, 50)), 3)
    out["ray_overhead_p50_ms"] = round(out["ray"]["p50_ms"] - out["local"]["p50_ms"], 3)
    out["ray_overhead_mean_ms"] = round(out["ray"]["mean_ms"] - out["local"]["mean_ms"], 3)
    return out


def measure_floor(retrievers: Retrievers, bare: BareGraph, name: str, cell: dict, repeats: int, pool, warmup: int) -> float:
    """Ray's own transport p50 (ms) in a 1-shard cell's setting: the bare graph, waiting as long as
    the cell's shard searched, timed in turn with the same in-process search as the cell."""
    seconds = cell["ray"]["slowest_shard_search_p50_ms"] / 1e3
    fns = {"local": retrievers.caller("local"), "bare": lambda _name, queries, k, _nprobe: bare.search(queries, k, seconds)}
    samples = timed_in_turn(fns, lambda: (name, pool.next(cell["batch"]), K, NPROBE), warmup, repeats)
    return round(float(np.percentile((np.asarray(samples["bare"]) - seconds) * 1e3, 50)), 3)


def measure(args, record: dict, final: Path) -> dict:
    import ray
    import torch

    from knnlm_core.config import KnnConfig
    from knnlm_core.mixture import interpolate
    from knnlm_core.search import merge_topk, open_shards
    from knnlm_serve.engine.knn_mixer import KnnMixer
    from knnlm_serve.runtime import DatastoreInfo, Runtime

    gen = ClusteredVectors(args.seed)
    pool = QueryPool(gen)
    names = {n: f"shards{n}" for n in SHARD_COUNTS}
    infos, manifests = {}, {}
    for n in SHARD_COUNTS:
        path = final / f"shards-{n}"
        manifests[n] = read_manifest(path)
        infos[names[n]] = DatastoreInfo.of(names[n], path, manifests[n])
    namespace = f"knnlm-bench-{os.getpid()}"
    log("ray: init ...")
    t0 = time.monotonic()
    ray.init(include_dashboard=False, log_to_driver=False, namespace=namespace, object_store_memory=512 * 2**20)
    ray_init_s = time.monotonic() - t0
    try:
        knn = KnnConfig(backend="ray", ray_namespace=namespace, k=K, max_k=max(K, 2048), nprobe=NPROBE, gpu=False)
        runtime = Runtime(knn=knn, datastores=infos, ray_address=ray.get_runtime_context().gcs_address)
        log(f"ray: up in {ray_init_s:.1f} s; starting {sum(SHARD_COUNTS)} shard actors, loading local shards ...")
        t0 = time.monotonic()
        retrievers = Retrievers(runtime)
        for name in infos:  # LocalRetriever opens shards on first use
            retrievers.search("local", name, pool.next(1), K, NPROBE)
        load_s = time.monotonic() - t0
        worker_threads = probe_ray_worker_threads()
        log(f"ray + local: loaded in {load_s:.1f} s; ray workers see {worker_threads}")

        cells, graph_build_s = [], {}
        for n in SHARD_COUNTS:
            name = names[n]
            # Before: plain actor calls, with no compiled graph on these actors. After: the graphs.
            plain = {
                b: measure_cell(retrievers, ("local", "ray_plain"), name, b, r, pool, args.warmup)
                for b, r in zip(args.batch_sizes, args.repeats)
            }
            graph_build_s[n] = round(retrievers.compile(name, pool.next(1)), 2)
            log(f"compiled graphs for {n} shard(s) ready in {graph_build_s[n]:.1f} s")
            for batch, repeats in zip(args.batch_sizes, args.repeats):
                cell = {"shards": n, "batch": batch, "k": K, "nprobe": NPROBE}
                cell.update(measure_cell(retrievers, ("local", "ray"), name, batch, repeats, pool, args.warmup))
                cell["plain_ray_calls"] = plain[batch]
                log(
                    f"cell shards={n} batch={batch}: local p50 {cell['local']['p50_ms']:.2f} ms, ray p50 {cell['ray']['p50_ms']:.2f} ms "
                    f"(+{cell['ray_overhead_p50_ms']:.2f}), transport {cell['ray']['transport_p50_ms']:.2f} ms; "
                    f"before, plain calls: +{plain[batch]['ray_overhead_p50_ms']:.2f} ms"
                )
                cells.append(cell)
            retrievers.release_graphs()
            if n == 1:  # one graph to one actor: the floor of the 1-shard cells
                bare = BareGraph()
                for cell, repeats in zip(cells[-len(args.batch_sizes) :], args.repeats):
                    cell["bare_graph_transport_p50_ms"] = measure_floor(retrievers, bare, name, cell, repeats, pool, args.warmup)
                    log(f"cell shards=1 batch={cell['batch']}: a bare graph's transport {cell['bare_graph_transport_p50_ms']:.2f} ms")
                bare.close()

        # Where a batch-32 step's time goes: FAISS per shard, merge, interpolation.
        bb = args.breakdown_batch
        reps = args.breakdown_repeats
        breakdown = {"batch": bb, "k": K, "nprobe": NPROBE}
        for n in SHARD_COUNTS:  # own searchers: the retrievers' are internal to them
            root = Path(infos[names[n]].path)
            shards = open_shards(root, manifests[n], use_gpu=False)
            per_shard = []
            for sh in shards:
                per_shard.append(stats_ms(timed(sh.search, lambda: (pool.next(bb), K, NPROBE), 2, reps), bb))
            faiss.cvar.indexIVF_stats.reset()
            q = pool.next(bb)
            answers = [sh.search(q, K, NPROBE) for sh in shards]
            scanned = faiss.cvar.indexIVF_stats.ndis / bb
            merge = stats_ms(timed(merge_topk, lambda: (answers, K), 3, reps), bb)
            breakdown[f"shards{n}"] = {
                "search_per_shard": per_shard,
                "search_sum_p50_ms": round(sum(s["p50_ms"] for s in per_shard), 3),
                "codes_scanned_per_query": int(scanned),
                "merge_topk": merge,
            }
        distances, tokens, _ = merge_topk(answers, K)  # from the last layout: real answers
        logits = torch.randn(bb, VOCAB)
        lam, temp = np.full(bb, 0.25, np.float32), np.full(bb, 1.0, np.float32)

        rows, mixer = list(range(bb)), KnnMixer(retriever=None)

        def mix(logits, *neighbours):  # as the server: one log-softmax a row (skip rule, normaliser), then the mix in place
            log_z, _ = mixer.lm_confidence(logits, rows)
            return interpolate(logits, np.arange(bb), log_z, *neighbours)

        breakdown["interpolate"] = stats_ms(timed(mix, lambda: (logits, distances, tokens, lam, temp), 3, reps), bb)
        breakdown["interpolate"]["vocab"] = VOCAB
        log(
            f"breakdown batch {bb}: merge(4 shards) p50 {breakdown['shards4']['merge_topk']['p50_ms']:.2f} ms, "
            f"interpolate p50 {breakdown['interpolate']['p50_ms']:.2f} ms"
        )
        setup = {
            "ray_init_s": round(ray_init_s, 2),
            "actors_and_local_load_s": round(load_s, 2),
            "compiled_graphs_ready_s": graph_build_s,
            "ray_worker_threads": worker_threads,
        }
        del retrievers
        return {"cells": cells, "breakdown": breakdown, "setup": setup}
    finally:
        # The retrievers' background graph threads (builds, parking, teardowns) call Ray, and a call
        # after ray.shutdown() ends this process before the results are written (seen once).
        deadline = time.monotonic() + 60
        for thread in threading.enumerate():
            if thread.name.startswith("knnlm-graph"):
                thread.join(max(0.0, deadline - time.monotonic()))
        ray.shutdown()
        log("ray: shut down")


# -------------------------------------------------------------------------------------- report


def overhead_summary(cells: list[dict]) -> dict:
    """Ray's overhead per cell, for the compiled graphs and for plain calls, two ways, and Ray's own floor at 1 shard."""

    def cell(c: dict) -> str:
        return f"shards={c['shards']},batch={c['batch']}"

    return {
        "what": "Ray overhead over in-process search (ms). transport: per call, the round trip minus the slowest "
        "shard's own search time in it, p50 (the fan-out, channels or object store, the wait and the merge); "
        "minus_local: ray p50 - local p50 of the same cell, which also counts the search running slower or faster "
        "in the actors than in this process. compiled_graphs: knn.compiled_graphs true; plain_calls: false (the default); "
        "bare_graph (1 shard): Ray's own floor, a compiled graph to an actor that returns arrays of the answer's shape after "
        "busy-waiting the shard's search time, timed in turn with the same in-process search: compiled_graphs minus bare_graph is our code's share",
        "transport": {
            "compiled_graphs": {cell(c): c["ray"]["transport_p50_ms"] for c in cells},
            "plain_calls": {cell(c): c["plain_ray_calls"]["ray"]["transport_p50_ms"] for c in cells},
            "bare_graph": {cell(c): c["bare_graph_transport_p50_ms"] for c in cells if "bare_graph_transport_p50_ms" in c},
        },
        "minus_local": {
            "compiled_graphs": {cell(c): c["ray_overhead_p50_ms"] for c in cells},
            "plain_calls": {cell(c): c["plain_ray_calls"]["ray_overhead_p50_ms"] for c in cells},
        },
    }


def markdown(report: dict) -> str:
    lines = [
        f"Retrieval per decode step, {report['build']['params']['entries']:,} entries, "
        f"{report['build']['params']['factory']}, k={K}, nprobe={NPROBE}, {report['machine']['cpu_count']} CPUs (ms)",
        "",
        "| shards | batch | compiled graphs: local p50 | ray p50 (p99) | slowest shard's own search | **transport** "
        "| ray − local | plain calls: local p50 | ray p50 (p99) | slowest shard's own search | **transport** | ray − local |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in report["cells"]:
        pl = c["plain_ray_calls"]
        row = [f"{c['shards']}", f"{c['batch']}"]
        for cell in (c, pl):
            lo, ra = cell["local"], cell["ray"]
            row += [
                f"{lo['p50_ms']:.2f}",
                f"{ra['p50_ms']:.2f} ({ra['p99_ms']:.2f})",
                f"{ra['slowest_shard_search_p50_ms']:.2f}",
                f"**{ra['transport_p50_ms']:.2f}**",
                f"{cell['ray_overhead_p50_ms']:+.2f}",
            ]
        lines.append("| " + " | ".join(row) + " |")
    bare = report["ray_overhead_p50_ms"]["transport"]["bare_graph"]
    if bare:
        lines += [
            "",
            "Ray's own floor at 1 shard (a bare compiled graph: the same answer shapes and wait, in turn with in-process search), "
            "transport p50 ms: " + ", ".join(f"{key.split(',')[1]} {ms:.2f}" for key, ms in bare.items()),
        ]
    b = report["breakdown"]
    lines += [
        "",
        f"Batch {b['batch']} breakdown (p50 ms)",
        "",
        "| shards | FAISS search per shard | sum over shards | codes scanned/query | merge_topk | interpolate (vocab 49,152) |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for n in SHARD_COUNTS:
        s = b[f"shards{n}"]
        per = ", ".join(f"{x['p50_ms']:.2f}" for x in s["search_per_shard"])
        lines.append(
            f"| {n} | {per} | {s['search_sum_p50_ms']:.2f} | {s['codes_scanned_per_query']:,} | "
            f"{s['merge_topk']['p50_ms']:.3f} | {b['interpolate']['p50_ms']:.2f} |"
        )
    return "\n".join(lines)


def run_under_shard_actor_omp() -> None:
    """Run this benchmark again under the shard actors' OpenMP spin setting (read when FAISS and
    torch load OpenMP, hence a new process): with libgomp's default spin, this process's idle
    search threads held a core for about a millisecond after each in-process search, during the Ray
    call timed next to it (2 cores; transport at batch 32 with 2 shards 3.8-5.0 -> 2.2-2.3 ms)."""
    from knnlm_serve.retrieval import SHARD_ACTOR_ENV

    spin = SHARD_ACTOR_ENV["GOMP_SPINCOUNT"]
    if os.environ.get("GOMP_SPINCOUNT") != spin:
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "GOMP_SPINCOUNT": spin})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--entries", type=int, default=1_000_000, help="datastore entries (default: %(default)s)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32], help="queries per step (default: %(default)s)")
    p.add_argument(
        "--repeats",
        type=int,
        nargs="+",
        default=[50, 50, 40],
        help="timed calls per cell: one value for all batch sizes, or one per batch size (default: %(default)s)",
    )
    p.add_argument("--warmup", type=int, default=5, help="untimed calls per cell and backend (default: %(default)s)")
    p.add_argument("--breakdown-batch", type=int, default=32, help="batch size of the search/merge/interpolate breakdown")
    p.add_argument("--breakdown-repeats", type=int, default=20, help="timed calls per breakdown item (default: %(default)s)")
    p.add_argument("--train-sample", type=int, default=65_536, help="keys the IVF-PQ quantizers are trained on (default: %(default)s)")
    p.add_argument("--factory", help="FAISS factory string (default: index_factory_string('ivfpq', entries, 576))")
    p.add_argument(
        "--build-threads",
        type=int,
        default=1,
        help="FAISS threads for the build; 1 is faster on a small, busy machine (default: %(default)s)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", type=Path, default=Path("/tmp/knnlm-bench"), help="datastore cache (default: %(default)s)")
    p.add_argument("--rebuild", action="store_true", help="rebuild the datastore even if a matching one is cached")
    p.add_argument("--output", type=Path, default=RESULTS, help="JSON results file (default: %(default)s)")
    p.add_argument(
        "--model-dir",
        type=Path,
        help="stamp this model's identity on the synthetic datastores so a server of it accepts them "
        "(loadtest scenarios); its hidden size must be 576",
    )
    p.add_argument("--build-only", action="store_true", help="build (or reuse) the datastores, measure nothing")
    args = p.parse_args(argv)
    if len(args.repeats) == 1:
        args.repeats = args.repeats * len(args.batch_sizes)
    if len(args.repeats) != len(args.batch_sizes):
        p.error(f"--repeats takes one value or one per batch size ({len(args.batch_sizes)})")
    if args.entries < 4 * 39 * 4:
        p.error("--entries is too small for a sharded IVF-PQ datastore")

    if not args.build_only and argv is None:
        run_under_shard_actor_omp()
    started = time.monotonic()
    load_before = os.getloadavg()
    args.workdir.mkdir(parents=True, exist_ok=True)
    model = None
    if args.model_dir:
        from knnlm_core.model_dir import hidden_size_of, model_fingerprint

        if hidden_size_of(args.model_dir) != DIM:
            p.error(f"--model-dir {args.model_dir} has hidden size {hidden_size_of(args.model_dir)}, not {DIM}")
        model = {"name": args.model_dir.name, "fingerprint": model_fingerprint(args.model_dir)}
    record = ensure_datastores(
        args.workdir, args.entries, args.train_sample, args.seed, args.rebuild, args.factory, args.build_threads, model
    )
    final = args.workdir / f"synthetic-{args.entries}"
    if args.build_only:
        print(json.dumps({"datastores": [str(final / f"shards-{n}") for n in SHARD_COUNTS], "build": record}, indent=2))
        return 0
    results = measure(args, record, final)
    report = {
        "benchmark": "retrieval_latency",
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine_info(),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "build": record,
        "datastore": str(final),
        "settings": {
            "k": K,
            "nprobe": NPROBE,
            "batch_sizes": args.batch_sizes,
            "repeats": args.repeats,
            "warmup": args.warmup,
            "queries": "held-out draws from the same clustered distribution (4096-query pool, cycled)",
            "p99_note": "with 20-50 samples p99 is close to the maximum",
        },
        "ray_overhead_p50_ms": overhead_summary(results["cells"]),
        **results,
        "seconds": round(time.monotonic() - started, 1),
    }
    report["machine"]["ray_worker_threads"] = results["setup"]["ray_worker_threads"]
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(markdown(report))
    print(f"\nwrote {args.output} ({report['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
