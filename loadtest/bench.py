"""One run of vLLM's own serving benchmark against the server, with the server's Prometheus
counters scraped around it: the run's figures and how its kNN work split per step."""

from __future__ import annotations

import json
from pathlib import Path

from knnlm_serve.engine.step_clock import PARTS
from knnlm_serve.server.process import metric_total, scrape_metrics

PERCENTILES = "50,90,99"


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
    # The same, part by part (engine/step_clock.py): they add up to "all".
    server["ms_per_step_part"] = {part: 1e3 * delta(rf'knnlm_step_part_seconds_total\{{part="{part}"\}}') / steps for part in PARTS}
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
