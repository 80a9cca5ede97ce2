"""The passage index of a datastore version (knnlm_core/passages.py): made by `build`, grown by
`add`, and rewritten without forgotten documents by `forget` and `compact`. Its relevance gate is
fitted by `build` on the documents it held out and by `calibrate` on its held-out text, like λ and
the skip rule (index_builder/passage_gate.py).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from index_builder.passage_gate import fit_gate
from knnlm_core.datastore import file_entry
from knnlm_core.heldout import HeldOut
from knnlm_core.manifest import Manifest, PassageIndexEntry
from knnlm_core.passages import PASSAGE_TOKENS, PASSAGES, PHRASE, PassageIndex, passage_spans, write_passages


def passage_rows(tokens: np.ndarray, offsets: np.ndarray, tokenizer, first_document: int = 0):
    """(document, start, stop, text) of every passage of the documents tokens[offsets[d]:offsets[d+1]]."""
    for document, start, stop in passage_spans(np.diff(offsets)).tolist():
        text = tokenizer.decode(tokens[offsets[document] + start : offsets[document] + stop])
        yield first_document + document, start, stop, text


def build_passages(work: Path, tokens, offsets, tokenizer, heldout: HeldOut | None) -> PassageIndexEntry:
    """The passage index of the documents in (tokens, offsets), and its gate fitted on the `heldout` slice."""
    write_passages(work / PASSAGES, passage_rows(tokens, offsets, tokenizer))
    gate = {"gate": None, "relevance": PHRASE}
    if heldout is not None:
        gate = heldout_gate(work / PASSAGES, heldout.tokens, heldout.offsets, tokenizer, heldout.spans)
    index = PassageIndex(work / PASSAGES)
    entry = PassageIndexEntry(file=file_entry(work, work / PASSAGES), tokens=PASSAGE_TOKENS, passages=len(index), **gate)
    index.close()
    return entry


def heldout_gate(passages: Path, tokens: np.ndarray, offsets: np.ndarray, tokenizer, leave_out=()) -> dict:
    """The gate fields of the passage index at `passages`, fitted on the held-out documents
    tokens[offsets[d]:offsets[d+1]] against it without the passages of the `leave_out` spans
    (document, first token, end token: the held-out text itself, where the datastore stores it)."""
    searched = passages.with_name(f".gate-{passages.name}") if leave_out else passages
    if leave_out:
        write_passages(searched, base=passages, leave_out=leave_out)
    index = PassageIndex(searched)
    try:
        documents = [tokenizer.decode(tokens[a:b]) for a, b in zip(offsets[:-1], offsets[1:])]
        return fit_gate(index, documents, [text for *_, text in passage_rows(tokens, offsets, tokenizer)])
    finally:
        index.close()
        if leave_out:
            searched.unlink()


def refitted_gate(
    root: Path, entry: PassageIndexEntry, tokens: np.ndarray, offsets: np.ndarray, tokenizer, leave_out=()
) -> PassageIndexEntry:
    """The version's passage index entry with its gate fitted again on held-out (tokens, offsets) (`calibrate`)."""
    fit = heldout_gate(root / entry.file.path, tokens, offsets, tokenizer, leave_out)
    return entry.model_copy(update={"gate_heldout_pass": None, "gate_stored_pass": None, **fit})


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
