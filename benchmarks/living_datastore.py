"""Living datastores: what `knnlm-index add` and `forget` cost against a rebuild, and what an
appended store serves.

    .venv/bin/python benchmarks/living_datastore.py        # WikiText-2 valid, ~45 min on 2 CPU cores
    .venv/bin/python benchmarks/corpus_1m.py --out /tmp/corpus1m
    .venv/bin/python benchmarks/living_datastore.py --bible /tmp/corpus1m \
        --out benchmarks/results/living_datastore_1m.json  # ~1.07M entries, ~90 min

WikiText-2 valid is split into its articles (one document each, un-escaped as the other
benchmarks read it); `--bible` appends the King James books of `corpus_1m.py`, one document per
chapter, so that the added share can be close to `--new-share`. In one run:
  * base: a store over every article but the last `--new-share` of the text (no calibration, so
    every article is indexed and the two stores below hold exactly the same entries);
  * add: the remaining articles added to a copy of it (wall time, the encode reported apart);
  * rebuild: one store over all articles from scratch, the same build settings;
  * perplexity on a WikiText-2 test prefix, appended against rebuilt, each at its best (k, τ, λ)
    tuned on the first 20% of the scored tokens (`knnlm-eval`'s sweep);
  * forget: one article forgotten from the appended store, then the new version checked, its
    shards opened and probed as a server's load does (`DatastoreRegistry.load`, in-process shards),
    the whole until it would serve.
Writes benchmarks/results/living_datastore.json.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from run_record import run_record  # noqa: E402
from wikitext import WIKITEXT, prepare_corpus, wikitext_text  # noqa: E402

from index_builder.add import add_documents  # noqa: E402
from index_builder.build import build_datastore  # noqa: E402
from index_builder.forget import forget_documents  # noqa: E402
from knnlm_core.config import BuildConfig, EvalConfig, KnnConfig  # noqa: E402
from knnlm_core.default_model import prepare_default_model  # noqa: E402
from knnlm_serve.eval.run import evaluate  # noqa: E402
from knnlm_serve.runtime import ServedModel  # noqa: E402
from knnlm_serve.server.registry import DatastoreRegistry  # noqa: E402

ARTICLE = re.compile(r"^ = [^=].* = $", re.MULTILINE)  # " = Title = ", not " = = Section = = "


def split_articles(text: str, out: Path) -> list[Path]:
    """One file per article, in order."""
    starts = [m.start() for m in ARTICLE.finditer(text)] + [len(text)]
    out.mkdir(parents=True, exist_ok=True)
    files = []
    for i, (a, b) in enumerate(zip(starts, starts[1:])):
        files.append(out / f"article-{i:04d}.txt")
        files[-1].write_text(text[a:b], encoding="utf-8")
    return files


def split_chapters(books: Path, out: Path) -> list[Path]:
    """One file per chapter of each book `corpus_1m.py` wrote (chapters are its paragraphs), in order."""
    files = []
    for book in sorted(books.glob("*.txt")):
        for i, chapter in enumerate(book.read_text(encoding="utf-8").split("\n\n")):
            files.append(out / f"{book.stem}-{i + 1:03d}.txt")
            files[-1].write_text(chapter.strip() + "\n", encoding="utf-8")
    return files


def timed(fn, *args, **kwargs):
    started = time.monotonic()
    result = fn(*args, **kwargs)
    return result, round(time.monotonic() - started, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new-share", type=float, default=0.01, help="share of the text added to the base store")
    parser.add_argument("--stride", type=int, default=480, help="build and eval stride (context 512)")
    parser.add_argument("--test-chars", type=int, default=100_000, help="WikiText-2 test prefix to evaluate")
    parser.add_argument("--bible", type=Path, help="a corpus_1m.py output directory: add its kjv/ books after the articles")
    parser.add_argument("--work", type=Path, default=Path("/tmp/knnlm-living"))
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/living_datastore.json")
    args = parser.parse_args()
    record = run_record("living_datastore")  # the commit whose code runs, whatever is committed meanwhile

    model_dir = prepare_default_model()
    shutil.rmtree(args.work, ignore_errors=True)
    documents = split_articles(wikitext_text(WIKITEXT / "valid.txt"), args.work / "documents")
    if args.bible:
        documents += split_chapters(args.bible / "kjv", args.work / "documents")
    sizes = [f.stat().st_size for f in documents]
    cut, total = len(documents), sum(sizes)
    while cut > 1 and sum(sizes[cut:]) < args.new_share * total:
        cut -= 1
    (args.work / "base-corpus").mkdir()
    (args.work / "new-corpus").mkdir()
    for i, f in enumerate(documents):
        shutil.copy(f, args.work / ("base-corpus" if i < cut else "new-corpus") / f.name)
    config = BuildConfig(stride=args.stride, calibrate=False, index="ivfpq")

    base, base_s = timed(build_datastore, [args.work / "base-corpus"], args.work / "base", model_dir, config)
    shutil.copytree(args.work / "base", args.work / "appended", copy_function=shutil.copy2)
    (appended, record), add_s = timed(add_documents, args.work / "appended", [args.work / "new-corpus"], model_dir)
    rebuilt, rebuild_s = timed(
        build_datastore, [args.work / "base-corpus", args.work / "new-corpus"], args.work / "rebuilt", model_dir, config
    )

    test = prepare_corpus(WIKITEXT / "test.txt", args.test_chars, args.work)
    eval_config = EvalConfig(stride=args.stride, ks=(64, 256, 1024), temperatures=(1, 2, 3, 5, 10), progress=True)
    run = evaluate([test], {"appended": args.work / "appended", "rebuilt": args.work / "rebuilt"}, model_dir, eval_config)
    best = {v["datastore"]: v["best"] for v in run.summary["variants"] if v["fraction"] == 1.0}

    registry = DatastoreRegistry(KnnConfig(backend="local"), ServedModel.inspect(model_dir), None)
    _, first_load_s = timed(registry.load, "appended", args.work / "appended")
    (_, (forgotten,)), forget_s = timed(forget_documents, args.work / "appended", documents=[3])
    _, reload_s = timed(registry.load, "appended", args.work / "appended")

    report = {
        **record,
        "corpus": {
            "source": "WikiText-2 valid.txt, one document per article"
            + (", then the King James Bible of corpus_1m.py, one document per chapter" if args.bible else ""),
            "documents": len(documents),
            "new_documents": len(documents) - cut,
        },
        "build_config": config.model_dump(mode="json"),
        "entries": {"base": base.entries, "added": record.entries, "appended": appended.entries, "rebuilt": rebuilt.entries},
        "added_share": round(record.entries / appended.entries, 4),
        "seconds": {
            "base_build": base_s,
            "add": add_s,
            "add_encode": record.encode_seconds,
            "add_without_encode": round(add_s - record.encode_seconds, 2),
            "rebuild": rebuild_s,
            "forget": forget_s,
            "load_before_forget": first_load_s,
            "load_after_forget": reload_s,
            "forget_to_serving": round(forget_s + reload_s, 2),
        },
        "add_over_rebuild": round(add_s / rebuild_s, 4),
        "add_encode_tokens_per_s_vs_build": {
            "add": round(record.entries / max(record.encode_seconds, 1e-9), 1),
            "rebuild": rebuilt.build.encode_tokens_per_s,
        },
        "forgotten": {"document": forgotten.document, "entries": forgotten.entries[1] - forgotten.entries[0]},
        "perplexity": {
            "text": run.summary["text"],
            "base_lm": run.summary["base"]["report_ppl"],
            "appended": best["appended"],
            "rebuilt": best["rebuilt"],
            "appended_over_rebuilt": round(best["appended"]["report_ppl"] / best["rebuilt"]["report_ppl"], 5),
        },
    }
    args.out.write_text(json.dumps(report, indent=1).replace(f"{args.work}/", "") + "\n")  # no machine paths
    print(json.dumps({k: report[k] for k in ("entries", "seconds", "add_over_rebuild", "perplexity")}, indent=1, default=str)[:3000])


if __name__ == "__main__":
    main()
