"""Load test: what kNN augmentation costs in throughput and latency, and whether the server holds up.

Traffic and percentiles come from vLLM's own serving benchmark (`vllm.benchmarks.serve`:
closed-loop concurrency, Poisson open loop, streaming, TTFT/ITL/E2E percentiles). What it cannot
do is written here: starting the kNN server, the per-request kNN switch interleaved at each load
level, scraping the server's Prometheus counters around each run (and checking the report against
them), hot-swap and shard-kill events in the middle of a run, and the plots.

    python loadtest/run.py                          # standard scenario, starts its own server
    python loadtest/run.py --base-url http://host:8000 --admin-token T   # target a running server
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from knnlm_serve.server.process import metric_total, scrape_metrics

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from wikitext import WIKITEXT, wikitext_text  # noqa: E402

PERCENTILES = "50,90,99"


def prompts_file(path: Path, count: int, words: int) -> str:
    """Prompts of `words` words from WikiText-2 test (if present) or the embedded default corpus."""
    if (WIKITEXT / "test.txt").exists():
        text = wikitext_text(WIKITEXT / "test.txt")
        source = "wikitext-2 test"
    else:
        from index_builder.default_datastore import stdlib_documents

        text, source = "\n".join(stdlib_documents().values()), "python stdlib docs"
    tokens = [w for w in text.split() if not w.startswith("=")]
    with open(path, "w") as f:
        for i in range(count):
            start = (i * 7919 * words) % max(1, len(tokens) - words)
            f.write(json.dumps({"prompt": " ".join(tokens[start : start + words])}) + "\n")
    return source


def run_benchmark(
    base_url: str,
    model: str,
    tokenizer: str,
    dataset: str,
    *,
    concurrency: int | None,
    rate: float | None,
    num_prompts: int,
    output_len: int,
    xargs: dict,
    result_dir: Path,
    label: str,
) -> dict:
    """One `vllm bench serve` run in this process, with the server's counters scraped around it."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    argv = [
        "--backend",
        "openai",
        "--base-url",
        base_url,
        "--endpoint",
        "/v1/completions",
        "--model",
        model,
        "--tokenizer",
        tokenizer,
        "--dataset-name",
        "custom",
        "--dataset-path",
        dataset,
        "--skip-chat-template",
        "--num-prompts",
        str(num_prompts),
        "--custom-output-len",
        str(output_len),
        "--ignore-eos",
        "--temperature",
        "0",
        "--extra-body",
        json.dumps({"vllm_xargs": xargs}),
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        PERCENTILES,
        "--save-result",
        "--result-dir",
        str(result_dir),
        "--result-filename",
        f"{label}.json",
        "--request-rate",
        str(rate) if rate else "inf",
        "--disable-tqdm",
    ]
    if concurrency:
        argv += ["--max-concurrency", str(concurrency)]
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(argv)
    before = scrape_metrics(base_url)
    result = main(args)
    after = scrape_metrics(base_url)

    def delta(pattern: str) -> float:
        return metric_total(after, pattern) - metric_total(before, pattern)

    server = {
        "requests": delta(r"vllm:request_success_total"),
        "output_tokens": delta(r"vllm:generation_tokens_total"),
        "knn_steps": delta(r"knnlm_step_seconds_count"),
        "knn_step_seconds": delta(r"knnlm_step_seconds_sum"),
        "search_steps": delta(r"knnlm_retrieval_steps_total"),
        "knn_retrieval_seconds": delta(r"knnlm_retrieval_seconds_sum"),
        "knn_slowest_shard_seconds": delta(r"knnlm_slowest_shard_search_seconds_sum"),
        "knn_wait_seconds": delta(r"knnlm_retrieval_wait_seconds_sum"),
        "knn_interpolation_seconds": delta(r"knnlm_interpolation_seconds_sum"),
        "knn_fallbacks": delta(r"knnlm_fallbacks_total"),
        # rows of kNN requests: searched, served p_LM (adaptive retrieval), or from pointers
        "rows": {
            "searched": delta(r"knnlm_queries_total"),
            "skipped": delta(r"knnlm_skipped_rows_total"),
            "pointers": delta(r"knnlm_pointer_rows_total"),
        },
    }
    # The engine runs one step at a time, so kNN's share of its time is the kNN work on the steps' path.
    server["knn_share_of_wall"] = server["knn_step_seconds"] / result["duration"]
    # Per step with kNN rows, what kNN held the step for: all of it (planning, log-softmax and skip
    # rule, keys, pointer candidates, sending and waiting for the search, mix), of which the wait
    # for the search (with knn.overlap, what the end of the forward pass did not hide) and the mix.
    steps = max(server["knn_steps"], 1)
    server["ms_per_step"] = {
        "all": 1e3 * server["knn_step_seconds"] / steps,
        "waited": 1e3 * server["knn_wait_seconds"] / steps,
        "mix": 1e3 * server["knn_interpolation_seconds"] / steps,
    }
    # Per search, its span from sending to collecting: the slowest shard's FAISS time (the fan-out
    # waits for it) and the rest (Ray transport, merge; with knn.overlap also the end of the
    # forward pass that ran meanwhile, so this span is not all on the step's path).
    searches = max(server["search_steps"], 1)
    server["search_ms"] = {
        "slowest_shard": 1e3 * server["knn_slowest_shard_seconds"] / searches,
        "rest_of_span": 1e3 * (server["knn_retrieval_seconds"] - server["knn_slowest_shard_seconds"]) / searches,
    }
    server["requests_match_1pct"] = abs(server["requests"] - result["completed"]) <= 0.01 * max(1, result["completed"])
    server["tokens_match_1pct"] = abs(server["output_tokens"] - result["total_output_tokens"]) <= 0.01 * max(
        1, result["total_output_tokens"]
    )
    keep = {k: v for k, v in result.items() if not isinstance(v, list)}
    return {**keep, "label": label, "knn": xargs["knn"], "xargs": xargs, "concurrency": concurrency, "rate": rate, "server": server}


