"""Which retriever should find the passages `knn_context` puts in the prompt? The served one (SQLite
FTS5's BM25) against the bm25s library's BM25, two retrievers built on the datastore's own keys,
and fusions of BM25 with each, all over the same passages, on the items of benchmarks/context_eval.py.

    .venv/bin/python -m pip install -e '.[bench]'    # bm25s and PyStemmer
    .venv/bin/python benchmarks/retrievers.py        # ~5 min on 2 CPU cores once the stores exist

Retrievers, each ranking the datastore's passages (`passages.sqlite`) for an item's prompt:
  * fts5: what the server runs (knnlm_core/passages.py): FTS5, Porter-stemmed words, BM25;
  * bm25s: bm25s's BM25 (its defaults) over PyStemmer-stemmed words, English stop words removed;
  * keys-mean: the mean of the prompt's keys (the datastore's model and key type) against each
    passage's mean stored key (as the index holds them: decoded codes for PQ), both centred on the
    passages' mean and compared by cosine;
  * keys-vote: the k nearest stored entries of each of the prompt's keys, one vote each for the
    passage that holds it (what a kNN step sees, voted per passage);
  * fts5+keys-mean, fts5+keys-vote: reciprocal rank fusion (1 / (60 + rank)) of the two rankings.
A passage is a hit when it comes from the item's own document and holds the answer name as a word:
the passage the model needs in its prompt. Reported per corpus and form: the share of items with a
hit at rank 1 and within the top 2, and each retriever's time per query (median, p99; the keys
retrievers' includes encoding the prompt, a forward pass the server would add before admission).
Writes benchmarks/results/retrievers.json and .png.
"""

from __future__ import annotations

import argparse
import json
import re
import sqlite3
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from run_record import run_record
from task_eval import CORPORA, DEFAULT_CORPORA, prepare_corpora

from knnlm_core.datastore import load_document_starts, read_manifest
from knnlm_core.default_model import prepare_default_model
from knnlm_core.keys import KeyEncoder
from knnlm_core.passages import PASSAGES, PassageIndex
from knnlm_core.provenance import PROVENANCE, DocumentTable
from knnlm_core.search.merge import merge_topk
from knnlm_core.search.shard import open_shards
from knnlm_serve.eval.doc_items import generate_items

FORMS = ("stored-form", "question", "paraphrase")
TOP = 2
VOTE_K = 32
RRF_K = 60


def passage_table(datastore: Path) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Every passage's rowid and (document, start, stop), in rowid order, and its text."""
    with sqlite3.connect(f"file:{datastore / PASSAGES}?mode=ro", uri=True) as db:
        rows = db.execute("SELECT rowid, document, start, stop, text FROM passages ORDER BY rowid").fetchall()
    return np.array([r[0] for r in rows], dtype=np.int64), np.array([r[1:4] for r in rows], dtype=np.int64), [r[4] for r in rows]


def entry_passages(starts: np.ndarray, spans: np.ndarray) -> np.ndarray:
    """The passage (row of `spans`) holding each entry: entry i of document d read d's tokens up to
    position i - starts[d]."""
    ids = np.arange(starts[-1])
    documents = np.searchsorted(starts, ids, side="right") - 1
    position = ids - starts[documents]
    at = spans[:, 0] * (1 << 32) + spans[:, 1]  # passages sorted by (document, start)
    return np.searchsorted(at, documents * (1 << 32) + position, side="right") - 1


class KeyRetrievers:
    """keys-mean and keys-vote over one datastore's shards."""

    def __init__(self, datastore: Path, model_dir: Path, spans: np.ndarray, tokenizer):
        manifest = read_manifest(datastore)
        self.shards = open_shards(datastore, manifest, use_gpu=False)
        self.encoder = KeyEncoder(model_dir, manifest.key_type, "float32")
        self.tokenizer = tokenizer
        self.passage_of = entry_passages(load_document_starts(datastore, manifest), spans)
        keys = np.concatenate([s.reconstruct(np.arange(s.ntotal)) for s in self.shards])
        sums = np.zeros((len(spans), keys.shape[1]))
        np.add.at(sums, self.passage_of, keys)
        means = sums / np.maximum(np.bincount(self.passage_of, minlength=len(spans)), 1)[:, None]
        self.centre = means.mean(0)
        self.passages = unit(means - self.centre)

    def keys(self, prompt: str) -> np.ndarray:
        return self.encoder.encode([np.array(self.tokenizer(prompt).input_ids)])[0]

    def mean(self, prompt: str) -> np.ndarray:
        return np.argsort(-(self.passages @ unit(self.keys(prompt).mean(0) - self.centre)), kind="stable")

    def vote(self, prompt: str) -> np.ndarray:
        keys = self.keys(prompt)
        _, _, ids = merge_topk([s.search(keys, VOTE_K) for s in self.shards], VOTE_K)
        votes = np.bincount(self.passage_of[ids[ids >= 0]], minlength=len(self.passages))
        return np.argsort(-votes, kind="stable")[: int((votes > 0).sum())]


def unit(x: np.ndarray) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def bm25s_ranker(texts: list[str]):
    import bm25s
    import Stemmer

    stemmer = Stemmer.Stemmer("english")
    index = bm25s.BM25()
    index.index(bm25s.tokenize(texts, stopwords="en", stemmer=stemmer, show_progress=False), show_progress=False)

    def rank(prompt: str) -> np.ndarray:
        query = bm25s.tokenize([prompt], stopwords="en", stemmer=stemmer, show_progress=False)
        if not query.vocab:
            return np.zeros(0, dtype=np.int64)
        found, scores = index.retrieve(query, k=min(TOP, len(texts)), show_progress=False)
        return found[0][scores[0] > 0]

    return rank


