"""Does the datastore's passage in the prompt answer what kNN in the logits cannot? "Which name does
this?" from documentation, in four forms plus control items, per corpus, with kNN off, the
served kNN defaults, context alone (`knn_context`, kNN off) and context with the kNN defaults;
and what the retrieval costs a request.

    .venv/bin/python benchmarks/context_eval.py        # ~40 min on 2 CPU cores
    .venv/bin/python benchmarks/context_eval.py --chat --passages 1 --out DIR/context_eval
                                                       # each item the user's message in the chat template
    .venv/bin/python benchmarks/context_eval.py --corpora sympy --passages 1 --out DIR/context_eval
                                                       # a third corpus, no setting chosen on it
    .venv/bin/python benchmarks/context_eval.py --corpora networkx matplotlib --passages 1 --no-beside-served \
        --limit 30 --control-limit 15 --out DIR/context_eval   # half the items, without kNN beside the passage

Corpora, items and control as benchmarks/task_eval.py (pydocs: the embedded default datastore;
networkx: a `knnlm-index build` of the networkx algorithms' docstrings; sympy: the same of sympy's
modules, about 25 min more for its build; matplotlib: the same of matplotlib's), each served as built (its own calibration and passage
gate). The cost: the passage search's time for each item's question, in-process, median and p99
per corpus. Writes benchmarks/results/context_eval/<corpus>/tasks.*, and
benchmarks/results/context_eval.json, .md and .png.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from run_record import run_record  # noqa: E402
from task_eval import CORPORA, DEFAULT_CORPORA, knnlm_eval, plot, prepare_corpora, table  # noqa: E402

from knnlm_core.datastore import read_manifest  # noqa: E402
from knnlm_core.default_model import prepare_default_model  # noqa: E402
from knnlm_core.passages import PassageIndex  # noqa: E402
from knnlm_serve.eval.task_items import read_items  # noqa: E402
from knnlm_serve.server.process import RunningServer  # noqa: E402


def search_cost(datastore: Path, items: Path, count: int) -> dict:
    """The passage search's time per question (the items' prompts), in this process."""
    manifest = read_manifest(datastore)
    index = PassageIndex(datastore / manifest.passages.file.path)
    prompts = [item.prompt for item in read_items(items)]
    for prompt in prompts[:20]:  # warm the page cache
        index.search(prompt, count)
    times = []
    for prompt in prompts:
        started = time.perf_counter()
        index.search(prompt, count)
        times.append(time.perf_counter() - started)
    return {
        "entries": manifest.entries,
        "passages": len(index),
        "queries": len(times),
        "median_ms": round(1000 * float(np.median(times)), 3),
        "p99_ms": round(1000 * float(np.quantile(times, 0.99)), 3),
    }


def evaluate_corpus(name: str, datastore: Path, docs: Path, control: Path, work: Path, out: Path, args) -> dict:
    items = work / f"{name}-items.jsonl"
    knnlm_eval(
        "items", docs, "--datastore", datastore, "--control", control, "--limit", args.limit,
        "--control-limit", args.control_limit, "-o", items,
    )  # fmt: skip
    config = yaml.safe_load((ROOT / "configs/default.yaml").read_text())
    config["knn"]["datastores"] = {name: str(datastore)}
    config.pop("port")
    (work / name).mkdir(exist_ok=True)
    with RunningServer(config, work / name) as server:
        knnlm_eval(
            "tasks", items, "--base-url", server.base_url,
            "--set", f"context:knn=false,knn_context={args.passages}",
            *(["--set", f"context+served:knn_context={args.passages}"] if args.beside_served else []),
            *(["--chat"] if args.chat else []), "-o", out / name,
        )  # fmt: skip
    report = json.loads((out / name / "tasks.json").read_text())
    report["datastore_entries"] = read_manifest(datastore).entries
    report["passages"] = read_manifest(datastore).passages.model_dump(mode="json")
    report["retrieval_cost"] = search_cost(datastore, items, args.passages)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--passages", type=int, default=2, help="knn_context: passages put in the prompt")
    parser.add_argument("--chat", action="store_true", help="ask through the chat template (knnlm-eval tasks --chat)")
    parser.add_argument(
        "--beside-served",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also score the passages with the kNN defaults beside them",
    )
    parser.add_argument("--limit", type=int, default=60, help="documented names sampled per corpus from the stored documents")
    parser.add_argument("--control-limit", type=int, default=30, help="and from the control documents")
    parser.add_argument("--corpora", nargs="+", default=DEFAULT_CORPORA, choices=CORPORA)
    parser.add_argument("--work", type=Path, default=Path("/tmp/knnlm-context-eval"))
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/context_eval")
    args = parser.parse_args()
    record = run_record("context_eval")  # the commit whose code runs, whatever is committed meanwhile
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)

    corpora = prepare_corpora(args.corpora, args.work, prepare_default_model())
    reports = {name: evaluate_corpus(name, *paths, args.work, args.out, args) for name, paths in corpora.items()}
    result = {
        **record,
        "passages_per_request": args.passages,
        "chat": args.chat,
        "results": {
            name: {k: r[k] for k in ("datastore_entries", "passages", "retrieval_cost", "settings", "skipped", "summary")}
            for name, r in reports.items()
        },
    }
    (args.out.parent / "context_eval.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(reports, args.out.parent / "context_eval.png")
    (args.out.parent / "context_eval.md").write_text(table(reports))
    print(
        json.dumps(
            {n: {s: {k: round(v["exact_match"], 3) for k, v in by.items()} for s, by in r["summary"].items()} for n, r in reports.items()},
            indent=1,
        )
    )
    print(json.dumps({n: r["retrieval_cost"] for n, r in reports.items()}, indent=1))


if __name__ == "__main__":
    main()
