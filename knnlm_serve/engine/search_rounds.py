"""Which search calls a version's rows of one step go in, under speculative decoding.

A sampling row that may follow pointers needs the neighbours of its request's row before it (the
draft before) first: the rows are served in rounds, one per draft position. A retriever that holds
the version in one place (`links_rows`) takes later rounds in one call and runs them there, each
row linked to the row before it (`RowLinks`). Plain functions over the step's rows.
"""

from __future__ import annotations

import numpy as np

from knnlm_core.pointers import RowLinks
from knnlm_serve.engine.request_params import KnnParams
from knnlm_serve.engine.rows import LogitsRows


def search_rounds(draft: np.ndarray, params: list[KnnParams], group: list[int]) -> list[list[int]]:
    """The group's rows by round: a row that may follow pointers in the round of its draft
    position; the others all in the first."""
    rounds: dict[int, list[int]] = {}
    for r in group:
        rounds.setdefault(int(draft[r]) if params[r].min_pointers else 0, []).append(r)
    return [rounds[j] for j in sorted(rounds)]


def search_calls(rounds: list[list[int]], links_rows: bool) -> list[list[int]]:
    """The search calls, in order: one per round, or, where the retriever links rows, every
    round in one call."""
    if len(rounds) < 2 or not links_rows:
        return rounds
    return [sorted(r for members in rounds for r in members)]


def row_links(rows: LogitsRows, params: list[KnnParams], fed: list[int | None], call: list[int]) -> RowLinks | None:
    """Each row's previous row in the call (its request's draft before), where the row may follow
    pointers; None where no row has one."""
    if not rows.sampling:
        return None
    at = {r: i for i, r in enumerate(call)}
    previous = [
        at.get(r - 1, -1) if rows.draft[r] and params[r].min_pointers and rows.draft[r - 1] == rows.draft[r] - 1 else -1 for r in call
    ]
    if max(previous, default=-1) < 0:
        return None
    return RowLinks(
        np.array(previous, dtype=np.int64),
        np.array([-1 if fed[r] is None else fed[r] for r in call], dtype=np.int64),
        np.array([params[r].min_pointers for r in call], dtype=np.int64),
        np.array([params[r].k for r in call], dtype=np.int64),
    )