def admin(base_url: str, token: str, method: str, route: str, body: dict | None = None) -> dict:
    request = urllib.request.Request(
        f"{base_url}/v1/knn{route}",
        method=method,
        headers={"X-Admin-Token": token, "Content-Type": "application/json"},
        data=json.dumps(body).encode() if body else None,
    )
    return json.loads(urllib.request.urlopen(request, timeout=300).read())


def during(delay_s: float, action, record: dict) -> threading.Thread:
    """Run `action` once, `delay_s` into the next run (hot-swap / shard-kill); note what happened."""

    def fire():
        time.sleep(delay_s)
        start = time.monotonic()
        try:
            action()
            record.update(ok=True)
        except Exception as e:  # noqa: BLE001 - reported, not raised: the run goes on
            record.update(ok=False, error=repr(e))
        record.update(at_s=delay_s, took_s=round(time.monotonic() - start, 2))

    thread = threading.Thread(target=fire, daemon=True)
    thread.start()
    return thread


def kill_one_shard(base_url: str, token: str) -> None:
    import ray

    health = admin(base_url, token, "GET", "/health")
    actor = health["shards"][0]["actor"]
    ray.init(address="auto", namespace="knnlm", log_to_driver=False)
    try:
        ray.kill(ray.get_actor(actor), no_restart=False)
    finally:
        ray.shutdown()


def swap_root(config: Path, swap_to: str) -> Path:
    """The datastore root the started server needs so the mid-run hot-swap is allowed."""
    import yaml

    from knnlm_core.model_dir import cache_dir

    if swap_to not in ("default", "none"):
        return Path(swap_to).resolve().parent
    knn = yaml.safe_load(config.read_text()).get("knn", {})
    name = knn.get("default_datastore") or next(iter(knn.get("datastores", {})), None)
    path = knn.get("datastores", {}).get(name, "default")
    return cache_dir() / "datastores" if path == "default" else Path(path).resolve().parent


