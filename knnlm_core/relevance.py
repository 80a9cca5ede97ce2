"""Phrase relevance: how much of a question a passage holds word for word, whatever surrounds it.

A question reaches the passage index inside other text: a chat template, a sentence it completes
("In module M, the function that does … is"), a system text, or as bare keywords. A score divided
by the query's length (BM25 per word) falls with every word around the question. Phrase
relevance does not: it is the IDF weight of the longest stretch of the query's informative words
that a passage holds in the same order (consecutive, once the common words are left out of both).
Words a question is wrapped in add only where the passage holds them in that order too.

  informative  a word in at most COMMON_SHARE of the passages (at least one): a word in more is
               the language the passages are written in, not what one of them is about
  weight       BM25's IDF of the word, log((N - n + 0.5) / (n + 0.5)), n of N passages holding it
  phrase       the largest sum of distinct words' weights over a run of consecutive query words
               whose every adjacent pair is adjacent in the passage (a run of one word counts 0)
  clause       the query's words between two of . ! ? : ; " or a line break: a question is a
               clause of its prompt, or the whole of a keyword query (a bracketed part such as
               "[vmin, vmax]" or "(DFS)" is part of its sentence, not a question; a clause of words
               the query said before, such as a completion's answer stem naming its module
               again, asks nothing new and is no clause here)
  relevance    the phrase, counted 1 / COVERED_SHARE times where its run holds at least
               COVERED_RUN of the weight of the clauses it lies in, and at least the weight of
               the query's informative words over ALL_WORDS_SHARE where the passage holds every
               one of them (in any order: keywords)

A short question carries little weight even when a passage holds it whole ("Returns the k-core of
G."), while a passage about a sister function can hold a longer part of a longer one ("… maximum
independent set" of "Returns an approximate maximum independent set."). Whether the run covers
its clause tells the two apart where the weight alone does not; the gate (fitted on the phrase's
scale, index_builder/passage_gate.py) then needs COVERED_SHARE of itself from a covered run.

Plain functions over word lists and the passages' document frequencies (FAISS contrib's style);
`knnlm_core/passages.py` applies them to BM25's candidates.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

COMMON_SHARE = 0.2
COVERED_RUN = 0.85
COVERED_SHARE = 0.55
ALL_WORDS_SHARE = 0.85
_WORD = re.compile(r"\w+", re.UNICODE)
_CLAUSE_BREAK = re.compile(r'(?:[.!?](?=\s|$)|[:;"\n])+')  # not the dots inside a dotted name


@dataclass(frozen=True)
class Vocabulary:
    """How many of `passages` passages hold each word (words as `words` cuts them)."""

    passages: int
    holding: dict[str, int]

    @classmethod
    def of(cls, passage_words: Iterable[list[str]]) -> Vocabulary:
        counts: Counter[str] = Counter()
        total = 0
        for words in passage_words:
            counts.update(set(words))
            total += 1
        return cls(total, dict(counts))

    def informative(self, words: list[str]) -> list[str]:
        """`words` without the common ones, in order (a word no passage holds stays: it may be all a question asks)."""
        most = max(1, int(COMMON_SHARE * self.passages))
        return [w for w in words if self.holding.get(w, 0) <= most]

    def weight(self, word: str) -> float:
        n = self.holding.get(word, 0)
        return max(0.0, math.log((self.passages - n + 0.5) / (n + 0.5)))

    def weigh(self, words: set[str]) -> float:
        """The sum of `words`' weights."""
        return sum(self.weight(w) for w in words)


@dataclass(frozen=True)
class Query:
    """A query's informative words in order, the clause each lies in, and the words of each
    clause that asks something new (module docstring)."""

    words: list[str]
    clauses: list[int]
    asking: dict[int, set[str]]

    @classmethod
    def of(cls, text: str, vocabulary: Vocabulary, limit: int | None = None) -> Query:
        """The query of `text`: its last `limit` informative words (all when None)."""
        found, clauses = [], []
        for clause, part in enumerate(_CLAUSE_BREAK.split(text)):
            kept = vocabulary.informative(words(part))
            found += kept
            clauses += [clause] * len(kept)
        cut = 0 if limit is None else max(0, len(found) - limit)
        found, clauses = found[cut:], clauses[cut:]
        by_clause: dict[int, set[str]] = {}
        for word, clause in zip(found, clauses):
            by_clause.setdefault(clause, set()).add(word)
        asking, said = {}, set()
        for clause, held in by_clause.items():
            if not held <= said:
                asking[clause] = held
            said |= held
        return cls(found, clauses, asking)


def passage_relevance(query: Query, passage: list[str], vocabulary: Vocabulary) -> float:
    """The relevance of a passage, as its informative words in order, to a query (module docstring)."""
    return phrase_and_relevance(query, passage, vocabulary)[1]


def phrase_and_relevance(query: Query, passage: list[str], vocabulary: Vocabulary) -> tuple[float, float]:
    """(phrase, relevance) of a passage to a query: the phrase alone is the scale the gate is fitted on."""
    q, weigh, asking = query.words, vocabulary.weigh, query.asking
    adjacent = set(zip(passage, passage[1:]))
    phrase = served = 0.0
    start = None
    for i in range(len(q) - 1):
        if (q[i], q[i + 1]) not in adjacent:
            start = None
            continue
        start = i if start is None else start
        run = weigh(set(q[start : i + 2]))
        spanned = set().union(*(asking[c] for c in range(query.clauses[start], query.clauses[i + 1] + 1) if c in asking))
        phrase = max(phrase, run)
        served = max(served, run / COVERED_SHARE if spanned and run >= COVERED_RUN * weigh(spanned) else run)
    distinct = set(q)
    if distinct and distinct <= set(passage):
        served = max(served, weigh(distinct) / ALL_WORDS_SHARE)
    return phrase, served


def words(text: str) -> list[str]:
    """The words of `text`, lower-cased, in order."""
    return [w.lower() for w in _WORD.findall(text)]
