"""Does the passage gate let in every question the store can answer, however it is written, and keep
out the others? Pass rates per question form, with the relevance and gate a build makes now
(phrase relevance, a whole clause and every keyword counted more, fitted on held-out questions)
and those it made before (BM25 per query word, fitted on chance queries), and what a search costs.

    .venv/bin/python benchmarks/passage_gate.py        # ~1.5 min on 2 CPU cores: no LM, only its tokenizer

Corpora: task_eval's pydocs, networkx and sympy, and matplotlib, a corpus no setting was chosen on.
For each, the passage index and gate as `knnlm-index build` makes them (the same held-out split,
passages and `heldout_gate`; no keys are encoded, as none are needed for passages). Items: the
documented names (knnlm_serve.eval.doc_items) of stored documents are answerable; those of the
control documents and of the documents the build held out are off-topic, unless the stored passages
hold its description word for word (an inherited docstring: the store can answer it; counted in
`off_topic_held_verbatim`, left out of both kinds). Each is asked in FORMS,
where {M} is the name's module and {S} its description's first sentence:

  chat        a chat's user message (the server queries the last user message alone)
  completion  a completion prompt: the question inside the sentence it completes
  template    a completion prompt behind a system text, in a question-and-answer template
  keywords    the module's last name and the description's words, without English stop words
  question    knnlm-eval's question form (what benchmarks/context_eval.py asks)

Per corpus, form and measure: `pass`, the share of items that get a passage; `own`, the share
whose first passage comes from the item's own document; per corpus the search's time. Writes
benchmarks/results/passage_gate.json, .md and .png.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from run_record import run_record
from task_eval import PACKAGE_CORPORA, STDLIB_CONTROL, package_corpus, package_modules

from index_builder.corpus_keys import load_tokenizer
from index_builder.default_datastore import MODULES, module_documents
from index_builder.passages import heldout_gate, passage_rows
from knnlm_core.corpus import doc_offsets, token_ids
from knnlm_core.default_model import prepare_default_model
from knnlm_core.heldout import split_heldout
from knnlm_core.passages import BM25_PER_WORD, PHRASE, PassageIndex, words, write_passages
from knnlm_serve.eval.doc_items import definitions

CORPORA = ("pydocs", *PACKAGE_CORPORA)
FORMS = {
    "chat": "Which function of the Python module {M} does this: {S}",
    "completion": 'In the Python module {M}, the function that does the following: "{S}" is {M}.',
    "template": "You are a helpful assistant who answers questions about Python libraries. Answer with the name only.\n\n"
    "Question: Which name in {M} does this? {S}\nAnswer: {M}.",
    "keywords": "{m} {K}",
    "question": "Question: Which name in {M} does this? {S}\nAnswer: {M}.",
}
STOP_WORDS = frozenset(
    "a an the of to in on for and or is are be by with from that this which what does do it its as at into if "
    "how can not no all any each given returns return".split()
)
CHANCE_WORDS, CHANCE_QUERIES, CHANCE_PASS = 16, 200, 0.01  # the gate before: chance queries of held-out words


def corpus_documents(name: str) -> tuple[dict[str, str], dict[str, str]]:
    """(stored, control) documents by module name, as task_eval writes them."""
    stored, control = (MODULES, STDLIB_CONTROL) if name == "pydocs" else package_modules(PACKAGE_CORPORA[name])
    return module_documents(tuple(stored)), module_documents(tuple(control))


def chance_gate(index: PassageIndex, heldout_text: str) -> float:
    """The gate a build fitted before phrase relevance: the relevance (BM25 per query word) that 1%
    of queries of 16 distinct held-out words, drawn by their frequency, exceed."""
    vocabulary, rng, best = words(heldout_text), np.random.default_rng(0), []
    for _ in range(CHANCE_QUERIES):
        query: dict[str, None] = {}
        while len(query) < CHANCE_WORDS:
            query.setdefault(vocabulary[rng.integers(len(vocabulary))], None)
        found = index.search(" ".join(query), 1, BM25_PER_WORD)
        best.append(found[0].relevance if found else 0.0)
    return float(np.quantile(best, 1 - CHANCE_PASS, method="higher"))


def asked(definition, form: str) -> str:
    module = definition.name.rpartition(".")[0]
    keywords = " ".join([w for w in dict.fromkeys(words(definition.summary)) if w not in STOP_WORDS][:8])
    return FORMS[form].format(M=module, m=module.rpartition(".")[2], S=definition.summary, K=keywords)


def evaluate(name: str, tokenizer, work: Path) -> dict:
    stored, control = corpus_documents(name)
    names = list(stored)
    ids = [token_ids(tokenizer, stored[n]) for n in names]
    tokens, offsets = np.concatenate(ids), doc_offsets([len(i) for i in ids])
    held = split_heldout(tokens, offsets)
    rest = [d for d in range(len(names)) if d not in {d for d, *_ in held.spans}]  # whole documents held out: the store's rest
    rest_tokens, rest_offsets = np.concatenate([ids[d] for d in rest]), doc_offsets([len(ids[d]) for d in rest])
    path = work / f"{name}.sqlite"
    write_passages(path, passage_rows(rest_tokens, rest_offsets, tokenizer))
    started = time.perf_counter()
    fit = heldout_gate(path, held.tokens, held.offsets, tokenizer)
    fit_seconds = time.perf_counter() - started
    index = PassageIndex(path)
    gates = {PHRASE: fit["gate"], BM25_PER_WORD: chance_gate(index, tokenizer.decode(held.tokens))}
    position = {names[d]: i for i, d in enumerate(rest)}
    heldout_names = [n for n in names if n not in position]
    rows = list(passage_rows(rest_tokens, rest_offsets, tokenizer))
    held_words = " | ".join(" ".join(words(text)) for *_, text in rows)
    unheld = [
        (n, d) for texts in (control, {n: stored[n] for n in heldout_names}) for n, t in texts.items() for d in definitions(Path(n), t)
    ]
    items = {
        "answerable": [(n, d) for n in position for d in definitions(Path(n), stored[n])],
        "off-topic": [(n, d) for n, d in unheld if f" {' '.join(words(d.summary))} " not in f" {held_words} "],
    }
    rates, times = {}, {PHRASE: [], BM25_PER_WORD: []}
    for measure, gate in gates.items():
        for kind, chosen in items.items():
            for form in FORMS:
                passed = own = 0
                for document, definition in chosen:
                    started = time.perf_counter()
                    found = index.search(asked(definition, form), 1, measure)
                    times[measure].append(time.perf_counter() - started)
                    if found and found[0].relevance > gate:
                        passed += 1
                        own += found[0].document == position.get(document)
                rates.setdefault(measure, {}).setdefault(kind, {})[form] = {
                    "items": len(chosen),
                    "pass": passed / len(chosen),
                    "own": own / len(chosen),
                }
    index.close()
    return {
        "documents": {"stored": len(position), "held_out": heldout_names, "control": len(control)},
        "off_topic_held_verbatim": len(unheld) - len(items["off-topic"]),
        "passages": len(rows),
        "gate_fit": fit | {"seconds": round(fit_seconds, 2)},
        "gates": gates,
        "rates": rates,
        "search_ms": {
            m: {"median": round(1000 * float(np.median(t)), 3), "p99": round(1000 * float(np.quantile(t, 0.99)), 3)}
            for m, t in times.items()
        },
    }


def table(results: dict) -> str:
    rows = [
        "| corpus | kind | items | " + " | ".join(FORMS) + " |",
        "|---|---|---:|" + "---:|" * len(FORMS),
    ]
    for corpus, result in results.items():
        for kind in ("answerable", "off-topic"):
            before, now = result["rates"][BM25_PER_WORD][kind], result["rates"][PHRASE][kind]
            cells = [f"{before[f]['pass']:.0%} → **{now[f]['pass']:.0%}** ({now[f]['own']:.0%})" for f in FORMS]
            rows.append(f"| {corpus} | {kind} | {now['chat']['items']} | " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(4.2 * len(results), 3.8), sharey=True, squeeze=False)
    x = np.arange(len(FORMS))
    for ax, (corpus, result) in zip(axes[0], results.items()):
        for offset, measure, kind, colour, label in (
            (-0.3, BM25_PER_WORD, "answerable", "#bbbbbb", "answerable, before"),
            (-0.1, PHRASE, "answerable", "#1f77b4", "answerable, phrase relevance"),
            (0.1, BM25_PER_WORD, "off-topic", "#f4c7a1", "off-topic, before"),
            (0.3, PHRASE, "off-topic", "#d62728", "off-topic, phrase relevance"),
        ):
            ax.bar(x + offset, [result["rates"][measure][kind][f]["pass"] for f in FORMS], 0.2, color=colour, label=label)
        ax.set_xticks(x, list(FORMS), rotation=30)
        ax.set_title(f"{corpus} ({result['passages']:,} passages)")
        ax.axhline(0.9, color="#1f77b4", lw=0.6, ls=":")
        ax.axhline(0.02, color="#d62728", lw=0.6, ls=":")
    axes[0][0].set_ylabel("share of items given a passage")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpora", nargs="+", default=list(CORPORA), choices=CORPORA)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/passage_gate")
    args = parser.parse_args()
    record = run_record("passage_gate")
    tokenizer = load_tokenizer(prepare_default_model())
    with tempfile.TemporaryDirectory() as work:
        results = {name: evaluate(name, tokenizer, Path(work)) for name in args.corpora}
    corpora = {"pydocs": {"documents": list(MODULES), "control": list(STDLIB_CONTROL)}} | {
        n: package_corpus(n) for n in args.corpora if n in PACKAGE_CORPORA
    }
    out = {**record, "forms": FORMS, "corpora": {n: corpora[n] for n in args.corpora}, "results": results}
    args.out.with_suffix(".json").write_text(json.dumps(out, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(table(results))
    plot(results, args.out.with_suffix(".png"))
    print(table(results))
    print(json.dumps({n: {"gate_fit": r["gate_fit"], "search_ms": r["search_ms"]} for n, r in results.items()}, indent=1))


if __name__ == "__main__":
    main()
