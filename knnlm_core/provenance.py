"""Where each datastore entry came from, and the text around it: the evidence behind p_kNN.

Entry i lies in document d, the last one with starts[d] <= i (documents.npy), at token position
p = i - starts[d]: its key is the model's vector after the document's tokens 0..p, its value is
token p + 1. The entries' values are therefore every document's tokens but its first, in corpus
order; with each document's first token (kept in the table) they give the whole tokenized corpus
back, so a snippet needs no other copy of the text and no per-entry arrays.

The document table (`provenance.json`) says where each document came from: its source file
(relative to `root`, the sources' common directory at build time; a file added later from outside
that directory by its absolute path, so no name the table gave ever changes), the 1-based line and
the `id` field of a .jsonl record, and the sha256 of the document's text, to find it again and check it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from knnlm_core.datastore import EntryValues, load_document_starts, load_values
from knnlm_core.errors import DatastoreError, ErrorKind
from knnlm_core.files import write_json_atomic
from knnlm_core.manifest import ForgetRecord, Manifest

PROVENANCE = "provenance.json"


def source_name(root: str, path: str) -> str:
    """The name a table with this `root` gives the source file at `path` (absolute): relative to
    the root when below it, else the path itself."""
    return os.path.relpath(path, root) if root and Path(path).is_relative_to(root) else path


@dataclass(frozen=True)
class DocumentTable:
    root: str
    sources: list[str]  # relative to root
    source: list[int]  # per document: index into sources
    line: list[int | None]
    id: list[str | None]
    first_token: list[int]
    sha256: list[str]

    def __len__(self) -> int:
        return len(self.source)

    @classmethod
    def of(cls, origins: list[tuple[str, int | None, str | None, str]], first_tokens: list[int]) -> DocumentTable:
        """From each document's (source path, line, id, sha256) and first token, in corpus order."""
        root = os.path.commonpath([os.path.dirname(o[0]) for o in origins]) if origins else ""
        relative = [os.path.relpath(o[0], root) for o in origins]
        sources = list(dict.fromkeys(relative))
        number = {s: i for i, s in enumerate(sources)}
        return cls(
            root=root,
            sources=sources,
            source=[number[r] for r in relative],
            line=[o[1] for o in origins],
            id=[o[2] for o in origins],
            first_token=[int(t) for t in first_tokens],
            sha256=[o[3] for o in origins],
        )

    def select(self, documents: np.ndarray) -> DocumentTable:
        """The rows of `documents` (the documents a compact keeps), in that order."""
        rows = documents.tolist()
        return DocumentTable(
            self.root,
            self.sources,
            *([column[r] for r in rows] for column in (self.source, self.line, self.id, self.first_token, self.sha256)),
        )

    def extended(self, other: DocumentTable) -> DocumentTable:
        """This table's documents followed by `other`'s, under this table's root: every name it gave
        stays as it was (forget by source, explanations and passages keep naming a document alike)."""
        root = self.root if len(self) else other.root
        paths = [[source_name(root, os.path.join(t.root, t.sources[i])) for i in t.source] for t in (self, other)]
        sources = list(dict.fromkeys(paths[0] + paths[1]))
        number = {s: i for i, s in enumerate(sources)}
        return DocumentTable(
            root,
            sources,
            [number[p] for p in paths[0] + paths[1]],
            *(getattr(self, column) + getattr(other, column) for column in ("line", "id", "first_token", "sha256")),
        )

    def write(self, path: Path) -> None:
        write_json_atomic(path, self.__dict__)

    @classmethod
    def read(cls, path: Path, vocab_size: int | None = None) -> DocumentTable:
        """The table at `path`, checked: its columns agree, and name listed sources and tokens of the vocabulary."""
        try:
            table = cls(**json.loads(path.read_text()))
        except (json.JSONDecodeError, TypeError, UnicodeDecodeError) as e:
            raise DatastoreError(f"{path.name}: not a knnlm-index document table ({e}); rebuild the datastore") from None
        columns = {"source": table.source, "line": table.line, "id": table.id, "first_token": table.first_token, "sha256": table.sha256}
        if not isinstance(table.sources, list) or not all(isinstance(c, list) for c in columns.values()):
            raise DatastoreError(f"{path.name}: sources and every column must be lists; rebuild the datastore")
        if len({len(c) for c in columns.values()}) != 1:
            lengths = ", ".join(f"{name} {len(c)}" for name, c in columns.items())
            raise DatastoreError(f"{path.name}: its columns have different lengths ({lengths}); rebuild the datastore")
        if not all(isinstance(i, int) and 0 <= i < len(table.sources) for i in table.source):
            raise DatastoreError(f"{path.name}: field source names sources it does not list; rebuild the datastore")
        if not all(isinstance(t, int) and 0 <= t < (vocab_size or t + 1) for t in table.first_token):
            raise DatastoreError(
                f"{path.name}: field first_token holds ids outside the vocabulary [0, {vocab_size}); rebuild the datastore"
            )
        return table

    def describe(self, document: int) -> dict:
        return {
            "document": document,
            "source": self.sources[self.source[document]],
            "line": self.line[document],
            "id": self.id[document],
            "sha256": self.sha256[document],
        }


