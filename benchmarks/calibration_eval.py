"""Calibrated defaults against the tuned best, on two domains: what a request with no knobs gets.

For each domain a datastore is built with `knnlm-index`'s default calibration (stride 448 instead
of 256 to halve the encode time on 2 cores; everything else default), then `knnlm-eval` scores a
held-out text through vLLM and reports the base LM, the tuned best (λ, τ, k picked on the first
20% of the text, reported on the rest) and the served defaults (the datastore's calibration),
with the gap between the last two.

  * wikitext2: datastore = WikiText-2 valid.txt, text = the first 100k characters of test.txt
    (as docs/RESULTS.md);
  * pydocs: datastore = the docstrings of 40 standard-library modules, text = those of 10 others.

    .venv/bin/python benchmarks/calibration_eval.py [--domains wikitext2 pydocs]   # ~40 min on 2 cores

Writes benchmarks/results/calibration_eval.json and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from wikitext import WIKITEXT, prepare_corpus

from index_builder.build import build_datastore
from index_builder.default_datastore import module_documents
from knnlm_core.config import BuildConfig, EvalConfig
from knnlm_core.datastore import read_manifest
from knnlm_core.default_model import prepare_default_model
from knnlm_core.manifest import MANIFEST
from knnlm_core.model_dir import cache_dir
from knnlm_serve.eval.run import evaluate

PYDOCS_INDEX = (
    "abc",
    "argparse",
    "ast",
    "asyncio",
    "base64",
    "calendar",
    "cmd",
    "codecs",
    "collections",
    "configparser",
    "contextlib",
    "copy",
    "dataclasses",
    "datetime",
    "difflib",
    "email",
    "enum",
    "filecmp",
    "fnmatch",
    "fractions",
    "functools",
    "getopt",
    "gettext",
    "glob",
    "gzip",
    "hashlib",
    "heapq",
    "hmac",
    "html",
    "http",
    "inspect",
    "ipaddress",
    "itertools",
    "json",
    "logging",
    "mailbox",
    "mimetypes",
    "numbers",
    "operator",
    "optparse",
)
PYDOCS_HELDOUT = ("pathlib", "pickle", "pprint", "queue", "random", "shutil", "string", "tarfile", "textwrap", "zipfile")
STRIDE = 448


def wikitext_inputs(work: Path) -> tuple[Path, Path]:
    return prepare_corpus(WIKITEXT / "valid.txt", 10**9, work), prepare_corpus(WIKITEXT / "test.txt", 100_000, work)


def pydocs_inputs(work: Path) -> tuple[Path, Path]:
    for name, modules in (("pydocs-index", PYDOCS_INDEX), ("pydocs-heldout", PYDOCS_HELDOUT)):
        (work / name).mkdir(parents=True, exist_ok=True)
        for module, text in module_documents(modules).items():
            (work / name / f"{module}.txt").write_text(text)
    return work / "pydocs-index", work / "pydocs-heldout"


DOMAINS = {"wikitext2": wikitext_inputs, "pydocs": pydocs_inputs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--domains", nargs="+", choices=list(DOMAINS), default=list(DOMAINS))
    parser.add_argument("--work", type=Path, default=Path("/tmp/knnlm-calibration"), help="scratch for the texts (outside the repo)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/calibration_eval.json")
    args = parser.parse_args()
    model_dir = prepare_default_model()
    args.work.mkdir(parents=True, exist_ok=True)
    results = json.loads(args.out.read_text()) if args.out.exists() else {}
    for domain in args.domains:
        corpus, text = DOMAINS[domain](args.work)
        datastore = cache_dir() / "datastores" / f"calibrated-{domain}"
        started = time.monotonic()
        if not (datastore / MANIFEST).exists():
            build_datastore([corpus], datastore, model_dir, BuildConfig(stride=STRIDE))
        manifest = read_manifest(datastore)
        run = evaluate([text], {domain: datastore}, model_dir, EvalConfig(stride=STRIDE, tune_fraction=0.2))
        s = run.summary
        results[domain] = {
            "datastore": {
                "entries": manifest.entries,
                "index": manifest.index.factory,
                "build_s": manifest.build.seconds,
                "calibration_s": manifest.build.calibration_seconds,
                "calibration": manifest.calibration.model_dump(by_alias=True),
            },
            "text": s["text"],
            "base_report_ppl": s["base"]["report_ppl"],
            "best": s["variants"][0]["best"],
            "served_defaults": s["served_defaults"],
            "seconds": round(time.monotonic() - started, 1),
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1, default=str))
    print("| domain | entries | held-out tokens | base ppl | tuned best ppl (k, τ, λ) | served defaults ppl (k, τ, λ) | gap |")
    print("|---|---:|---:|---:|---|---|---:|")
    for domain, r in results.items():
        b, d = r["best"], r["served_defaults"]
        print(
            f"| {domain} | {r['datastore']['entries']:,} | {r['datastore']['calibration']['tokens']:,} | {r['base_report_ppl']:.3f} | "
            f"{b['report_ppl']:.3f} ({b['k']}, {b['temperature']:g}, {b['lambda']:g}) | {d['report_ppl']:.3f} ({d['k']}, "
            f"{d['temperature']:g}, {d['lambda']}) | {d['gap_to_best_pct']:+.2f}% |"
        )


if __name__ == "__main__":
    main()
