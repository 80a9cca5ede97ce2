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
  relevance    the largest sum of distinct words' weights over a run of consecutive query words
               whose every adjacent pair is adjacent in the passage (a run of one word counts 0)

Plain functions over a word list and the passages' document frequencies (FAISS contrib's style);
`knnlm_core/passages.py` applies them to BM25's candidates.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

COMMON_SHARE = 0.2


@dataclass(frozen=True)
class Vocabulary:
    """How many of `passages` passages hold each word (words as `knnlm_core.passages.words` cuts them)."""

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


def phrase_relevance(query: list[str], passage: list[str], vocabulary: Vocabulary) -> float:
    """The relevance of a passage to a query, both as their informative words in order (module docstring)."""
    adjacent = set(zip(passage, passage[1:]))
    best, start = 0.0, None
    for i in range(len(query) - 1):
        if (query[i], query[i + 1]) not in adjacent:
            start = None
            continue
        start = i if start is None else start
        best = max(best, sum(vocabulary.weight(w) for w in set(query[start : i + 2])))
    return best
