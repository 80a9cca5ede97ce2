"""The held-out slice of a corpus that a build calibrates on.

The datastore stores every document, the slice's too: a user who gives a corpus expects all of it
to be searchable. Calibration keeps the slice's own entries out of its searches
(`heldout_entries`), so the fit is still judged on text the search has not seen."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from knnlm_core.corpus import doc_offsets as offsets_of

HELDOUT_SHARE = 0.10  # of the corpus's tokens, at most
MAX_HELDOUT_TOKENS = 8192
MIN_HELDOUT_TOKENS = 1024  # below this a fit is noise: the corpus is calibrated on nothing


@dataclass(frozen=True)
class HeldOut:
    """A corpus split into the slice held out to calibrate on and the rest."""

    spans: tuple[tuple[int, int, int], ...]  # (corpus document, first token, end token) of each held-out piece
    tokens: np.ndarray
    offsets: np.ndarray
    description: str


def split_heldout(tokens: np.ndarray, doc_offsets: np.ndarray) -> HeldOut | None:
    """Hold out T = min(8192, 10% of the corpus) tokens, or nothing when T < 1024.

    Whole documents, in the order of a hash of their tokens (stable whatever the file order), each
    taken only if it keeps the slice under 2T, until the slice reaches T. Where whole documents
    cannot give T/2 (one document, or a few large ones), the last T tokens of the longest
    document instead."""
    total = int(doc_offsets[-1])
    budget = min(MAX_HELDOUT_TOKENS, int(HELDOUT_SHARE * total))
    if budget < MIN_HELDOUT_TOKENS:
        return None
    starts, ends = doc_offsets[:-1], doc_offsets[1:]
    order = sorted(range(len(starts)), key=lambda d: hashlib.sha256(tokens[starts[d] : ends[d]].tobytes()).hexdigest())
    chosen, size = [], 0
    for d in order:
        length = int(ends[d] - starts[d])
        if size >= budget:
            break
        if size + length <= 2 * budget and len(chosen) + 1 < len(starts):
            chosen.append(d)
            size += length
    if size >= budget // 2:
        description = f"{len(chosen)} whole document(s) of {len(starts)}, chosen by a hash of their tokens"
        spans = tuple((d, 0, int(ends[d] - starts[d])) for d in sorted(chosen))
    else:
        longest = int(np.argmax(ends - starts))
        description = f"the last {budget} tokens of the longest document (of {len(starts)})"
        length = int(ends[longest] - starts[longest])
        spans = ((longest, length - budget, length),)
    held = np.concatenate([tokens[starts[d] + a : starts[d] + b] for d, a, b in spans])
    return HeldOut(spans, held, offsets_of([b - a for _, a, b in spans]), description)


def heldout_entries(starts: np.ndarray, spans) -> list[tuple[int, int]]:
    """The datastore entry ranges [first, end) whose values lie in the held-out `spans` (document,
    first token, end token), for documents whose entries begin at `starts` (documents.npy): entry
    starts[d] + p is document d's position p, whose value is its token p + 1."""
    return [(int(starts[d]) + max(a - 1, 0), int(starts[d]) + b - 1) for d, a, b in spans if b - 1 > max(a - 1, 0)]
