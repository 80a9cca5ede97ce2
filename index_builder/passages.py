"""The passage index of a datastore version (knnlm_core/passages.py): made by `build`, grown by
`add`, and rewritten without forgotten documents by `forget` and `compact`.

The relevance gate is calibrated like λ and the skip rule, by `build` on its held-out documents and
by `calibrate` on its held-out text. It is the relevance that GATE_CHANCE_PASS of chance queries
reach at most: a chance query is GATE_QUERY_WORDS distinct words drawn from the held-out text by
their frequency, the domain's vocabulary in no particular relation, about a question's length.
Verbatim windows of held-out text are no such baseline: documents of one domain share their
phrasing (a library's "Parameters: G, a graph" in every docstring), so their windows match stored
passages as well as a real question about a stored document does. The share of phrases of stored
passages (GATE_QUERY_WORDS consecutive distinct words) that the gate lets through is recorded
beside it.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from knnlm_core.datastore import file_entry
from knnlm_core.manifest import Manifest, PassageIndexEntry
from knnlm_core.passages import PASSAGE_TOKENS, PASSAGES, PassageIndex, passage_spans, words, write_passages

logger = logging.getLogger("index_builder")

GATE_CHANCE_PASS = 0.01
GATE_QUERY_WORDS = 16
GATE_QUERIES = 200


def passage_rows(tokens: np.ndarray, offsets: np.ndarray, tokenizer, first_document: int = 0):
    """(document, start, stop, text) of every passage of the documents tokens[offsets[d]:offsets[d+1]]."""
    for document, start, stop in passage_spans(np.diff(offsets)).tolist():
        text = tokenizer.decode(tokens[offsets[document] + start : offsets[document] + stop])
        yield first_document + document, start, stop, text


def build_passages(work: Path, tokens, offsets, tokenizer, heldout: tuple | None) -> PassageIndexEntry:
    """The passage index of the documents in (tokens, offsets), and its gate fitted on `heldout`'s (tokens, offsets)."""
    write_passages(work / PASSAGES, passage_rows(tokens, offsets, tokenizer))
    index = PassageIndex(work / PASSAGES)
    gate = fit_gate(index, tokenizer.decode(heldout[0])) if heldout is not None else {"gate": None}
    entry = PassageIndexEntry(file=file_entry(work, work / PASSAGES), tokens=PASSAGE_TOKENS, passages=len(index), **gate)
    index.close()
    return entry


def fit_gate(index: PassageIndex, heldout_text: str) -> dict:
    """{gate, gate_heldout_pass, gate_stored_pass} of the index, fitted on `heldout_text` (module docstring)."""
    vocabulary = words(heldout_text)
    if len(set(vocabulary)) < GATE_QUERY_WORDS:
        return {"gate": None, "gate_heldout_pass": None, "gate_stored_pass": None}
    rng = np.random.default_rng(0)
    chance = _best_relevance(index, [_chance_query(vocabulary, rng) for _ in range(GATE_QUERIES)])
    stored = _best_relevance(index, _phrases(index.texts(), rng))
    gate = float(np.quantile(chance, 1 - GATE_CHANCE_PASS, method="higher"))
    fit = {
        "gate": gate,
        "gate_heldout_pass": float(np.mean(chance > gate)),
        "gate_stored_pass": float(np.mean(stored > gate)) if len(stored) else None,
    }
    logger.info(
        "passages: gate %.4f lets %.1f%% of chance queries and %.0f%% of stored phrases through",
        gate,
        100 * fit["gate_heldout_pass"],
        100 * (fit["gate_stored_pass"] or 0),
    )
    return fit


def refitted_gate(root: Path, entry: PassageIndexEntry, heldout_text: str) -> PassageIndexEntry:
    """The version's passage index entry with its gate fitted again on `heldout_text` (`calibrate`)."""
    index = PassageIndex(root / entry.file.path)
    try:
        return entry.model_copy(update=fit_gate(index, heldout_text))
    finally:
        index.close()


def grown_passages(root: Path, work: Path, manifest: Manifest, rows) -> PassageIndexEntry | None:
    """The version's passage index with `rows` added (None where the datastore has none)."""
    if manifest.passages is None:
        return None
    write_passages(work / PASSAGES, rows, base=root / manifest.passages.file.path)
    return _updated(work, manifest.passages)


def kept_passages(root: Path, work: Path, manifest: Manifest, keep: dict[int, int]) -> PassageIndexEntry | None:
    """The version's passage index holding only the documents in `keep` (old number -> new)."""
    if manifest.passages is None:
        return None
    write_passages(work / PASSAGES, base=root / manifest.passages.file.path, keep=keep)
    return _updated(work, manifest.passages)


def _updated(work: Path, entry: PassageIndexEntry) -> PassageIndexEntry:
    index = PassageIndex(work / PASSAGES)
    count = len(index)
    index.close()
    return entry.model_copy(update={"file": file_entry(work, work / PASSAGES), "passages": count})


def _chance_query(vocabulary: list[str], rng: np.random.Generator) -> str:
    """GATE_QUERY_WORDS distinct words drawn from `vocabulary` (so by their frequency there)."""
    query: dict[str, None] = {}
    while len(query) < GATE_QUERY_WORDS:
        query.setdefault(vocabulary[rng.integers(len(vocabulary))], None)
    return " ".join(query)


def _phrases(texts: list[str], rng: np.random.Generator) -> list[str]:
    """Up to GATE_QUERIES phrases of GATE_QUERY_WORDS consecutive distinct words, one from each of as
    many passages, chosen at random."""
    phrases = []
    for i in rng.permutation(len(texts))[:GATE_QUERIES]:
        passage = words(texts[i])
        start = int(rng.integers(max(1, len(passage) - GATE_QUERY_WORDS)))
        phrase = list(dict.fromkeys(passage[start:]))[:GATE_QUERY_WORDS]
        if len(phrase) == GATE_QUERY_WORDS:
            phrases.append(" ".join(phrase))
    return phrases


def _best_relevance(index: PassageIndex, queries: list[str]) -> np.ndarray:
    best = [index.search(q, 1) for q in queries]
    return np.array([hits[0].relevance if hits else 0.0 for hits in best])
