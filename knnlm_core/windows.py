"""Tokens -> windows: which positions are keyed (or scored), and with what left context.

Every position p of a document (except its last token) is one entry: key = the model's vector at
p, value = token p+1. Positions are taken in groups of `stride`; each group is encoded with up to
`context_length - stride` tokens of left context from its own document, so every position is
keyed exactly once and never sees another document. The builder keys a corpus this way and the
evaluator scores a held-out text this way.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class WindowPlan:
    """windows[i] = (feed_start, key_start, key_end) in global token coordinates."""

    windows: np.ndarray  # int64 [W, 3]
    entry_offsets: np.ndarray  # int64 [W + 1], where window i's entries start in the datastore

    @property
    def entries(self) -> int:
        return int(self.entry_offsets[-1])


def plan_windows(doc_offsets: np.ndarray, context_length: int, stride: int) -> WindowPlan:
    if stride > context_length - 1:
        raise ValueError(f"stride ({stride}) must be below context_length ({context_length})")
    rows = []
    for doc_start, doc_end in zip(doc_offsets[:-1].tolist(), doc_offsets[1:].tolist()):
        for key_start in range(doc_start, doc_end - 1, stride):
            key_end = min(key_start + stride, doc_end - 1)
            rows.append((max(doc_start, key_end - context_length), key_start, key_end))
    return plan_of(np.array(rows, dtype=np.int64).reshape(-1, 3))


def plan_of(windows: np.ndarray) -> WindowPlan:
    """The plan of these windows [W, 3], their entries one after the other in this order."""
    offsets = np.zeros(len(windows) + 1, dtype=np.int64)
    np.cumsum(windows[:, 2] - windows[:, 1], out=offsets[1:])
    return WindowPlan(windows, offsets)


def window_values(tokens: np.ndarray, plan: WindowPlan) -> np.ndarray:
    """The value (next token) of every entry, in datastore order."""
    return np.concatenate([tokens[k0 + 1 : k1 + 1] for _, k0, k1 in plan.windows]).astype(np.int32)


def fed_tokens(plan: WindowPlan, first: int = 0, last: int | None = None) -> int:
    """Tokens fed to the model (context + keyed) by windows [first, last)."""
    w = plan.windows[first:last]
    return int((w[:, 2] - w[:, 0]).sum())
