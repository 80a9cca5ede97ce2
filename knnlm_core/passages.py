"""Passages: a datastore's documents cut into spans of text, indexed for BM25 retrieval, so that a
request's own text can bring the stored passages it is about into its prompt (in-context
retrieval beside kNN in the logits).

A passage is `PASSAGE_TOKENS` consecutive tokens of one document (a document's last span takes a
short tail along rather than leave it alone); its text is those tokens decoded. The index is one
SQLite file (`passages.sqlite`) holding an FTS5 table (Porter-stemmed words, BM25 ranking, SQLite
ships with Python): a passage's text, document and token span. It is written whole and replaced,
never changed in place: `add`, `forget` and `compact` write a new file from the old one's
passages (`write_passages`), so a forgotten document's passages never enter the new file, and
the old one goes with its version; readers open it read-only and immutable.

A search takes BM25's best CANDIDATES passages for the query's informative words (the last
MAX_QUERY_WORDS of them: a prompt's question comes at its end) and ranks them by relevance
(knnlm_core/relevance.py: phrase relevance, more where the passage holds a whole clause of the
query), BM25's order breaking ties, so that the passage holding the question's own wording comes
first and its relevance does not depend on the words around the question. A
datastore whose gate was fitted before phrase relevance existed (`relevance: bm25_per_word` in its
manifest) is searched as it was then: BM25 order, relevance the best score over the number of
distinct query words.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterable
from contextlib import closing
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from knnlm_core.relevance import Query, Vocabulary, passage_relevance, words

PASSAGES = "passages.sqlite"
PASSAGE_TOKENS = 128
MIN_TAIL_TOKENS = 32  # a document's last span shorter than this joins the one before it
MAX_QUERY_WORDS = 64
CANDIDATES = 8  # BM25's best passages that phrase relevance ranks
PHRASE, BM25_PER_WORD = "phrase", "bm25_per_word"  # relevance measures (the manifest's `relevance`)
_SCHEMA = "CREATE VIRTUAL TABLE passages USING fts5(text, document UNINDEXED, start UNINDEXED, stop UNINDEXED, tokenize='porter unicode61')"


@dataclass(frozen=True)
class Passage:
    id: int
    document: int
    start: int  # token span [start, stop) of the document
    stop: int
    text: str
    relevance: float  # phrase relevance, or BM25 per query word for a datastore fitted before it (module docstring)


def passage_spans(lengths: np.ndarray, size: int = PASSAGE_TOKENS) -> np.ndarray:
    """[n, 3] (document, start, stop) token spans cutting documents of these `lengths` into passages."""
    spans = []
    for document, length in enumerate(np.asarray(lengths).tolist()):
        cuts = list(range(0, length, size)) + [length]
        if len(cuts) > 2 and cuts[-1] - cuts[-2] < MIN_TAIL_TOKENS:
            del cuts[-2]
        spans.extend((document, a, b) for a, b in zip(cuts[:-1], cuts[1:]) if a < b)
    return np.asarray(spans, dtype=np.int64).reshape(-1, 3)


def write_passages(
    path: Path,
    rows: Iterable[tuple[int, int, int, str]] = (),
    base: Path | None = None,
    keep: dict[int, int] | None = None,
    leave_out: Iterable[tuple[int, int, int]] = (),
) -> None:
    """Write the index at `path` as a new file, put in place at once: `base`'s passages (those of
    the documents in `keep`, renumbered by it, when given; none that overlaps a `leave_out` span
    (document, first token, end token)) followed by `rows` (document, start, stop, text). The file
    is written fresh, without a journal: a passage left out never enters it."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    with closing(sqlite3.connect(tmp)) as db:
        db.execute("PRAGMA journal_mode = OFF")
        db.execute(_SCHEMA)
        if base is not None:
            db.execute("ATTACH DATABASE ? AS base", (f"file:{base}?mode=ro",))
            columns = "rowid, text, document, start, stop"
            if keep is None:
                db.execute(f"INSERT INTO passages({columns}) SELECT {columns} FROM base.passages")
            else:
                db.execute("CREATE TEMP TABLE kept(old INTEGER PRIMARY KEY, new INTEGER)")
                db.executemany("INSERT INTO kept VALUES (?, ?)", keep.items())
                db.execute(
                    f"INSERT INTO passages({columns}) SELECT p.rowid, p.text, k.new, p.start, p.stop "
                    "FROM base.passages AS p JOIN kept AS k ON p.document = k.old"
                )
            db.executemany("DELETE FROM passages WHERE document = ? AND start < ? AND stop > ?", ((d, b, a) for d, a, b in leave_out))
            db.commit()
            db.execute("DETACH DATABASE base")
        db.executemany("INSERT INTO passages(text, document, start, stop) VALUES (?, ?, ?, ?)", ((t, d, a, b) for d, a, b, t in rows))
        db.execute("INSERT INTO passages(passages) VALUES ('optimize')")
        db.commit()
    os.replace(tmp, path)


class PassageIndex:
    """A datastore's passage index, read-only; safe to share between threads."""

    def __init__(self, path: Path):
        self.path = path
        self._db = sqlite3.connect(f"file:{path}?mode=ro&immutable=1", uri=True, check_same_thread=False)

    def __len__(self) -> int:
        return self._db.execute("SELECT count(*) FROM passages").fetchone()[0]

    @cached_property
    def vocabulary(self) -> Vocabulary:
        """How many passages hold each word: read once, on the first search."""
        return Vocabulary.of(words(row[0]) for row in self._db.execute("SELECT text FROM passages"))

    def search(self, text: str, k: int, relevance: str = PHRASE) -> list[Passage]:
        """The `k` passages that best match `text`, best first (none when it has no informative word)."""
        if k <= 0:
            return []
        if relevance == BM25_PER_WORD:
            return self._bm25_per_word(text, k)
        query = Query.of(text, self.vocabulary, MAX_QUERY_WORDS)
        if not query.words:
            return []
        ranked = sorted(
            (
                (-passage_relevance(query, self.vocabulary.informative(words(row[4])), self.vocabulary), rank, row)
                for rank, row in enumerate(self._bm25(dict.fromkeys(query.words), max(k, CANDIDATES)))
            ),
            key=lambda scored: scored[:2],
        )
        return [Passage(int(r[0]), int(r[1]), int(r[2]), int(r[3]), r[4], -score) for score, _, r in ranked[:k]]

    def _bm25_per_word(self, text: str, k: int) -> list[Passage]:
        query = query_words(text)
        rows = self._bm25(query, k) if query else []
        return [Passage(int(r[0]), int(r[1]), int(r[2]), int(r[3]), r[4], -float(r[5]) / len(query)) for r in rows]

    def _bm25(self, query: Iterable[str], k: int) -> list[tuple]:
        return self._db.execute(
            "SELECT rowid, document, start, stop, text, bm25(passages) FROM passages WHERE passages MATCH ? ORDER BY rank LIMIT ?",
            (" OR ".join(f'"{w}"' for w in query), k),
        ).fetchall()

    def close(self) -> None:
        self._db.close()


def query_words(text: str) -> list[str]:
    """The distinct words of `text` a BM25-per-word search looks for (at most MAX_QUERY_WORDS, in order)."""
    return list(dict.fromkeys(words(text)))[:MAX_QUERY_WORDS]
