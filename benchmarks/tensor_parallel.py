"""Tensor parallelism on this machine's CPU: step time and kNN's share at TP 1 and TP 2, with kNN
on and off, and what the broadcast of rank 0's answer costs a step.

    .venv/bin/python benchmarks/tensor_parallel.py       # ~15 min on 2 CPU cores

A random Llama sized so that a step is mostly the model's work (hidden 512, 8 heads, 4 KV
heads, 8 layers, SmolLM2's tokenizer and vocabulary), a flat datastore of standard-library
documentation built with it, served at TP 1 and at TP 2 (one core a rank), one server at a time.
On each: `--pairs` interleaved pairs of kNN on / off (the order alternating), each one stream of
`--requests` greedy completions of `--tokens` tokens; tokens/s and the step's kNN seconds from the
server's metrics (at TP 2 every rank mixes: the step seconds are divided by the ranks). The
broadcast's own cost is rank 0's seconds in it a step (rank 1's includes waiting for the search).
What a GPU host would pay is estimated, not measured: the bytes broadcast a step (per row, k
neighbours of a float32 distance, an int32 token and an int64 id, plus λ and τ) over NCCL.
With `--heapq-ranks N`, also the README's example on the embedded default (configs/default.yaml,
SmolLM2, whose 9 heads and 3 KV heads divide by 3 but not by 2) at TP 1 and TP N: the three
greedy completions of "heapq.heappush\n\n", compared.
Writes benchmarks/results/tensor_parallel.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests")]

from run_record import run_record  # noqa: E402
from tiny_models import TOKENIZER_FILES  # noqa: E402

from index_builder.build import build_datastore  # noqa: E402
from index_builder.default_datastore import MODULES, module_documents  # noqa: E402
from knnlm_core.config import BuildConfig  # noqa: E402
from knnlm_core.default_model import prepare_default_model  # noqa: E402
from knnlm_serve.server.process import RunningServer, scrape_metrics  # noqa: E402

PROMPT = "heapq.heappush\n\n"


def make_model(out: Path, tokenizer_dir: Path) -> Path:
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (out / "config.json").exists():
        return out
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out / name)
    return out


def one_run(server: RunningServer, knn: bool, requests: int, tokens: int) -> dict:
    client, before = server.openai_client(), scrape_metrics(server.base_url)
    started = time.monotonic()
    for _ in range(requests):
        client.completions.create(
            model="bench", prompt=PROMPT, max_tokens=tokens, temperature=0, extra_body={"vllm_xargs": {"knn": knn}, "ignore_eos": True}
        )
    seconds = time.monotonic() - started
    after = scrape_metrics(server.base_url)
    delta = lambda name: after.get(name, 0) - before.get(name, 0)  # noqa: E731
    return {
        "tokens_per_s": requests * tokens / seconds,
        "step_seconds": delta("knnlm_step_seconds_sum"),
        "steps": delta("knnlm_step_seconds_count"),
        "broadcast_rank0_s": delta('knnlm_tensor_parallel_broadcast_seconds_total{rank="0"}'),
        "broadcast_rank1_s": delta('knnlm_tensor_parallel_broadcast_seconds_total{rank="1"}'),
        "broadcasts": delta('knnlm_tensor_parallel_broadcasts_total{rank="0"}'),
        "seconds": seconds,
    }


def spread(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 4), "min": round(min(values), 4), "max": round(max(values), 4)}


def measure(model: Path, datastore: Path, work: Path, ranks: int, args) -> dict:
    config = {
        "model": str(model),
        "served_model_name": "bench",
        "enforce_eager": True,
        "kv_cache_gib": 0.5,
        "max_model_len": 512,
        "tensor_parallel_size": ranks,
        "knn": {"datastores": {"docs": str(datastore)}},
    }
    (work / f"tp{ranks}").mkdir(exist_ok=True)
    with RunningServer(config, work / f"tp{ranks}") as server:
        one_run(server, True, 1, 8)  # warm-up
        runs = {True: [], False: []}
        for pair in range(args.pairs):
            for knn in (True, False) if pair % 2 == 0 else (False, True):
                runs[knn].append(one_run(server, knn, args.requests, args.tokens))
                print(ranks, "knn" if knn else "off", runs[knn][-1], flush=True)
    on, off = runs[True], runs[False]
    per_step = [r["step_seconds"] / r["steps"] * 1000 for r in on if r["steps"]]  # a rank's kNN work a step, the ranks' mean
    return {
        "ranks": ranks,
        "tokens_per_s_knn": spread([r["tokens_per_s"] for r in on]),
        "tokens_per_s_off": spread([r["tokens_per_s"] for r in off]),
        "knn_over_off": spread([a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(on, off)]),
        "knn_step_ms": spread(per_step),
        "knn_share_of_time": spread([r["step_seconds"] / ranks / r["seconds"] for r in on]),
        "broadcast_rank0_ms_a_step": spread([r["broadcast_rank0_s"] / r["broadcasts"] * 1000 for r in on if r["broadcasts"]])
        if ranks > 1
        else None,
        "broadcast_rank1_ms_a_step": spread([r["broadcast_rank1_s"] / r["broadcasts"] * 1000 for r in on if r["broadcasts"]])
        if ranks > 1
        else None,
    }


def heapq_example(ranks: int, work: Path) -> dict:
    """The README's three completions at TP 1 and TP `ranks`, one server at a time."""
    import yaml

    config = yaml.safe_load((ROOT / "configs/default.yaml").read_text())
    config.pop("port")
    texts = {}
    for tp in (1, ranks):
        (work / f"heapq-tp{tp}").mkdir(exist_ok=True)
        with RunningServer({**config, "tensor_parallel_size": tp}, work / f"heapq-tp{tp}") as server:
            client = server.openai_client()
            texts[tp] = [
                client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=24, temperature=0, extra_body={"vllm_xargs": xargs})
                .choices[0]
                .text
                for xargs in ({"knn": False}, {}, {"knn_lambda": 0.25})
            ]
        print(tp, texts[tp], flush=True)
    return {"ranks": ranks, "tp1": texts[1], f"tp{ranks}": texts[ranks], "identical": texts[1] == texts[ranks]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/knnlm-tensor-parallel"))
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--requests", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--heapq-ranks", type=int, default=0, help="also: the README's heapq example at TP 1 and at this TP")
    parser.add_argument("--skip-steps", action="store_true", help="only the heapq example")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/tensor_parallel.json")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    record = {**run_record("tensor_parallel"), "model": "random Llama, hidden 512, 8 layers, 8 heads, 4 KV heads", "tokens": args.tokens}
    if args.heapq_ranks:
        record["heapq"] = heapq_example(args.heapq_ranks, args.work)
    if args.skip_steps:
        args.out.write_text(json.dumps(record, indent=1) + "\n")
        return
    model = make_model(args.work / "model", prepare_default_model())
    docs = args.work / "docs"
    docs.mkdir(exist_ok=True)
    for name, text in module_documents(MODULES[:6]).items():
        (docs / f"{name}.txt").write_text(text)
    datastore = args.work / "datastore"
    if not (datastore / "manifest.json").exists():
        build_datastore([docs], datastore, model, BuildConfig(index="flat"))
    results = {ranks: measure(model, datastore, args.work, ranks, args) for ranks in (1, 2)}
    k = json.loads((datastore / "manifest.json").read_text()).get("calibration", {}) or {}
    k = k.get("k", 1024)
    bytes_a_row = k * (4 + 4 + 8) + 4 + 4 + 1
    record |= {
        "tp1": results[1],
        "tp2": results[2],
        "tp2_over_tp1_knn": round(results[2]["tokens_per_s_knn"]["median"] / results[1]["tokens_per_s_knn"]["median"], 3),
        "tp2_over_tp1_off": round(results[2]["tokens_per_s_off"]["median"] / results[1]["tokens_per_s_off"]["median"], 3),
        "gpu_estimate": {
            "k": k,
            "bytes_broadcast_a_row": bytes_a_row,
            "note": "an estimate, not a measurement: NCCL moves this in a few microseconds at hundreds of GB/s; "
            "vLLM's broadcast_object pickles it and sends its size first, about two small-message latencies "
            "(tens of microseconds) a step, beside a step of milliseconds",
        },
    }
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({k: record[k] for k in ("tp2_over_tp1_knn", "tp2_over_tp1_off")}))


if __name__ == "__main__":
    main()