@contextlib.contextmanager
def started_server(config: Path, admin_token: str, datastore_root: Path, log_dir: Path, extra_datastores: dict[str, str]):
    import yaml

    from knnlm_core.default_model import resolve_model
    from knnlm_serve.server.process import RunningServer

    settings = yaml.safe_load(config.read_text())
    # Off and on runs replay the same prompts: without this the second run would hit the prefix cache.
    settings["vllm_args"] = [*settings.get("vllm_args", []), "--no-enable-prefix-caching"]
    knn = settings.setdefault("knn", {})
    knn.update(admin_token=admin_token, datastore_root=str(datastore_root))
    knn["datastores"] = {**knn.get("datastores", {}), **extra_datastores}
    with RunningServer(settings, log_dir) as server:
        yield server.base_url, settings.get("served_model_name") or "default", str(resolve_model(settings.get("model", "default")))


def plots(runs: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    closed = [r for r in runs if r["concurrency"] and "event" not in r and re.fullmatch(r"c\d+-(on|off)-1", r["label"])]
    fig, ax = plt.subplots(figsize=(6, 4))
    for knn in (False, True):
        points = sorted((r["concurrency"], r["output_throughput"]) for r in closed if r["knn"] == knn)
        ax.plot(*zip(*points), marker="o", label=f"kNN {'on' if knn else 'off'}")
    ax.set(xscale="log", xlabel="concurrency", ylabel="output tokens/s", title="Throughput (CPU)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "throughput_vs_concurrency.png", dpi=120)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, metric in zip(axes, ("itl", "e2el")):
        for knn in (False, True):
            for p, style in (("50", "-"), ("99", "--")):
                points = sorted((r["concurrency"], r[f"p{p}_{metric}_ms"]) for r in closed if r["knn"] == knn)
                ax.plot(*zip(*points), style, marker="o", label=f"p{p} kNN {'on' if knn else 'off'}")
        ax.set(xscale="log", xlabel="concurrency", ylabel="ms", title={"itl": "inter-token latency", "e2el": "end-to-end latency"}[metric])
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "latency_vs_concurrency.png", dpi=120)


def pair_ratios(runs: list[dict], pattern: str, pairs: int) -> dict:
    """Per metric, the on/off ratio of each interleaved pair, its median and spread, and the ITL percentiles."""
    by_label = {r["label"]: r for r in runs}
    pair = [(by_label[pattern.format("on", i=i)], by_label[pattern.format("off", i=i)]) for i in range(1, pairs + 1)]
    out = {}
    for name, metric in (
        ("throughput", "output_throughput"),
        ("p50_itl", "p50_itl_ms"),
        ("p99_itl", "p99_itl_ms"),
        ("p99_e2el", "p99_e2el_ms"),
    ):
        values = [on[metric] / off[metric] for on, off in pair]
        out[name] = {"median": float(np.median(values)), "min": min(values), "max": max(values), "pairs": values}
    for side, index in (("on", 0), ("off", 1)):
        out[f"itl_ms_{side}"] = {p: float(np.median([x[index][f"{p}_itl_ms"] for x in pair])) for p in ("p50", "p99")}
    return out


def load_into_running_server(base_url: str, token: str, datastores: dict[str, str]) -> None:
    """--base-url with --datastore: load each through the admin API, or stop before sending any traffic."""
    for name, path in datastores.items():
        try:
            admin(base_url, token, "POST", "/datastores", {"name": name, "path": path})
        except urllib.error.HTTPError as e:
            raise SystemExit(
                f"loadtest: error: the server at {base_url} did not load datastore {name}={path} "
                f"(HTTP {e.code}: {e.read().decode()[:300]}); check --admin-token and that PATH is under its knn.datastore_root"
            ) from None


def markdown(report: dict) -> str:
    lines = [
        f"# Load test ({report['created']}, {report['machine']})",
        "",
        f"Server: {report['server']}; prompts: {report['prompt_source']}, {report['prompt_words']} words, "
        f"{report['output_len']} output tokens, streaming.",
        "",
        "| run | kNN | conc. | rate | req/s | out tok/s | TTFT p50/p99 ms | ITL p50/p99 ms | E2E p50/p99 ms | errors | kNN share of wall | kNN ms/step: all / waited / mix | search ms: slowest shard / rest of span | rows searched / skipped / pointers | server counters match |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|---|",
    ]
    for r in report["runs"]:
        s = r["server"]
        label = r["label"] + (
            f" ({r['event']['event']} at {r['event']['at_s']:g} s: {'ok' if r['event'].get('ok') else r['event'].get('error')})"
            if "event" in r
            else ""
        )
        lines.append(
            f"| {label} | {'on' if r['knn'] else 'off'} | {r['concurrency'] or '-'} | {r['rate'] or '-'} | "
            f"{r['request_throughput']:.2f} | {r['output_throughput']:.1f} | {r['p50_ttft_ms']:.0f}/{r['p99_ttft_ms']:.0f} | "
            f"{r['p50_itl_ms']:.0f}/{r['p99_itl_ms']:.0f} | {r['p50_e2el_ms']:.0f}/{r['p99_e2el_ms']:.0f} | {r['failed']} | "
            f"{s['knn_share_of_wall']:.1%} | "
            + (" / ".join(f"{v:.1f}" for v in s["ms_per_step"].values()) if s["knn_steps"] else "-")
            + " | "
            + (" / ".join(f"{v:.1f}" for v in s["search_ms"].values()) if s["search_steps"] else "-")
            + " | "
            + (" / ".join(f"{v:.0f}" for v in s["rows"].values()) if r["knn"] else "-")
            + f" | {'yes' if s['requests_match_1pct'] and s['tokens_match_1pct'] else 'NO'} |"
        )
    lines += [
        "",
        "Median over the interleaved pairs (min–max), after a warm-up pair:",
        "",
        "| level | throughput on/off | ITL p50 on/off | ITL p99 on/off | E2E p99 on/off | ITL p50/p99 ms off | ITL p50/p99 ms on |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for level, r in report["on_off_ratios"].items():
        cells = " | ".join(
            f"{r[m]['median']:.3f} ({r[m]['min']:.2f}–{r[m]['max']:.2f})" for m in ("throughput", "p50_itl", "p99_itl", "p99_e2el")
        )
        lines.append(
            f"| {level} | {cells} | {r['itl_ms_off']['p50']:.0f}/{r['itl_ms_off']['p99']:.0f} | {r['itl_ms_on']['p50']:.0f}/{r['itl_ms_on']['p99']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models are local directories; never ask a hub
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=ROOT / "configs/default.yaml", help="server config to start")
    parser.add_argument("--base-url", help="target this running server instead of starting one")
    parser.add_argument("--model", help="served model name (with --base-url)")
    parser.add_argument("--tokenizer", help="the served model's directory (with --base-url)")
    parser.add_argument("--admin-token", default="loadtest-admin", help="for the swap/kill events")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32, 64])
    parser.add_argument("--rate", type=float, default=2.0, help="Poisson open-loop request rate (req/s); 0 = skip")
    parser.add_argument("--prompts-per-level", type=int, default=2, help="requests per run = this x concurrency (min 8)")
    parser.add_argument(
        "--knn-xargs", type=json.loads, default={}, help="extra vllm_xargs for the kNN-on runs, e.g. '{\"knn_pointers\": 64}'"
    )
    parser.add_argument("--pairs", type=int, default=3, help="interleaved off/on pairs per level, after one warm-up pair (median reported)")
    parser.add_argument("--prompt-words", type=int, default=96)
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
    parser.add_argument("--out", type=Path, default=ROOT / "loadtest/results")
    args = parser.parse_args()

    extra = dict(item.split("=", 1) for item in args.datastore)
    out = args.out / datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    (out / "runs").mkdir(parents=True)
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
            base_url, model, tokenizer = stack.enter_context(started_server(args.config, args.admin_token, root, out, extra))
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
            events.append(({"event": "shard-kill"}, lambda: kill_one_shard(base_url, args.admin_token)))
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
        "server": args.base_url or str(args.config),
        "prompt_source": source,
        "prompt_words": args.prompt_words,
        "output_len": args.output_len,
        "runs": runs,
        "on_off_ratios": ratios,
    }
    (out / "report.json").write_text(json.dumps(report, indent=2))
    (out / "report.md").write_text(markdown(report))
    plots(runs, out)
    print(markdown(report))
    print(f"loadtest: report in {out}")


if __name__ == "__main__":
    main()
