"""What a kNN step costs the engine's worker besides its search, outside vLLM and its other processes.

The per-step path (`KnnLogits`: `key_ready` mid-forward, then the logits call) is driven by a
stand-in for the runner's step: `--rows` decoding requests with the datastore's defaults, its own
keys as queries, logits as wide as its model's vocabulary, and a pause between the two calls where
the rest of the forward pass would run (`--tail-ms`; the search runs meanwhile). The shards are the datastore's
Ray actors (compiled graphs or plain calls) or in-process (`local`). The parts are the step's own
clock (`knnlm_step_part_seconds`, engine/step_clock.py), recorded in prometheus_client's multiprocess
mode as in the server; *fixed* is every part but the wait: what a host whose forward pass hides the
search still pays a step.

    python benchmarks/step_cost.py --datastore STORE [--datastore STORE2] [--rows 1 32] \
        [--transports graph call local] [--out benchmarks/results/step_cost.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
import time
from pathlib import Path

# Metrics recorded as the server's engine worker records them: prometheus_client's multiprocess
# mode (the launcher sets it), where each write goes to a memory-mapped file under a lock.
os.environ.setdefault("PROMETHEUS_MULTIPROC_DIR", tempfile.mkdtemp(prefix="step-cost-metrics-"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from prometheus_client import REGISTRY  # noqa: E402

from knnlm_core.config import KnnConfig  # noqa: E402
from knnlm_core.datastore import read_manifest  # noqa: E402
from knnlm_core.search import open_shards  # noqa: E402
from knnlm_serve.engine.batch_requests import BatchRequest  # noqa: E402
from knnlm_serve.engine.knn_logits import KnnLogits  # noqa: E402
from knnlm_serve.engine.rows import sampling_rows  # noqa: E402
from knnlm_serve.engine.step_clock import PARTS  # noqa: E402
from knnlm_serve.runtime import DatastoreInfo, Runtime  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run_record import run_record  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 49152  # SmolLM2's, for the stand-in LM head


class Step:
    """The runner's view of a decode step of `rows` requests, one sampling row each."""

    def __init__(self, rows: int):
        self.requests = {f"r{i}": BatchRequest(None, [], [1, 2, 3]) for i in range(rows)}
        self.rows = sampling_rows(np.arange(rows + 1), rows)

    def sampling_rows(self):
        return self.rows

    def rows_of(self, hidden_states, model_output, sampling=None):
        return self.rows

    def request_id(self, slot: int) -> str:
        return f"r{slot}"

    def request(self, request_id: str) -> BatchRequest:
        return self.requests[request_id]

    def running(self):
        return self.requests.keys()

    def drafts(self, slot: int) -> list[int]:
        return []

    def positions(self, rows) -> np.ndarray:
        return np.array([3 + len(self.requests[f"r{s}"].output_tokens) for s in rows.slot])


class Capture:
    """The step's keys, as the forward pass hands them over (engine/capture.py)."""

    hidden = None
    ffn_input = None

    def listen(self, callback) -> None:
        self.callback = callback

    def keys(self, key_type, token_index, final_rows):
        return self.ffn_input[token_index]


def part_seconds() -> dict[str, float]:
    return {part: REGISTRY.get_sample_value("knnlm_step_part_seconds_total", {"part": part}) or 0.0 for part in PARTS}


