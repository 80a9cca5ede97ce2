"""The passage gate: the phrase relevance (knnlm_core/relevance.py) a passage needs to go into a
prompt, fitted by `build` on the documents it held out and by `calibrate` on its held-out text.

The gate must keep out questions about what the store does not hold, however they are written,
and let in questions about what it holds. A store cannot know its users' questions, but its
held-out documents can stand in for both kinds:

  questions   sentences of the held-out documents (GATE_SENTENCE_WORDS words, mostly words, no
              code), at most GATE_QUESTIONS, each written in one of FORMS (a seeded choice): bare,
              a chat question, a sentence to complete that names the document's title, a
              templated prompt behind a system text, and the title with the sentence's keywords
  off-topic   each question searched in the index as built, which lacks its document: text of
              the store's own domain that the store does not hold
  answerable  the same question's relevance to its own document's passages, as if stored

A question whose off-topic relevance is half its answerable relevance or more asks what the store
holds anyway (a domain's boilerplate sentence, repeated in many documents) and is left out of
both. The gate is GATE_SHARE of the median answerable phrase relevance: a passage must hold that
share of the weight a question typically finds in its own document (a passage holding a whole
clause of the question needs less, knnlm_core/relevance.py). A quantile of the off-topic
relevances would be the direct choice, but a few held-out documents give a hundred or so
questions, and their top percentile is one or two questions about a sister document that the
store does hold; the median of the answerable ones is stable. The manifest records the shares of
both kinds the gate lets through (benchmarks/passage_gate.py measures it on real questions).
"""

from __future__ import annotations

import logging
import re

import numpy as np

from knnlm_core.passages import PHRASE, PassageIndex, words
from knnlm_core.relevance import Query, phrase_and_relevance

logger = logging.getLogger("index_builder")

GATE_SHARE = 0.45
GATE_QUESTIONS = 300
MIN_GATE_QUESTIONS = 20  # fewer, and their median is noise: no gate
GATE_SENTENCE_WORDS = (6, 30)
KEYWORDS = 6
FORMS = (
    "{sentence}",
    "Which one does this? {sentence}",
    'In {title}, the one that does the following: "{sentence}" is',
    "You answer questions about the documentation, briefly and exactly.\n\nQuestion: {sentence}\nAnswer:",
    "{title} {keywords}",
)
_SENTENCE = re.compile(r"[^.!?\n]+(?:\n(?!\n)[^.!?\n]+)*[.!?]")


def fit_gate(index: PassageIndex, documents: list[str], passages: list[str]) -> dict:
    """The manifest's gate fields for `index`, fitted on held-out `documents` whose passages'
    texts are `passages` (module docstring)."""
    rng = np.random.default_rng(0)
    vocabulary = index.vocabulary
    held = [vocabulary.informative(words(p)) for p in passages]
    offtopic, answerable, phrases = [], [], []
    for question in questions(documents, vocabulary, rng):
        query = Query.of(question, vocabulary)
        phrase, mine = np.max([phrase_and_relevance(query, p, vocabulary) for p in held], axis=0) if held else (0.0, 0.0)
        found = index.search(question, 1)
        theirs = found[0].relevance if found else 0.0
        if mine > 0 and theirs < mine / 2:
            offtopic.append(theirs)
            answerable.append(mine)
            phrases.append(phrase)
    if len(offtopic) < MIN_GATE_QUESTIONS:
        logger.info("passages: %d held-out questions, too few to fit a gate: every passage passes", len(offtopic))
        return {"gate": None, "relevance": PHRASE, "gate_questions": len(offtopic)}
    gate = GATE_SHARE * float(np.median(phrases))
    fit = {
        "gate": gate,
        "relevance": PHRASE,
        "gate_questions": len(offtopic),
        "gate_offtopic_pass": float(np.mean(np.array(offtopic) > gate)),
        "gate_answerable_pass": float(np.mean(np.array(answerable) > gate)),
    }
    logger.info(
        "passages: gate %.2f lets %.1f%% of %d off-topic questions and %.0f%% of answerable ones through",
        gate,
        100 * fit["gate_offtopic_pass"],
        len(offtopic),
        100 * fit["gate_answerable_pass"],
    )
    return fit


def questions(documents: list[str], vocabulary, rng: np.random.Generator) -> list[str]:
    """Up to GATE_QUESTIONS questions made from the documents' sentences, each in one of FORMS."""
    found = []
    for document in documents:
        title = " ".join(document.strip().split("\n", 1)[0].split()[:8])
        found += [(title, s) for s in sentences(document)]
    chosen = [found[i] for i in sorted(rng.permutation(len(found))[:GATE_QUESTIONS])]
    made = []
    for title, sentence in chosen:
        keywords = " ".join(list(dict.fromkeys(vocabulary.informative(words(sentence))))[:KEYWORDS])
        form = FORMS[int(rng.integers(len(FORMS)))]
        made.append(form.format(sentence=sentence, title=title, keywords=keywords))
    return made


def sentences(document: str) -> list[str]:
    """The document's sentences of GATE_SENTENCE_WORDS words, on one line, that are mostly words (not code or tables)."""
    low, high = GATE_SENTENCE_WORDS
    found = []
    for match in _SENTENCE.finditer(document):
        sentence = " ".join(match.group(0).split())
        tokens = sentence.split()
        if low <= len(tokens) <= high and ">>>" not in sentence and sum(t.isalpha() for t in tokens) >= 0.6 * len(tokens):
            found.append(sentence)
    return found