def served_documents(table: DocumentTable, manifest: Manifest) -> dict[str, int]:
    """sha256 of each document's text -> its number, for the documents the datastore serves (not forgotten)."""
    forgotten = {record.document for record in manifest.forgotten}
    return {sha: document for document, sha in enumerate(table.sha256) if document not in forgotten}


class Provenance:
    """A datastore's entries, documents and their tokens, for explaining neighbours."""

    def __init__(
        self, table: DocumentTable, starts: np.ndarray, values: list[np.ndarray], forgotten: dict[int, ForgetRecord] | None = None
    ):
        if len(starts) != len(table) + 1:
            raise DatastoreError(
                f"{PROVENANCE} lists {len(table)} documents, documents.npy {len(starts) - 1}: they must agree; rebuild the datastore"
            )
        self.table, self.starts = table, starts
        self.forgotten = forgotten or {}  # document -> its audit record (`knnlm-index forget`)
        self._values = EntryValues(values)

    @classmethod
    def open(cls, root: Path, manifest: Manifest) -> Provenance:
        """The datastore's provenance, every file it reads checked; a clear error for datastores
        built before it was recorded."""
        if manifest.provenance is None or manifest.documents is None:
            raise DatastoreError(
                f"datastore {root.name} has no provenance (built before knnlm-index recorded documents, or from keys): "
                "it serves, but cannot explain; rebuild it with `knnlm-index build` to explain its neighbours",
                ErrorKind.INVALID,
            )
        vocab = manifest.model.vocab_size
        values = [load_values(root / s.values.path, s.entries, vocab) for s in manifest.shards]
        forgotten = {r.document: r for r in manifest.forgotten}
        return cls(DocumentTable.read(root / manifest.provenance.path, vocab), load_document_starts(root, manifest), values, forgotten)

    @property
    def documents(self) -> int:
        return len(self.table)

    def locate(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(document, token position) of each entry id: its key read the document up to that position."""
        ids = np.asarray(ids, dtype=np.int64)
        documents = np.searchsorted(self.starts, ids, side="right") - 1
        return documents, ids - self.starts[documents]

    def tokens(self, document: int, start: int = 0, end: int | None = None) -> np.ndarray:
        """The document's tokens [start, end) (clipped to the document): its first token from the
        table, the others are the values of its entries."""
        if not 0 <= document < self.documents:
            raise DatastoreError(
                f"document {document} does not exist: the datastore has documents 0..{self.documents - 1}", ErrorKind.NOT_FOUND
            )
        if document in self.forgotten:
            raise DatastoreError(
                f"document {document} was forgotten at {self.forgotten[document].at} (`knnlm-index forget`): its text is no longer served",
                ErrorKind.GONE,
            )
        length = int(self.starts[document + 1] - self.starts[document]) + 1
        start, end = max(0, start), length if end is None else min(end, length)
        if start >= end:
            return np.zeros(0, dtype=np.int32)
        first = [self.table.first_token[document]] if start == 0 else []
        base = int(self.starts[document]) - 1  # token q of the document is entry base + q's value
        return np.concatenate([np.asarray(first, dtype=np.int32), self._values.range(base + max(start, 1), base + end)])


def check_served_files(root: Path, manifest: Manifest) -> None:
    """Open and check every file that serving or an explanation reads besides the shards' indexes
    (which the shard actors load and a probe query checks): each shard's values, documents.npy and
    provenance.json, against each other and the manifest. Raises DatastoreError naming the file."""
    if manifest.provenance is not None and manifest.documents is not None:
        Provenance.open(root, manifest)
        return
    load_document_starts(root, manifest)
    for shard in manifest.shards:
        load_values(root / shard.values.path, shard.entries, manifest.model.vocab_size)
