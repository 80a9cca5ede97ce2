"""Is kNN-LM with datastore drafts faster than the plain model on stored text, and what does it
cost elsewhere? Generated tokens per second, greedy, through the HTTP API, on two datastores.

    .venv/bin/python benchmarks/speculation.py          # ~40 min on 2 CPU cores (three servers)

Stores (benchmarks/task_eval.py's corpora): pydocs, the embedded default datastore; networkx, a
`knnlm-index build` of the networkx algorithms' docstrings (about 135k entries). Prompts: windows of
PROMPT_TOKENS tokens at seeded places of the documents the store serves (`in_store`: the
continuation is stored text) and of its control documents (`off_store`), each continued for
--tokens tokens (ignore_eos: every request generates the same count).

Three servers (configs/default.yaml's settings, serving both stores), and the modes on them:
  * base, no speculation: `plain` (kNN off: plain vLLM), `knn` (the store's calibrated
    defaults) and `knn-strong` (λ 0.9, which follows the stored text);
  * drafts, `knn.draft_tokens`: `knn+drafts` and `knn-strong+drafts` (the same, with drafts from
    the datastore, and from prompt lookup where it has none), and `plain+drafts` (kNN off: prompt
    lookup's drafts only, through our drafter; what kNN costs beside drafts);
  * ngram, vLLM's prompt lookup: `ngram` (kNN off, vLLM's drafts; a baseline).
At each concurrency (1 and 8) and prompt set, every repeat runs each mode once, in a shuffled
order, and each ratio is taken within a repeat (against `plain`, and drafts against the same
kNN without them and against `ngram`); the report gives each ratio's median over the repeats
with its range, and per draft source (datastore, context): accepted tokens per draft, the share
of draft tokens accepted, and the share of generated tokens that were accepted drafts. Writes
benchmarks/results/speculation.json and .png.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from run_record import run_record  # noqa: E402
from task_eval import CORPORA, DEFAULT_CORPORA, prepare_corpora  # noqa: E402

from knnlm_core.default_model import prepare_default_model  # noqa: E402
from knnlm_serve.eval.doc_items import stored_hashes  # noqa: E402
from knnlm_serve.server.process import RunningServer, metric_total, scrape_metrics  # noqa: E402

PROMPT_TOKENS = 48
DRAFT_TOKENS = 4
NGRAM = {"method": "ngram", "num_speculative_tokens": DRAFT_TOKENS, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
STRONG = {"knn_lambda": 0.9}  # a λ that lets the kNN-LM follow the stored text (the calibrated ones barely move it)
MODES = {  # mode -> (server, vllm_xargs beyond the datastore's name)
    "plain": ("base", {"knn": False}),
    "knn": ("base", {}),
    "knn+drafts": ("drafts", {}),
    "knn-strong": ("base", STRONG),
    "knn-strong+drafts": ("drafts", STRONG),
    "plain+drafts": ("drafts", {"knn": False}),
    "ngram": ("ngram", {"knn": False}),
}


def prompts(documents: list[Path], count: int, tokenizer, seed: int) -> list[list[int]]:
    """`count` windows of PROMPT_TOKENS tokens, at seeded places that leave room to continue."""
    texts = [tokenizer(d.read_text(), add_special_tokens=False).input_ids for d in documents]
    texts = [t for t in texts if len(t) > PROMPT_TOKENS + 128]
    rng = random.Random(seed)
    chosen = []
    for _ in range(count):
        tokens = rng.choice(texts)
        start = rng.randrange(0, len(tokens) - PROMPT_TOKENS - 128)
        chosen.append(tokens[start : start + PROMPT_TOKENS])
    return chosen


def prompt_sets(corpora: dict, tokenizer, count: int) -> dict[str, dict[str, list[list[int]]]]:
    """store -> {in_store, off_store} prompts: served documents (matched by their text's sha256) and control ones."""
    sets = {}
    for name, (datastore, docs, control) in corpora.items():
        served = stored_hashes(datastore)
        stored = [f for f in sorted(docs.glob("*.txt")) if hashlib.sha256(f.read_text().encode()).hexdigest() in served]
        sets[name] = {
            "in_store": prompts(stored, count, tokenizer, 0),
            "off_store": prompts(sorted(control.glob("*.txt")), count, tokenizer, 1),
        }
    return sets


def tokens_per_second(server, batch: list[list[int]], tokens: int, concurrency: int, xargs: dict) -> float:
    client = server.openai_client()

    def one(prompt):
        out = client.completions.create(
            model="smollm2", prompt=prompt, max_tokens=tokens, temperature=0, extra_body={"vllm_xargs": xargs, "ignore_eos": True}
        )
        return out.usage.completion_tokens

    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        generated = sum(pool.map(one, batch))
    return generated / (time.perf_counter() - started)


SOURCES = ("datastore", "context")  # where a draft came from (engine/drafts.py)


def drafted(server, store: str) -> np.ndarray:
    """(drafts, draft tokens, accepted draft tokens) the server has counted for `store`, one row per source."""
    values = scrape_metrics(server.base_url)
    return np.array(
        [
            [
                metric_total(values, rf'knnlm_{name}_total\{{datastore="{store}",source="{source}"')
                for name in ("drafts", "draft_tokens", "draft_accepted_tokens")
            ]
            for source in SOURCES
        ]
    )


def summary(values: list[float]) -> dict:
    return {"median": round(float(np.median(values)), 3), "min": round(min(values), 3), "max": round(max(values), 3)}


def measure(servers: dict, sets: dict, args) -> dict:
    """store -> prompt set -> concurrency -> throughput and ratios."""
    results = {}
    rng = random.Random(0)
    for store, by_set in sets.items():
        for set_name, all_prompts in by_set.items():
            for concurrency in args.concurrency:
                batch = all_prompts[: max(args.prompts, 2 * concurrency)]
                # Warm-up: each mode once, unmeasured, at full length (a drafts server's first long
                # generations ran slower than its later ones).
                for server, xargs in MODES.values():
                    tokens_per_second(servers[server], batch[:concurrency], args.tokens, concurrency, {**xargs, "knn_datastore": store})
                runs = {mode: [] for mode in MODES}
                drafts = {mode: np.zeros((len(SOURCES), 3)) for mode in MODES if mode.endswith("+drafts")}
                for repeat in range(args.repeats):
                    for mode in rng.sample(list(MODES), len(MODES)):
                        server, xargs = MODES[mode]
                        label = "none" if xargs.get("knn") is False else store  # the drafts' datastore label (kNN off: none)
                        before = drafted(servers[server], label) if mode in drafts else None
                        runs[mode].append(
                            tokens_per_second(servers[server], batch, args.tokens, concurrency, {**xargs, "knn_datastore": store})
                        )
                        if before is not None:
                            drafts[mode] += drafted(servers[server], label) - before
                        print(
                            f"{store} {set_name} c{concurrency} repeat {repeat + 1}/{args.repeats} {mode}: {runs[mode][-1]:.1f} tok/s",
                            flush=True,
                        )
                generated = args.repeats * len(batch) * args.tokens
                results.setdefault(store, {}).setdefault(set_name, {})[f"c{concurrency}"] = {
                    "tokens_per_s": {mode: summary(values) for mode, values in runs.items()},
                    "over_plain": {
                        mode: summary([v / p for v, p in zip(values, runs["plain"])]) for mode, values in runs.items() if mode != "plain"
                    },
                    "drafts_over_no_drafts": {
                        mode: summary([d / k for d, k in zip(runs[mode], runs[mode.removesuffix("+drafts")])]) for mode in drafts
                    },
                    "drafts_over_ngram": {mode: summary([d / n for d, n in zip(runs[mode], runs["ngram"])]) for mode in drafts},
                    "accepted_tokens_per_draft": {
                        mode: {source: round(a / d, 3) if d else None for source, (d, _, a) in zip(SOURCES, counts)}
                        for mode, counts in drafts.items()
                    },
                    "accepted_share_of_draft_tokens": {
                        mode: {source: round(a / t, 3) if t else None for source, (_, t, a) in zip(SOURCES, counts)}
                        for mode, counts in drafts.items()
                    },
                    "drafted_share": {
                        mode: {source: round(a / generated, 3) for source, (*_, a) in zip(SOURCES, counts)}
                        for mode, counts in drafts.items()
                    },
                    "requests": len(batch),
                }
    return results


def plot(results: dict, path: Path) -> None:
    """Throughput over plain vLLM per mode (median, min-max bars), per store, prompt set and concurrency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(store, name, by_c) for store, sets in results.items() for name, by_c in sets.items()]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), sharey=True, squeeze=False)
    for ax, (store, name, by_c) in zip(axes[0], panels):
        modes = list(next(iter(by_c.values()))["over_plain"])
        width = 0.8 / len(by_c)
        for n, (concurrency, figures) in enumerate(by_c.items()):
            ratios = [figures["over_plain"][m] for m in modes]
            medians = [r["median"] for r in ratios]
            spread = [[r["median"] - r["min"] for r in ratios], [r["max"] - r["median"] for r in ratios]]
            ax.bar([k + n * width for k in range(len(modes))], medians, width, yerr=spread, capsize=2, label=concurrency)
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xticks([k + width * (len(by_c) - 1) / 2 for k in range(len(modes))], modes, rotation=30, ha="right", fontsize=8)
        ax.set_title(f"{store}, {name.replace('_', '-')}", fontsize=9)
    axes[0][0].set_ylabel("generated tok/s over plain vLLM")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def server_config(name: str, corpora: dict) -> dict:
    config = yaml.safe_load((ROOT / "configs/default.yaml").read_text())
    config.pop("port")  # three servers: each on a free port
    config["knn"]["datastores"] = {store: str(paths[0]) for store, paths in corpora.items()}
    config["knn"]["compiled_graphs"] = False  # no polling readers beside the other servers' engines
    config["vllm_args"] = ["--no-enable-prefix-caching"]  # every run replays its prompts: each prefills them anew
    if name == "drafts":
        config["knn"]["draft_tokens"] = DRAFT_TOKENS
    if name == "ngram":
        config["vllm_args"] += ["--speculative-config", json.dumps(NGRAM)]
    return config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=64, help="generated tokens per request")
    parser.add_argument("--prompts", type=int, default=4, help="requests per run (at least 2 per unit of concurrency)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats per mode")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--corpora", nargs="+", default=DEFAULT_CORPORA, choices=CORPORA)
    parser.add_argument("--work", type=Path, default=Path("/tmp/knnlm-context-eval"), help="where corpus stores are built once")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/speculation.json")
    args = parser.parse_args()
    record = run_record("speculation")
    from transformers import AutoTokenizer

    model_dir = prepare_default_model()
    corpora = prepare_corpora(args.corpora, args.work, model_dir)
    sets = prompt_sets(corpora, AutoTokenizer.from_pretrained(model_dir), max(args.prompts, 2 * max(args.concurrency)))
    with ExitStack() as stack:
        servers = {}
        for name in ("base", "drafts", "ngram"):
            print(f"starting the {name} server", flush=True)
            (args.work / f"speculation-{name}").mkdir(parents=True, exist_ok=True)
            servers[name] = stack.enter_context(RunningServer(server_config(name, corpora), args.work / f"speculation-{name}"))
        results = measure(servers, sets, args)
    report = {
        **record,
        "settings": {
            "prompt_tokens": PROMPT_TOKENS,
            "generated_tokens": args.tokens,
            "draft_tokens": DRAFT_TOKENS,
            "ngram": NGRAM,
            "repeats": args.repeats,
            "modes": {mode: {"server": server, "vllm_xargs": xargs} for mode, (server, xargs) in MODES.items()},
        },
        "results": results,
    }
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    plot(results, args.out.with_suffix(".png"))
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
