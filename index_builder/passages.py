"""The passage index of a datastore version (knnlm_core/passages.py): made by `build`, grown by
`add`, and rewritten without forgotten documents by `forget` and `compact`.

The relevance gate is calibrated at build time, like λ and the skip rule, on the build's held-out
documents (text the store does not hold): queries cut from them must not bring passages into a
prompt, so the gate is the relevance that GATE_HELDOUT_PASS of them reach at most. The share of
queries cut from stored documents that it lets through is recorded beside it.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from knnlm_core.datastore import file_entry
from knnlm_core.manifest import Manifest, PassageIndexEntry
from knnlm_core.passages import PASSAGE_TOKENS, PASSAGES, PassageIndex, passage_spans, write_passages

logger = logging.getLogger("index_builder")

GATE_HELDOUT_PASS = 0.05
GATE_QUERY_TOKENS = 32  # a calibration query: a window of this many tokens (about a question's length)
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
    gate = heldout_pass = stored_pass = None
    if heldout is not None:
        negatives = _best_relevance(index, _queries(*heldout, tokenizer))
        positives = _best_relevance(index, _queries(tokens, offsets, tokenizer))
        if len(negatives):
            gate = float(np.quantile(negatives, 1 - GATE_HELDOUT_PASS, method="higher"))
            heldout_pass = float(np.mean(negatives > gate))
            stored_pass = float(np.mean(positives > gate)) if len(positives) else None
            logger.info(
                "passages: gate %.4f lets %.0f%% of held-out and %.0f%% of stored-text queries through",
                gate,
                100 * heldout_pass,
                100 * (stored_pass or 0),
            )
    entry = PassageIndexEntry(
        file=file_entry(work, work / PASSAGES),
        tokens=PASSAGE_TOKENS,
        passages=len(index),
        gate=gate,
        gate_heldout_pass=heldout_pass,
        gate_stored_pass=stored_pass,
    )
    index.close()
    return entry


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


def _queries(tokens: np.ndarray, offsets: np.ndarray, tokenizer) -> list[str]:
    """Up to GATE_QUERIES windows of GATE_QUERY_TOKENS tokens, spread over the documents, as text."""
    starts = [
        int(offsets[d]) + s
        for d in range(len(offsets) - 1)
        for s in range(0, int(offsets[d + 1] - offsets[d]) - GATE_QUERY_TOKENS + 1, GATE_QUERY_TOKENS)
    ]
    chosen = np.random.default_rng(0).permutation(len(starts))[:GATE_QUERIES]
    return [tokenizer.decode(tokens[starts[i] : starts[i] + GATE_QUERY_TOKENS]) for i in sorted(chosen)]


def _best_relevance(index: PassageIndex, queries: list[str]) -> np.ndarray:
    best = [index.search(q, 1) for q in queries]
    return np.array([hits[0].relevance if hits else 0.0 for hits in best])