def spin(seconds: float) -> None:
    """A GPU host's CPU through the rest of the forward: the kernels launched, the thread waiting
    on the device (CUDA's default synchronisation spins), its caches left as the kNN work left them."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def lm_head(seconds: float, weight=torch.randn(VOCAB, 576)) -> None:
    """This CPU host through the rest of the forward: the LM head's weights (SmolLM2's) streamed
    through the caches, as the forward pass streams them between the key and the logits."""
    end, hidden = time.perf_counter() + seconds, torch.randn(1, 576)
    while time.perf_counter() < end:
        hidden @ weight.T


TAILS = {"spin": spin, "lm-head": lm_head, "sleep": time.sleep}


def run(path: Path, transport: str, rows: int, steps: int, tail_s: float, tail: str = "spin") -> dict:
    manifest = read_manifest(path)
    info = DatastoreInfo.of("bench", path, manifest)
    knn = KnnConfig(backend="local" if transport == "local" else "ray", compiled_graphs=transport == "graph")
    runtime = Runtime(knn=knn, datastores={"bench": info}, default="bench")
    actors = []  # held for the run: an actor no handle refers to is gone
    if transport != "local":
        from knnlm_serve.retrieval import start_shard_actors

        actors = start_shard_actors(info, knn)
    shard = open_shards(path, manifest, use_gpu=False, names={info.shards[0]})[0]
    rng = np.random.default_rng(0)
    keys = torch.from_numpy(shard.reconstruct(rng.integers(0, shard.ntotal - shard.removed, size=4096)).astype(np.float32))
    # as wide as the datastore's model's vocabulary: its values index these rows
    logits = torch.randn(rows, manifest.model.vocab_size, generator=torch.Generator().manual_seed(0)) * 3
    step, capture = Step(rows), Capture()
    knn_logits = KnnLogits(runtime, capture, step)

    def one(i: int) -> None:
        capture.ffn_input = capture.hidden = keys[(i * rows + np.arange(rows)) % len(keys)]
        knn_logits.key_ready(capture.ffn_input)
        TAILS[tail](tail_s)
        mixed = knn_logits(logits.clone(), capture.hidden)
        for r, token in zip(step.requests.values(), mixed.argmax(dim=-1).tolist()):
            r.output_tokens.append(token)

    for i in range(max(50, steps // 10)):  # warm-up: the graphs built, the caches filled
        one(i)
    if transport == "graph":
        assert knn_logits.mixer.retriever.compiled_shards(info) == info.shards, "the compiled graphs did not come up"
    before, shard_before = (
        part_seconds(),
        REGISTRY.get_sample_value("knnlm_shard_search_seconds_sum", {"datastore": "bench", "shard": info.shards[0]}) or 0.0,
    )
    for i in range(steps):
        one(i)
    after = part_seconds()
    shard_after = REGISTRY.get_sample_value("knnlm_shard_search_seconds_sum", {"datastore": "bench", "shard": info.shards[0]}) or 0.0
    ms = {p: 1e3 * (after[p] - before[p]) / steps for p in after}
    served = step.requests["r0"].params  # the datastore's defaults, as a request without knobs gets them
    knn_logits.mixer.release(set())
    del actors
    for r in step.requests.values():
        r.output_tokens.clear()
    return {
        "datastore": str(path),
        "entries": manifest.entries,
        "index": str(manifest.index),
        "k": served.k,
        "skip_threshold": served.skip_threshold,
        "min_pointers": served.min_pointers,
        "nprobe": info.nprobe,
        "transport": transport,
        "rows": rows,
        "steps": steps,
        "tail_ms": 1e3 * tail_s,
        "tail": tail,
        "ms_per_step": ms,
        "all_ms": sum(ms.values()),
        "fixed_ms": sum(v for p, v in ms.items() if p != "wait"),
        "shard_search_ms": 1e3 * (shard_after - shard_before) / steps,
    }


def plot(results: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [
        f"{Path(r['datastore']).name[:12]} {r['entries'] // 1000}k\n{r['transport']}, {r['rows']} row(s)\n{r['tail']}" for r in results
    ]
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(results)), 4.5))
    bottom = np.zeros(len(results))
    for part in results[0]["ms_per_step"]:
        values = np.array([r["ms_per_step"][part] for r in results])
        ax.bar(labels, values, bottom=bottom, label=part)
        bottom += values
    ax.axhline(0.5, color="black", linestyle="--", linewidth=1, label="0.5 ms")
    ax.set_ylabel("ms per step")
    ax.set_title("kNN's work on a step's path, by part (outside vLLM)")
    ax.legend(fontsize=7, ncol=2)
    ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--datastore", type=Path, action="append", required=True, help="a datastore directory (repeatable)")
    parser.add_argument("--transports", nargs="+", default=["graph", "call", "local"], choices=["graph", "call", "local"])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 32], help="decoding requests a step")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--tail-ms", type=float, default=2.0, help="the forward pass after the key, while the search runs")
    parser.add_argument(
        "--tails", nargs="+", default=["spin", "lm-head"], choices=list(TAILS), help="what the CPU does meanwhile (spin: a GPU host's)"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/step_cost.json")
    args = parser.parse_args()
    import ray
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    init_distributed_environment(world_size=1, rank=0, distributed_init_method="tcp://127.0.0.1:29511", local_rank=0, backend="gloo")
    with set_current_vllm_config(VllmConfig()):
        initialize_model_parallel(1, 1)  # one tensor-parallel rank, as the served model here
    ray.init(address="local", namespace="step-cost", log_to_driver=False, include_dashboard=False)
    torch.set_num_threads(1)  # as vLLM's CPU worker on this host: one core, the other left to the actors
    results = []
    for path in args.datastore:
        for transport in args.transports:
            for rows, tail in itertools.product(args.rows, args.tails):
                r = run(path.resolve(), transport, rows, args.steps, args.tail_ms / 1e3, tail)
                results.append(r)
                parts = " ".join(f"{p} {v:.3f}" for p, v in r["ms_per_step"].items())
                print(f"{path.name} {transport} rows {rows} tail {tail}: all {r['all_ms']:.3f} fixed {r['fixed_ms']:.3f} ms ({parts})")
    report = {
        **run_record("step_cost"),
        "settings": {"steps": args.steps, "tail_ms": args.tail_ms, "tails": args.tails},
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    plot(results, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
