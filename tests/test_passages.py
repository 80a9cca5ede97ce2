"""The passage index of a datastore (in-context retrieval): built with it, grown by add, and
rewritten without forgotten documents by forget and compact (real SQLite FTS5, tiny model)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_index_builder import SMALL

from index_builder.add import add_documents
from index_builder.build import build_datastore
from index_builder.compact import compact_datastore
from index_builder.default_datastore import module_documents
from index_builder.forget import forget_documents
from index_builder.passages import GATE_CHANCE_PASS
from knnlm_core.datastore import read_manifest, verify_checksums
from knnlm_core.passages import PASSAGE_TOKENS, PassageIndex, passage_spans
from knnlm_core.provenance import Provenance

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
    assert manifest.passages.gate is not None and manifest.passages.gate_heldout_pass <= GATE_CHANCE_PASS
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
