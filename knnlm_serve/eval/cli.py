"""`knnlm-eval`: does kNN-LM help on this text, by how much, and with which settings?
(`knnlm-eval items DOCS` and `knnlm-eval tasks ITEMS.jsonl`: on task items, through a running server.)

    knnlm-eval heldout.txt --datastore wiki=datastores/wiki -o results/
    knnlm-eval heldout.txt --datastore ffn=ds/ffn --datastore final=ds/final --exact --nprobe 8 32 128 \\
        --fractions 0.1 0.3 --lambdas 0 0.1 0.2 0.3 --temperatures 1 10 100 --ks 64 1024 -o results/
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from pydantic import ValidationError

from knnlm_core.config import EvalConfig
from knnlm_core.config_file import flag_message
from knnlm_core.default_model import DEFAULT_MODEL, model_dir_for
from knnlm_core.errors import KnnlmError
from knnlm_serve.eval.report import markdown_table, write_report
from knnlm_serve.eval.run import evaluate
from knnlm_serve.eval.tasks_cli import task_main
from knnlm_serve.eval.text import EvalError

DEFAULTS = EvalConfig()


def parse_datastore(value: str) -> tuple[str, str]:
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"{value!r}: expected NAME=PATH")
    return name, path


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["tasks"], ["items"]):
        return task_main(argv)
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
    if args.quiet:
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"  # transformers' model-loading bar too (read when it is imported)
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
            raise EvalError(flag_message(e, {"nprobes": "--nprobe"})) from None
        run = evaluate(args.inputs, dict(args.datastore), model_dir_for(args.model), config)
    except KnnlmError as e:
        sys.exit(f"knnlm-eval: error: {e}")
    written = write_report(run, args.output, per_token=args.per_token)
    print(markdown_table(run.summary))
    print("knnlm-eval: wrote " + ", ".join(map(str, written)))


if __name__ == "__main__":
    main()
