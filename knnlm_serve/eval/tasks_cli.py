"""`knnlm-eval items` (task items from a documentation corpus) and `knnlm-eval tasks` (score task
items through a running server)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from knnlm_core.errors import KnnlmError
from knnlm_core.flags import positive_int
from knnlm_serve.eval.doc_items import generate_items
from knnlm_serve.eval.task_items import read_items
from knnlm_serve.eval.tasks import markdown, plot, run_tasks
from knnlm_serve.eval.text import EvalError

ITEMS_USAGE = """Write task items ("which name does this?" in four forms) from a documentation corpus:
docstring-layout .txt, Markdown or reStructuredText files. Pass the documents your datastore holds,
and with --control documents it does not hold.

    knnlm-eval items docs/ --datastore datastores/mydocs --control more-docs/ -o items.jsonl
    knnlm-eval tasks items.jsonl --set strong:knn_lambda=0.5
"""


def task_main(argv: list[str]) -> None:
    """`argv` starts with the subcommand."""
    (items_main if argv[0] == "items" else tasks_main)(argv[1:])


def items_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="knnlm-eval items", description=ITEMS_USAGE, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("docs", nargs="+", type=Path, help="documents in the datastore: files or directories")
    parser.add_argument(
        "--control", nargs="+", type=Path, default=[], help="documents kept out of the datastore (items of kind control/...)"
    )
    parser.add_argument(
        "--datastore",
        type=Path,
        help="the datastore built from DOCS: a document it does not serve (held out by the build, forgotten) joins the control",
    )
    parser.add_argument("--limit", type=positive_int, default=200, help="documented names to sample from the datastore's documents")
    parser.add_argument("--control-limit", type=positive_int, default=60, help="documented names to sample from the control documents")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("-o", "--output", type=Path, default=Path("items.jsonl"))
    args = parser.parse_args(argv)
    try:
        items = generate_items(args.docs, args.control, args.limit, args.control_limit, args.seed, args.datastore)
    except KnnlmError as e:
        sys.exit(f"knnlm-eval: error: {e}")
    args.output.write_text("".join(json.dumps(item) + "\n" for item in items))
    kinds = {}
    for item in items:
        kinds[item["kind"]] = kinds.get(item["kind"], 0) + 1
    print(f"knnlm-eval: wrote {len(items)} items to {args.output} (" + ", ".join(f"{k}: {n}" for k, n in kinds.items()) + ")")


TASKS_USAGE = """Score task items through a running server (`make serve`'s by default): kNN off, the served
defaults and any --set of knobs, paired per item.

    knnlm-eval tasks items.jsonl
    knnlm-eval tasks items.jsonl --set strong:knn_lambda=0.8 --chat --base-url http://host:8000 -o results/
"""


def parse_setting(value: str) -> tuple[str, dict]:
    """NAME:knob=value,knob=value -> (NAME, vllm_xargs); values are JSON (numbers, true/false) or strings."""
    name, sep, knobs = value.partition(":")
    if not sep or not name or not knobs:
        raise argparse.ArgumentTypeError(f"{value!r}: expected NAME:knob=value[,knob=value], e.g. strong:knn_lambda=0.8")
    xargs = {}
    for pair in knobs.split(","):
        key, eq, raw = pair.partition("=")
        if not eq:
            raise argparse.ArgumentTypeError(f"{pair!r} in {value!r}: expected knob=value")
        try:
            xargs[key] = json.loads(raw)
        except json.JSONDecodeError:
            xargs[key] = raw
    return name, xargs


def tasks_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="knnlm-eval tasks", description=TASKS_USAGE, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("items", type=Path, help="JSONL: one {prompt, answer, id?, kind?} per line")
    parser.add_argument("--base-url", default="http://localhost:8000", help="the server (default: make serve's)")
    parser.add_argument("--api-key", default="EMPTY", help="the server's API key, if it has one")
    parser.add_argument("--model", help="served model name (default: the server's first)")
    parser.add_argument("--tokenizer", help="the served model's directory (default: the path the server reports, else the default model)")
    parser.add_argument("--set", action="append", type=parse_setting, default=[], metavar="NAME:KNOB=VALUE,...", help="another setting")
    parser.add_argument(
        "--chat", action="store_true", help="ask through the chat route: the prompt as the user's message, the answer as the reply"
    )
    parser.add_argument("--concurrency", type=positive_int, default=8, help="requests in flight (the server batches them)")
    parser.add_argument("-o", "--output", type=Path, default=Path("knnlm-eval-tasks"), help="directory for tasks.json/.md and the plot")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="knnlm-eval: %(message)s")
    for name in ("httpx", "httpx2"):  # the openai client's HTTP library (by version) logs a line per request
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        items = read_items(args.items)
        client, model, tokenizer = _connect(args)
        report = run_tasks(items, client, model, tokenizer, {"served": {}, **dict(args.set)}, chat=args.chat, concurrency=args.concurrency)
    except KnnlmError as e:
        sys.exit(f"knnlm-eval: error: {e}")
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "tasks.json").write_text(json.dumps({"items_file": args.items.name, "base_url": args.base_url, **report}, indent=1))
    table = markdown(report["summary"], len(report["skipped"]))
    (args.output / "tasks.md").write_text(table + "\n")
    plot(report["summary"], args.output / "tasks.png")
    print(table)
    print(f"knnlm-eval: wrote {args.output}/tasks.json, tasks.md, tasks.png")


def _connect(args):
    import openai
    from transformers import AutoTokenizer

    from knnlm_core.default_model import model_dir_for

    client = openai.OpenAI(base_url=f"{args.base_url.rstrip('/')}/v1", api_key=args.api_key)
    try:
        served = client.models.list().data
    except openai.OpenAIError as e:
        raise EvalError(
            f"no OpenAI-compatible server answers at {args.base_url} ({type(e).__name__}); start one (make serve) or pass --base-url"
        ) from None
    model = args.model or served[0].id
    root = next((m.root for m in served if m.id == model), None)
    tokenizer_dir = args.tokenizer or (root if root and Path(root).is_dir() else str(model_dir_for("default")))
    return client, model, AutoTokenizer.from_pretrained(tokenizer_dir)
