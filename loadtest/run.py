"""Load test: what kNN augmentation costs in throughput and latency, and whether the server holds up.

Traffic and percentiles come from vLLM's own serving benchmark (`vllm.benchmarks.serve`:
closed-loop concurrency, Poisson open loop, streaming, TTFT/ITL/E2E percentiles). What it cannot
do is written here: starting the kNN server, the per-request kNN switch interleaved at each load
level, scraping the server's Prometheus counters around each run (and checking the report against
them), hot-swap and shard-kill events in the middle of a run, and the plots.

    python loadtest/run.py                          # standard scenario, starts its own server
    python loadtest/run.py --base-url http://host:8000 --admin-token T   # target a running server
                                                    # (its shard kill goes through Ray: set RAY_ADDRESS to its cluster)
    python loadtest/run.py ... --record default     # also replace the tracked report loadtest/results/default/
    python loadtest/run.py --draft-tokens 4         # kNN-on runs with datastore drafts (speculative decoding)
    python loadtest/run.py --keys-file keys.yaml --api-key KEY   # a server with tenants, requests with a key
    python loadtest/run.py --prompts questions.jsonl --knn-xargs '{"knn": false, "knn_context": 1}'
                                                    # your prompts; the "on" runs put a passage in the prompt

Each run writes its report, plots and the server's log under results/loadtest/<time>/ (untracked).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import run_benchmark  # noqa: E402
from report import markdown, pair_ratios, plots  # noqa: E402
from server import admin, during, kill_one_shard, load_into_running_server, started_server, swap_root  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from wikitext import WIKITEXT, wikitext_text  # noqa: E402


def prompts_file(path: Path, count: int, words: int) -> str:
    """Prompts of `words` words from WikiText-2 test (if present) or the embedded default corpus."""
    if (WIKITEXT / "test.txt").exists():
        text = wikitext_text(WIKITEXT / "test.txt")
        source = "wikitext-2 test"
    else:
        from index_builder.default_datastore import module_documents

        text, source = "\n".join(module_documents().values()), "python stdlib docs"
    tokens = [w for w in text.split() if not w.startswith("=")]
    with open(path, "w") as f:
        for i in range(count):
            start = (i * 7919 * words) % max(1, len(tokens) - words)
            f.write(json.dumps({"prompt": " ".join(tokens[start : start + words])}) + "\n")
    return source


def own_prompts(path: Path) -> Path:
    """`path` checked as the --prompts file: JSONL, each line an object with a non-empty "prompt"."""
    try:
        lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise SystemExit(f"loadtest: --prompts {path}: cannot read it ({e})") from None
    for number, line in enumerate(lines, start=1):
        try:
            prompt = json.loads(line).get("prompt")
        except (json.JSONDecodeError, AttributeError):
            prompt = None
        if not isinstance(prompt, str) or not prompt:
            raise SystemExit(f'loadtest: --prompts {path}: line {number} is not a JSON object with a non-empty "prompt" string')
    if not lines:
        raise SystemExit(f'loadtest: --prompts {path} holds no prompts: write one {{"prompt": ...}} object per line')
    return path.resolve()


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models are local directories; never ask a hub
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=ROOT / "configs/default.yaml", help="server config to start")
    parser.add_argument("--base-url", help="target this running server instead of starting one")
    parser.add_argument("--model", help="served model name (with --base-url)")
    parser.add_argument("--tokenizer", help="the served model's directory (with --base-url)")
    parser.add_argument("--admin-token", default="loadtest-admin", help="for the swap/kill events")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY"),
        help="the API key requests send (a tenant's: knn.keys_file); default: OPENAI_API_KEY",
    )
    parser.add_argument("--keys-file", type=Path, help="the started server's knn.keys_file (give --api-key a key of it)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32, 64])
    parser.add_argument("--rate", type=float, default=2.0, help="Poisson open-loop request rate (req/s); 0 = skip")
    parser.add_argument("--prompts-per-level", type=int, default=2, help="requests per run = this x concurrency (min 8)")
    parser.add_argument(
        "--knn-xargs", type=json.loads, default={}, help="extra vllm_xargs for the kNN-on runs, e.g. '{\"knn_pointers\": 64}'"
    )
    parser.add_argument(
        "--draft-tokens",
        type=int,
        help="start the server with speculative decoding from datastore drafts (knn.draft_tokens; 0 = off); the "
        "kNN-on runs then draft, and --knn-xargs '{\"knn_drafts\": false}' turns drafting off for them",
    )
    parser.add_argument("--pairs", type=int, default=3, help="interleaved off/on pairs per level, after one warm-up pair (median reported)")
    parser.add_argument("--prompt-words", type=int, default=96, help="words per prompt cut from the corpus (without --prompts)")
    parser.add_argument(
        "--prompts",
        type=Path,
        help='send these prompts (JSONL, a "prompt" per line; other fields are ignored, so `knnlm-eval items` output works) '
        "instead of corpus windows, reused in turn when a run needs more",
    )
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument(
        "--swap-to",
        default="default",
        help="datastore directory to hot-swap the default name to mid-run; 'default' = a new version of the serving one; 'none' = no swap",
    )
    parser.add_argument(
        "--no-kill-shard", dest="kill_shard", action="store_false", help="skip killing one shard actor in the middle of a run"
    )
    parser.add_argument(
        "--datastore",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="also serve this datastore and run kNN-on at the top concurrency against it (shard-count and size scenarios); repeatable",
    )
    parser.add_argument(
        "--out", type=Path, default=ROOT / "results/loadtest", help="where each run's report, plots and logs go (untracked)"
    )
    parser.add_argument(
        "--record",
        metavar="NAME",
        help="also make this run the tracked report of scenario NAME: loadtest/results/NAME/ (report.md, report.json, the plot)",
    )
    args = parser.parse_args()

    extra = dict(item.split("=", 1) for item in args.datastore)
    if args.api_key:
        os.environ["OPENAI_API_KEY"] = args.api_key  # vLLM's benchmark client sends it as `Authorization: Bearer`
    out = args.out / datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    (out / "runs").mkdir(parents=True)
    if args.prompts:
        dataset, source = str(own_prompts(args.prompts)), shown_path(args.prompts.resolve())
    else:
        dataset = str(Path(tempfile.mkdtemp(prefix="knnlm-loadtest-")) / "prompts.jsonl")  # corpus text stays out of the repo
        count = max(8, args.prompts_per_level * max(args.concurrency)) * 2
        source = prompts_file(Path(dataset), count, args.prompt_words)

    with contextlib.ExitStack() as stack:
        if args.base_url:
            base_url, model, tokenizer = args.base_url, args.model, args.tokenizer
            load_into_running_server(base_url, args.admin_token, extra)
        else:
            print(f"loadtest: starting knnlm-serve ({args.config}) ...", flush=True)
            root = swap_root(args.config, args.swap_to)
            base_url, model, tokenizer = stack.enter_context(
                started_server(args.config, args.admin_token, root, out, extra, args.draft_tokens, args.keys_file, args.api_key)
            )
        runs = []

        def run(label, knn, concurrency=None, rate=None, prompts=None, datastore=None):
            n = prompts or max(8, args.prompts_per_level * (concurrency or 8))
            xargs = {"knn": knn, **({"knn_datastore": datastore} if datastore else {}), **(args.knn_xargs if knn else {})}
            print(f"loadtest: {label}: {xargs}, concurrency {concurrency}, rate {rate}, {n} requests", flush=True)
            result = run_benchmark(
                base_url,
                model,
                tokenizer,
                dataset,
                concurrency=concurrency,
                rate=rate,
                num_prompts=n,
                output_len=args.output_len,
                xargs=xargs,
                result_dir=out / "runs",
                label=label,
            )
            if not label.startswith("warmup"):
                runs.append(result)

        # A cold first run can be 40% off: one warm-up pair per level, then interleaved off/on pairs,
        # so machine noise hits both sides alike; the report takes the median ratio over the pairs.
        for c in args.concurrency:
            for i in range(args.pairs + 1):
                for knn in (False, True):
                    run(f"c{c}-{'on' if knn else 'off'}-{i}" if i else f"warmup-c{c}-{'on' if knn else 'off'}", knn, concurrency=c)
        if args.rate:
            for knn in (False, True):
                run(f"poisson{args.rate:g}-{'on' if knn else 'off'}", knn, rate=args.rate, prompts=16)
        c = max(args.concurrency)
        for name in extra:
            for i in range(1, args.pairs + 1):
                run(f"c{c}-off-{i}-{name}", False, concurrency=c)
                run(f"c{c}-on-{i}-{name}", True, concurrency=c, datastore=name)
        events = []
        if args.swap_to != "none":
            listing = admin(base_url, args.admin_token, "GET", "/datastores")
            name = listing["default"]
            # The listing shows paths relative to the server's knn.datastore_root, which is how a load names them.
            target = next(d["path"] for d in listing["datastores"] if d["name"] == name) if args.swap_to == "default" else args.swap_to
            path = target if args.swap_to == "default" else str(Path(target).resolve())
            events.append(
                (
                    {"event": "hot-swap", "to": target},
                    lambda: admin(base_url, args.admin_token, "POST", "/datastores", {"name": name, "path": path}),
                )
            )
        if args.kill_shard:
            events.append(({"event": "shard-kill"}, lambda: kill_one_shard(base_url, args.admin_token, not args.base_url)))
        for record, action in events:
            thread = during(1.0, action, record)
            run(f"{record['event']}-c{c}", True, concurrency=c, prompts=4 * c)
            thread.join()
            runs[-1]["event"] = record

    ratios = {f"c{c}": pair_ratios(runs, f"c{c}-{{}}-{{i}}", args.pairs) for c in args.concurrency}
    ratios.update({f"c{c} {name}": pair_ratios(runs, f"c{c}-{{}}-{{i}}-{name}", args.pairs) for name in extra})
    report = {
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{os.cpu_count()} CPU cores, no GPU",
        "commit": git_commit(),
        "server": args.base_url or shown_path(args.config),
        "prompt_source": source,
        "prompt_words": None if args.prompts else args.prompt_words,
        "output_len": args.output_len,
        "draft_tokens": args.draft_tokens,
        "knn_xargs": args.knn_xargs,
        "runs": runs,
        "on_off_ratios": ratios,
    }
    (out / "report.json").write_text(json.dumps(report, indent=2).replace(str(Path.home()), "~"))  # no machine paths
    (out / "report.md").write_text(markdown(report))
    plots(runs, out)
    print(markdown(report))
    print(f"loadtest: report in {out}")
    if args.record:
        recorded = ROOT / "loadtest/results" / args.record
        shutil.rmtree(recorded, ignore_errors=True)
        recorded.mkdir(parents=True)
        for name in RECORDED:
            shutil.copy(out / name, recorded / name)
        print(f"loadtest: recorded as {recorded.relative_to(ROOT)}; list it in docs/results.md")


RECORDED = ("report.md", "report.json", "throughput_vs_concurrency.png")


def shown_path(path: Path) -> str:
    """A config's path as a report shows it: relative to the repository, else its file name."""
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


if __name__ == "__main__":
    main()
