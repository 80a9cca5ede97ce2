"""`knnlm-eval`: does kNN-LM help on this text, by how much, and with which settings?
(`knnlm-eval tasks ITEMS.jsonl`: on the user's own task items, through a running server.)

    knnlm-eval heldout.txt --datastore wiki=datastores/wiki -o results/
    knnlm-eval heldout.txt --datastore ffn=ds/ffn --datastore final=ds/final --exact --nprobe 8 32 128 \\
        --fractions 0.1 0.3 --lambdas 0 0.1 0.2 0.3 --temperatures 1 10 100 --ks 64 1024 -o results/
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from pydantic import ValidationError

from knnlm_core.config import EvalConfig, validation_message
from knnlm_core.default_model import DEFAULT_MODEL, model_dir_for
from knnlm_core.errors import KnnlmError
from knnlm_serve.eval.report import markdown_table, write_report
from knnlm_serve.eval.run import evaluate
from knnlm_serve.eval.task_items import read_items
from knnlm_serve.eval.tasks import markdown, plot, run_tasks
from knnlm_serve.eval.text import EvalError

DEFAULTS = EvalConfig()


def parse_datastore(value: str) -> tuple[str, str]:
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"{value!r}: expected NAME=PATH")
    return name, path


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["tasks"]:
        return tasks_main(argv[1:])
    parser = argparse.ArgumentParser(prog="knnlm-eval", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inputs", nargs="+", help="held-out text: .txt/.md/.rst/.jsonl files (optionally .gz) or directories")
    parser.add_argument(
        "--datastore",
        action="append",
        type=parse_datastore,
        required=True,
        metavar="NAME=PATH",
        help="a datastore to compare (repeatable); the first is also scored through vLLM with kNN on",
    )
    parser.add_argument("--model", default=DEFAULT_MODEL, help='"default" (SmolLM2) or an HF causal-LM directory')
    parser.add_argument("-o", "--output", type=Path, default=Path("knnlm-eval-results"), help="directory for results.json/.md and plots")
    parser.add_argument("--context-length", type=int, default=DEFAULTS.context_length, help="tokens per window")
    parser.add_argument("--stride", type=int, default=DEFAULTS.stride, help="scored (new) tokens per window")
    parser.add_argument("--lambdas", type=float, nargs="+", default=DEFAULTS.lambdas)
    parser.add_argument("--temperatures", type=float, nargs="+", default=DEFAULTS.temperatures)
    parser.add_argument("--ks", type=int, nargs="+", default=DEFAULTS.ks)
    parser.add_argument("--nprobe", type=int, nargs="+", default=(), help="IVF datastores: also search at these nprobe")
    parser.add_argument("--exact", action="store_true", help="also search exactly (needs a datastore built with --keep-keys)")
    parser.add_argument("--fractions", type=float, nargs="+", default=(), help="also use random fractions of the first datastore")
    parser.add_argument("--tune-fraction", type=float, default=DEFAULTS.tune_fraction, help="share of scored tokens (first) used to tune")
    parser.add_argument("--text-field", default=DEFAULTS.text_field, help="field holding the text in .jsonl inputs")
    parser.add_argument("--kv-cache-gib", type=float, default=DEFAULTS.kv_cache_gib)
    parser.add_argument("--per-token", action="store_true", help="also write tokens.npz (per-token log-probabilities)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format="knnlm-eval: %(message)s")
    try:
        try:
            config = EvalConfig(
                context_length=args.context_length,
                stride=args.stride,
                lambdas=tuple(args.lambdas),
                temperatures=tuple(args.temperatures),
                ks=tuple(sorted(args.ks)),
                nprobes=tuple(args.nprobe),
                exact=args.exact,
                fractions=tuple(args.fractions),
                tune_fraction=args.tune_fraction,
                text_field=args.text_field,
                kv_cache_gib=args.kv_cache_gib,
                progress=not args.quiet,
            )
        except ValidationError as e:
            raise EvalError(validation_message(e)) from None
        run = evaluate(args.inputs, dict(args.datastore), model_dir_for(args.model), config)
    except KnnlmError as e:
        sys.exit(f"knnlm-eval: error: {e}")
    written = write_report(run, args.output, per_token=args.per_token)
    print(markdown_table(run.summary))
    print("knnlm-eval: wrote " + ", ".join(map(str, written)))


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
    parser.add_argument("--chat", action="store_true", help="prompts as the user's message in the model's chat template")
    parser.add_argument("-o", "--output", type=Path, default=Path("knnlm-eval-tasks"), help="directory for tasks.json/.md and the plot")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="knnlm-eval: %(message)s")
    try:
        items = read_items(args.items)
        client, model, tokenizer = _connect(args)
        report = run_tasks(items, client, model, tokenizer, {"served": {}, **dict(args.set)}, chat=args.chat)
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


if __name__ == "__main__":
    main()