def fused(*rankings: np.ndarray) -> np.ndarray:
    score: dict[int, float] = {}
    for ranking in rankings:
        for rank, passage in enumerate(ranking[:50].tolist()):
            score[passage] = score.get(passage, 0.0) + 1 / (RRF_K + rank + 1)
    return np.array(sorted(score, key=lambda p: -score[p]), dtype=np.int64)


def evaluate_corpus(datastore: Path, docs: Path, control: Path, model_dir: Path, limit: int) -> dict:
    from transformers import AutoTokenizer

    rowids, spans, texts = passage_table(datastore)
    row_of = {int(r): i for i, r in enumerate(rowids)}
    table = DocumentTable.read(datastore / PROVENANCE)
    documents_of: dict[str, set[int]] = {}
    for document, source in enumerate(table.source):
        documents_of.setdefault(Path(table.sources[source]).stem, set()).add(document)
    items = [i for i in generate_items([docs], [control], limit=limit, datastore=datastore) if not i["kind"].startswith("control/")]
    fts5 = PassageIndex(datastore / PASSAGES)
    keys = KeyRetrievers(datastore, model_dir, spans, AutoTokenizer.from_pretrained(model_dir))
    rankers = {
        "fts5": lambda prompt: np.array([row_of[p.id] for p in fts5.search(prompt, TOP)], dtype=np.int64),
        "bm25s": bm25s_ranker(texts),
        "keys-mean": keys.mean,
        "keys-vote": keys.vote,
    }
    for prompt in (i["prompt"] for i in items[:10]):  # warm caches and the model
        for rank in rankers.values():
            rank(prompt)
    hits = {name: {form: [] for form in FORMS} for name in [*rankers, "fts5+keys-mean", "fts5+keys-vote"]}
    times = {name: [] for name in rankers}
    for item in items:
        stem, form = item["id"].split(":")[0], item["kind"]
        holds = re.compile(rf"\b{re.escape(item['answer'].strip())}\b")
        ranked = {}
        for name, rank in rankers.items():
            started = time.perf_counter()
            ranked[name] = rank(item["prompt"])
            times[name].append(time.perf_counter() - started)
        ranked["fts5+keys-mean"] = fused(ranked["fts5"], ranked["keys-mean"])
        ranked["fts5+keys-vote"] = fused(ranked["fts5"], ranked["keys-vote"])
        for name, ranking in ranked.items():
            good = [int(spans[p, 0]) in documents_of.get(stem, ()) and bool(holds.search(texts[p])) for p in ranking[:TOP].tolist()]
            hits[name][form].append([any(good[:1]), any(good[:TOP])])
    return {
        "entries": read_manifest(datastore).entries,
        "passages": len(spans),
        "items": {form: len(hits["fts5"][form]) for form in FORMS},
        "hit_at_1": {name: {form: round(float(np.mean([h[0] for h in v])), 3) for form, v in by.items()} for name, by in hits.items()},
        f"hit_at_{TOP}": {name: {form: round(float(np.mean([h[1] for h in v])), 3) for form, v in by.items()} for name, by in hits.items()},
        "query_ms": {
            name: {"median": round(1000 * float(np.median(t)), 2), "p99": round(1000 * float(np.quantile(t, 0.99)), 2)}
            for name, t in times.items()
        },
    }


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    corpora = list(results)
    names = list(results[corpora[0]]["hit_at_1"])
    fig, axes = plt.subplots(1, len(corpora), figsize=(6 * len(corpora), 4), squeeze=False)
    for ax, corpus in zip(axes[0], corpora):
        width = 0.8 / len(FORMS)
        for j, form in enumerate(FORMS):
            ax.bar(np.arange(len(names)) + j * width, [results[corpus]["hit_at_1"][n][form] for n in names], width, label=form)
        ax.set_xticks(np.arange(len(names)) + width, names, rotation=30, ha="right")
        ax.set_ylim(0, 1)
        ax.set_title(f"{corpus}: {results[corpus]['passages']} passages")
        ax.set_ylabel("the item's passage ranked first")
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--limit", type=int, default=60, help="documented names sampled per corpus (context_eval's items)")
    parser.add_argument("--corpora", nargs="+", default=DEFAULT_CORPORA, choices=CORPORA)
    parser.add_argument("--work", type=Path, default=Path("/tmp/knnlm-context-eval"), help="where corpus stores are built once")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/retrievers.json")
    args = parser.parse_args()
    try:
        import bm25s  # noqa: F401
        import Stemmer  # noqa: F401
    except ImportError:
        sys.exit("benchmarks/retrievers.py compares with bm25s: install it with `.venv/bin/python -m pip install -e '.[bench]'`")
    model_dir = prepare_default_model()
    args.work.mkdir(parents=True, exist_ok=True)
    results = {}
    for name, (datastore, docs, control) in prepare_corpora(args.corpora, args.work, model_dir).items():
        print(f"{name}: ranking passages", flush=True)
        results[name] = evaluate_corpus(datastore, docs, control, model_dir, args.limit)
        print(json.dumps(results[name]["hit_at_1"]), flush=True)
    report = {**run_record("retrievers"), "settings": {"top": TOP, "vote_k": VOTE_K, "rrf_k": RRF_K}}
    report["results"] = results
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    plot(results, args.out.with_suffix(".png"))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
