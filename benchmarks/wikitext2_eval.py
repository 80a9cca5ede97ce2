"""WikiText-2 reproduction of `knnlm-eval` (docs/RESULTS.md): does kNN-LM help SmolLM2 here?

    .venv/bin/python benchmarks/wikitext2_eval.py        # ~30 min on 2 CPU cores

  * main datastore: all of WikiText-2 valid.txt (or a prefix, `--valid-chars`) with the default
    build settings (ffn_input keys, context 512, `auto` index = IVF-PQ above 100k entries at the time (50k now)) except
    stride 448 (fewer re-encoded tokens) and `--keep-keys` (so the same keys are also searched
    exactly, flat L2); its random fractions give the size curve;
  * key types: ffn_input (IVF-PQ, kept keys, so also exact) and final (flat) datastores over a
    shorter valid prefix (`--keytype-chars`), to keep the second build short;
  * eval text: a prefix of test.txt (`--test-chars`); its first 20% of scored tokens tune λ, τ, k
    and the adaptive λ, the remaining 80% are reported.

WikiText is read from ../shared/data/wikitext-2 beside the repository, un-escaped (" @-@ " -> "-"
etc.) into `--work` outside the repository; datastores go to ~/.cache/knnlm-serve/datastores
(one that already exists there is reused). Results: docs/results/ (JSON, Markdown, PNGs).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from wikitext import WIKITEXT, prepare_corpus  # noqa: E402  (un-escapes and cuts at a line end)

from index_builder.build import build_datastore  # noqa: E402
from knnlm_core.config import BuildConfig, EvalConfig
from knnlm_core.default_model import prepare_default_model
from knnlm_core.manifest import MANIFEST  # noqa: E402
from knnlm_core.model_dir import cache_dir  # noqa: E402
from knnlm_serve.eval.report import markdown_table, write_report  # noqa: E402
from knnlm_serve.eval.run import evaluate  # noqa: E402


def ensure_datastore(corpus: Path, name: str, model_dir: Path, config: BuildConfig) -> Path:
    out = cache_dir() / "datastores" / name
    if not (out / MANIFEST).exists():
        build_datastore([corpus], out, model_dir, config)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--valid-chars", type=int, default=0, help="valid.txt prefix for the main datastore (0: all, ~270k tokens)")
    parser.add_argument("--keytype-chars", type=int, default=110_000, help="valid.txt prefix for ffn_input vs final (~28k tokens)")
    parser.add_argument("--test-chars", type=int, default=100_000, help="test.txt prefix to evaluate (~25k tokens)")
    parser.add_argument("--stride", type=int, default=448, help="builder and eval stride (context 512)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/knnlm-wt2"), help="scratch directory for the un-escaped text")
    parser.add_argument("--out", type=Path, default=ROOT / "docs/results")
    args = parser.parse_args()

    model_dir = prepare_default_model()
    args.work.mkdir(parents=True, exist_ok=True)
    valid = prepare_corpus(WIKITEXT / "valid.txt", args.valid_chars or 10**9, args.work)
    keytype_text = prepare_corpus(WIKITEXT / "valid.txt", args.keytype_chars, args.work)
    test = prepare_corpus(WIKITEXT / "test.txt", args.test_chars, args.work)

    main_name = f"valid{args.valid_chars // 1000}k" if args.valid_chars else "valid"
    small = f"valid{args.keytype_chars // 1000}k"
    build = BuildConfig(stride=args.stride)
    kept = {"keep_keys": True}
    datastores = {
        f"{main_name}-ffn_input": ensure_datastore(valid, f"wt2-{main_name}-ffn_input", model_dir, build.model_copy(update=kept)),
        f"{small}-ffn_input": ensure_datastore(
            keytype_text, f"wt2-{small}-ffn_input", model_dir, build.model_copy(update={**kept, "index": "ivfpq"})
        ),
        f"{small}-final": ensure_datastore(
            keytype_text, f"wt2-{small}-final", model_dir, build.model_copy(update={"key_type": "final", "index": "flat"})
        ),
    }

    config = EvalConfig(
        stride=args.stride,
        ks=(8, 64, 256, 1024),
        temperatures=(0.5, 1, 2, 3, 5, 10, 20, 50, 100),
        nprobes=(4, 128),
        exact=True,
        fractions=(0.1, 0.3),
        tune_fraction=0.2,
    )
    run = evaluate([test], datastores, model_dir, config)
    run.summary["reproduction"] = {
        "command": "benchmarks/wikitext2_eval.py " + " ".join(sys.argv[1:]),
        "valid_chars": args.valid_chars,
        "keytype_chars": args.keytype_chars,
        "test_chars": args.test_chars,
        "datastores": {n: json.loads((p / MANIFEST).read_text())["corpus"] | {"path": str(p)} for n, p in datastores.items()},
    }
    write_report(run, args.out)
    print(markdown_table(run.summary))


if __name__ == "__main__":
    main()
