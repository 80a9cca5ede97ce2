"""The passage index of a datastore (in-context retrieval): built with it, grown by add, and
rewritten without forgotten documents by forget and compact (real SQLite FTS5, tiny model)."""

from __future__ import annotations

import sqlite3
from contextlib import closing
from pathlib import Path

import numpy as np
import pytest
from test_index_builder import SMALL

from index_builder.add import add_documents
from index_builder.build import build_datastore
from index_builder.compact import compact_datastore
from index_builder.default_datastore import module_documents
from index_builder.forget import forget_documents
from knnlm_core.datastore import read_manifest, verify_checksums
from knnlm_core.manifest import PassageIndexEntry
from knnlm_core.passages import BM25_PER_WORD, PASSAGE_TOKENS, PHRASE, PassageIndex, passage_spans, write_passages
from knnlm_core.provenance import Provenance
from knnlm_core.relevance import ALL_WORDS_SHARE, COVERED_SHARE, Query, Vocabulary, passage_relevance, phrase_and_relevance, words

WORD = "quetzalcoatlfjord"  # in no stored document until the fact is added
FACT = f"The harbour of {WORD} opens its gates at dawn for the blue boats only."


def search(root: Path, text: str, k: int = 3):
    manifest = read_manifest(root)
    index = PassageIndex(root / manifest.passages.file.path)
    try:
        return index.search(text, k)
    finally:
        index.close()


def test_documents_are_cut_into_fixed_passages_and_a_short_tail_joins_the_one_before():
    spans = passage_spans(np.array([300, 20, PASSAGE_TOKENS + 1]))
    assert spans.tolist() == [[0, 0, 128], [0, 128, 256], [0, 256, 300], [1, 0, 20], [2, 0, 129]]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """The embedded default datastore's documents: enough text to hold a calibration slice out."""
    folder = tmp_path_factory.mktemp("corpus")
    for name, text in module_documents().items():
        (folder / f"{name}.txt").write_text(text)
    return folder


def test_a_build_indexes_every_stored_document_into_passages_with_a_calibrated_gate(corpus, tiny_model_dir, tmp_path):
    root = tmp_path / "ds"
    build_datastore([corpus], root, tiny_model_dir, SMALL, progress=False)
    manifest = read_manifest(root)
    verify_checksums(root, manifest)  # the passage file is checksummed like every other
    provenance = Provenance.open(root, manifest)
    lengths = np.diff(provenance.starts) + 1
    assert manifest.passages.passages == len(passage_spans(lengths)) > len(lengths)
    gate = manifest.passages
    assert gate.relevance == PHRASE and gate.gate is not None and gate.gate_questions >= 20
    assert gate.gate_answerable_pass > 0.5 > gate.gate_offtopic_pass, gate  # held-out questions pass against their own documents only
    (hit,) = search(root, "heap queue algorithm priority queue", 1)
    assert provenance.table.describe(hit.document)["source"] == "heapq.txt" and hit.relevance > manifest.passages.gate


def test_add_forget_and_compact_keep_the_passages_in_step_and_a_forgotten_one_leaves_the_file(corpus, tiny_model_dir, tmp_path):
    root = tmp_path / "ds"
    build_datastore([corpus], root, tiny_model_dir, SMALL.model_copy(update={"calibrate": False}), progress=False)
    (tmp_path / "fact.txt").write_text(FACT)
    assert search(root, WORD) == []

    _, record = add_documents(root, [tmp_path / "fact.txt"], tiny_model_dir, progress=False)

    (hit,) = search(root, f"When does the harbour of {WORD} open?", 1)
    assert hit.document == record.first_document and WORD in hit.text
    file = root / read_manifest(root).passages.file.path
    assert WORD.encode() in file.read_bytes()

    forget_documents(root, documents=[record.first_document, 3])

    manifest = read_manifest(root)
    assert all(h.document not in (record.first_document, 3) for h in search(root, f"{WORD} harbour gates", 50))
    assert WORD.encode() not in (root / manifest.passages.file.path).read_bytes()
    verify_checksums(root, manifest)
    before = {h.text: h.document for h in search(root, "parse command line arguments", 5)}

    compact_datastore(root, progress=False)

    after = {h.text: h.document for h in search(root, "parse command line arguments", 5)}
    assert after.keys() == before.keys() and all(after[t] == before[t] - (before[t] > 3) for t in after)  # numbers close up


@pytest.fixture(scope="module")
def doc_index(corpus, tmp_path_factory) -> PassageIndex:
    """The embedded store's documents cut into paragraphs, one passage each (no tokenizer needed)."""
    rows, names = [], sorted(corpus.glob("*.txt"))
    for document, path in enumerate(names):
        for start, paragraph in enumerate(p for p in path.read_text().split("\n\n") if p.strip()):
            rows.append((document, start, start + 1, paragraph))
    path = tmp_path_factory.mktemp("passages") / "passages.sqlite"
    write_passages(path, rows)
    index = PassageIndex(path)
    index.names = [p.name for p in names]
    yield index
    index.close()


QUESTION = "Return an iterator over the data in chunks."  # no stored passage says this
WRAPPED = (
    "{q}",
    "Which function of the Python module heapq does this: {q}",
    'In the Python module heapq, the function that does the following: "{q}" is heapq.',
    "You are a helpful assistant who answers questions about Python libraries. Answer with the name only.\n\nQuestion: {q}\nAnswer: heapq.",
)


