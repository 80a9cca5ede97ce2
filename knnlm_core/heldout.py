"""The held-out slice of a corpus that a build calibrates on, and the index never sees."""

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
    """A corpus split into what the index keeps and the slice held out to calibrate on."""

    index_tokens: np.ndarray
    index_offsets: np.ndarray
    index_documents: np.ndarray  # int64: which corpus document each of the index's documents is
    tokens: np.ndarray
    offsets: np.ndarray
    description: str


def split_heldout(tokens: np.ndarray, doc_offsets: np.ndarray) -> HeldOut | None:
    """Hold out T = min(8192, 10% of the corpus) tokens, or nothing when T < 1024.

    Whole documents, in the order of a hash of their tokens (stable whatever the file order), each
    taken only if it keeps the slice under 2T, until the slice reaches T. Where whole documents
    cannot give T/2 (one document, or a few large ones), the last T tokens of the longest
    document instead. The index never sees the slice."""
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
    keep = np.ones(total, dtype=bool)
    if size >= budget // 2:
        for d in chosen:
            keep[starts[d] : ends[d]] = False
        description = f"{len(chosen)} whole document(s) of {len(starts)}, chosen by a hash of their tokens"
        held_lengths = [int(ends[d] - starts[d]) for d in sorted(chosen)]
        held = np.concatenate([tokens[starts[d] : ends[d]] for d in sorted(chosen)])
    else:
        longest = int(np.argmax(ends - starts))
        keep[ends[longest] - budget : ends[longest]] = False
        description = f"the last {budget} tokens of the longest document (of {len(starts)})"
        held_lengths = [budget]
        held = tokens[ends[longest] - budget : ends[longest]]
    kept_lengths = np.array([int(keep[s:e].sum()) for s, e in zip(starts, ends)], dtype=np.int64)
    kept = np.flatnonzero(kept_lengths > 0)
    return HeldOut(tokens[keep], offsets_of(kept_lengths[kept].tolist()), kept, held, offsets_of(held_lengths), description)