@pytest.mark.parametrize("form", WRAPPED, ids=["bare", "chat", "completion", "template"])
def test_the_words_around_a_question_change_neither_its_passage_nor_its_relevance(doc_index, form):
    stored = "Merge multiple sorted inputs into a single sorted output."  # heapq.merge's docstring begins so
    (bare,) = doc_index.search(stored, 1)
    (hit,) = doc_index.search(form.format(q=stored), 1)
    assert doc_index.names[hit.document] == "heapq.txt" and (hit.id, hit.relevance) == (bare.id, bare.relevance)
    off = doc_index.search(form.format(q=QUESTION), 1)
    assert not off or off[0].relevance < hit.relevance / 2, off  # words the store holds, but not in that order


def test_keywords_find_the_passage_that_holds_them_in_order(doc_index):
    (hit,) = doc_index.search("heapq merge multiple sorted inputs single output", 1)
    assert doc_index.names[hit.document] == "heapq.txt" and "Merge multiple sorted inputs" in hit.text


def test_a_passage_holding_the_question_word_for_word_ranks_above_one_that_only_shares_its_words(doc_index):
    found = doc_index.search("Which function of statistics does this: Return the median (middle value) of numeric data.", 5)
    assert "Return the median (middle value) of numeric data" in found[0].text and len(found) == 5
    assert [p.relevance for p in found] == sorted((p.relevance for p in found), reverse=True)
    assert found[0].relevance > found[1].relevance  # the others share some of its words, not the sentence


COMMON = "which one does this returns the an of a in g is".split()
RARE = "approximate maximum independent set k core".split()


def clause_vocabulary() -> Vocabulary:
    """100 passages: the words of a question's frame in half of them (common), the rest in one each."""
    return Vocabulary(100, {w: 50 for w in COMMON} | {w: 1 for w in RARE})


def test_a_passage_holding_a_short_question_whole_counts_more_than_one_holding_part_of_a_longer_one():
    vocabulary = clause_vocabulary()
    short = Query.of("Which one does this: Returns the k-core of G.", vocabulary)
    held_whole = vocabulary.informative(words("returns the k core of g"))
    assert passage_relevance(short, held_whole, vocabulary) == pytest.approx(
        phrase_and_relevance(short, held_whole, vocabulary)[0] / COVERED_SHARE
    )
    longer = Query.of("Which one does this: Returns an approximate maximum independent set.", vocabulary)
    sister = vocabulary.informative(words("returns the maximum independent set of g"))  # three of the clause's four words
    assert passage_relevance(longer, sister, vocabulary) == phrase_and_relevance(longer, sister, vocabulary)[0] > 0
    assert passage_relevance(short, held_whole, vocabulary) > passage_relevance(longer, sister, vocabulary)


def test_a_bracketed_part_of_a_question_is_not_a_clause_of_its_own():
    vocabulary = Vocabulary(100, {w: 50 for w in COMMON} | {w: 1 for w in "class maps values interval vmin vmax linearly".split()})
    question = Query.of("Which one does this: A class that maps values in the interval [vmin, vmax] linearly.", vocabulary)
    mentions_the_bounds = vocabulary.informative(words("the default covers the range vmin vmax of the data"))
    phrase, relevance = phrase_and_relevance(question, mentions_the_bounds, vocabulary)
    assert relevance == phrase == pytest.approx(vocabulary.weigh({"vmin", "vmax"}))  # two of the clause's seven words: no more


def test_keywords_a_passage_holds_in_another_order_count_by_their_whole_weight():
    vocabulary = clause_vocabulary()
    keywords = Query.of("independent set maximum", vocabulary)
    passage = vocabulary.informative(words("the maximum independent set of g"))
    assert phrase_and_relevance(keywords, passage, vocabulary)[0] == pytest.approx(vocabulary.weigh({"independent", "set"}))
    assert passage_relevance(keywords, passage, vocabulary) == pytest.approx(vocabulary.weigh(set(RARE[1:4])) / ALL_WORDS_SHARE)
    assert (
        passage_relevance(keywords, vocabulary.informative(words("the maximum set of g")), vocabulary) == 0
    )  # one word missing, no run: nothing


def test_a_gate_fitted_before_phrase_relevance_is_read_and_searched_as_then(doc_index):
    entry = PassageIndexEntry.model_validate(
        {
            "file": {"path": "passages.sqlite", "bytes": 1, "sha256": "0" * 64},
            "tokens": 128,
            "passages": 1,
            "gate": 1.1,
            "gate_heldout_pass": 0.01,
        }
    )
    assert entry.relevance == BM25_PER_WORD and entry.gate == 1.1
    words = ["push", "item", "onto", "heap", "maintaining", "the", "invariant"]
    with closing(sqlite3.connect(doc_index.path)) as db:
        bm25 = db.execute(
            "SELECT rowid, bm25(passages) FROM passages WHERE passages MATCH ? ORDER BY rank LIMIT 3", (" OR ".join(words),)
        ).fetchall()
    legacy = doc_index.search("Push item onto heap, maintaining the heap invariant.", 3, BM25_PER_WORD)
    assert [(p.id, p.relevance) for p in legacy] == [(rowid, pytest.approx(-score / len(words))) for rowid, score in bm25]
