"""Pointer following (after RetoMaton, Alon et al. 2022): reuse the last step's neighbours instead of searching.

Entries are stored in corpus order, so entry i's successor is entry i + 1 when both lie in one
document (documents.npy). After a step whose neighbours were N and whose token turned out to be
x, the neighbours in N whose value is x predicted right; their successors are where the datastore
goes on, and so candidates for the next step's neighbours. When at least `min_pointers` survive,
the next step scores them exactly against its own query and takes p_kNN from them, with no
search; otherwise it searches as usual.

The same successors make draft tokens for speculative decoding (`chain_*`): a chain is the
entries whose stored text a request is reading, started where the nearest neighbour predicted
its token and moved along as the request's tokens keep matching the stored ones, through steps
without a search; the stored tokens ahead of it are the draft.

A request's draft rows are verified in one step, each row after the row before it: a row may
follow the pointers of its previous row's neighbours. `find_linked` serves such rows in one
search call (`RowLinks`), round by round where the shard is, instead of one call per draft position.

Plain functions over explicit arrays: the server follows pointers per request and step, the
evaluator replays them over a whole text with the same functions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


def successors(ids: np.ndarray, values: np.ndarray, token: int, document_starts: np.ndarray) -> np.ndarray:
    """The successors (sorted global entry ids) of the neighbours `ids` whose value (`values`,
    aligned with `ids`) is `token`, where the successor lies in the same document."""
    right = ids[values == token]
    document_end = document_starts[np.searchsorted(document_starts, right, side="right")]
    return np.unique(right[right + 1 < document_end] + 1)


def pointer_matrix(candidates: list[np.ndarray | None]) -> np.ndarray | None:
    """The rows' candidates as one array [n, most candidates] padded with -1 (a row without
    candidates is all -1, so it is searched), or None when no row has any."""
    widths = [0 if c is None else len(c) for c in candidates]
    if not any(widths):
        return None
    out = np.full((len(candidates), max(widths)), -1, dtype=np.int64)
    for row, c in enumerate(candidates):
        if c is not None:
            out[row, : len(c)] = c
    return out


@dataclass(frozen=True)
class RowLinks:
    """Rows of one search call that may follow the pointers of an earlier row of the same call
    (a request's draft rows): row i follows the neighbours of row `previous[i]` (its first
    `ks[previous[i]]`) that predicted `fed[i]`, when at least `min_pointers[i]` (> 0) of their
    successors exist. `previous[i]` −1: the row's pointers, if any, are the call's own."""

    previous: np.ndarray  # int64 [n], each < its row
    fed: np.ndarray  # int64 [n]: the token row i was fed
    min_pointers: np.ndarray  # int64 [n]
    ks: np.ndarray  # int64 [n]: the neighbours each row keeps


def linked_candidates(
    links: RowLinks, row: int, ids: np.ndarray, tokens: np.ndarray, document_starts: np.ndarray | None
) -> np.ndarray | None:
    """Row `row`'s candidates from its previous row's neighbours (`ids`, `tokens` [n, k] of the
    call), or None where it has no previous row in the call or fewer than its `min_pointers`."""
    previous = int(links.previous[row])
    if previous < 0 or links.min_pointers[row] <= 0 or document_starts is None:
        return None
    kept = ids[previous, : links.ks[previous]]
    found = kept >= 0
    candidates = successors(kept[found], tokens[previous, : links.ks[previous]][found], int(links.fed[row]), document_starts)
    return candidates if len(candidates) >= links.min_pointers[row] else None


def find_linked(
    find: Callable,
    queries: np.ndarray,
    k: int,
    nprobe: int | None,
    pointers: np.ndarray | None,
    links: RowLinks,
    document_starts: np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`find(queries, k, nprobe, pointers) -> (distances, tokens, ids)` for rows linked to earlier
    rows of the same call: in rounds, a row after the row it follows, with its candidates from that
    row's answer. The searches and lookups of one call per round, made where the shard is."""
    depth = np.zeros(len(queries), dtype=np.int64)
    for row, previous in enumerate(links.previous.tolist()):
        if previous >= 0:
            depth[row] = depth[previous] + 1
    n = len(queries)
    out = (np.full((n, k), np.inf, np.float32), np.full((n, k), -1, np.int32), np.full((n, k), -1, np.int64))
    for level in range(int(depth.max()) + 1 if n else 0):
        rows = np.flatnonzero(depth == level)
        if level == 0:
            sent = None if pointers is None else pointers[rows]
        else:
            sent = pointer_matrix([linked_candidates(links, int(r), out[2], out[1], document_starts) for r in rows])
        for column, values in zip(out, find(queries[rows], k, nprobe, sent)):
            column[rows, : values.shape[1]] = values
    return out


def replay(
    search_ids: np.ndarray,
    search_distances: np.ndarray,
    targets: np.ndarray,
    continues: np.ndarray,
    values: np.ndarray,
    lookup: Callable[[int, np.ndarray], tuple[np.ndarray, np.ndarray]],
    document_starts: np.ndarray,
    min_pointers: int,
    skipped: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pointer following over a scored text, teacher-forced: position t's token is targets[t].

    `search_ids` / `search_distances` [T, k] are every position's own search, k the served k (the
    server keeps that many neighbours a step, so only their successors are candidates); `continues[t]` says
    position t directly follows t − 1 in the same document; `values` [entries] are the datastore's;
    `lookup(t, candidates)` scores candidate entries against position t's query, as the server
    does: (distances, ids) [k], nearest first, padded. Positions `skipped` by adaptive retrieval
    have no neighbours, so the next one cannot follow. Returns the neighbours each position used
    (distances, ids [T, k]) and whether it followed pointers instead of searching [T]."""
    distances, ids = search_distances.copy(), search_ids.copy()
    if skipped is not None:
        ids[skipped], distances[skipped] = -1, np.inf
    followed = np.zeros(len(ids), dtype=bool)
    for t in range(1, len(ids)):
        if not continues[t] or (skipped is not None and skipped[t]):
            continue
        previous = ids[t - 1][ids[t - 1] >= 0]
        candidates = successors(previous, values[previous], int(targets[t - 1]), document_starts)
        if len(candidates) >= max(min_pointers, 1):
            d, i = lookup(t, candidates)
            width = min(len(d), ids.shape[1])
            distances[t], ids[t] = np.inf, -1
            distances[t, :width], ids[t, :width] = d[:width], i[:width]
            followed[t] = True
    return distances, ids, followed


def shard_lookup(searchers: list, queries: np.ndarray, width: int) -> Callable[[int, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """`lookup` for `replay` over in-process shards (`ShardSearcher`s): the server's own scoring,
    every shard scoring its candidates, merged, padded to `width`."""
    from knnlm_core.search import merge_topk

    def lookup(t: int, candidates: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        d, _, i = merge_topk([s.lookup(queries[t : t + 1], candidates[None]) for s in searchers], width)
        out_d, out_i = np.full(width, np.inf, dtype=np.float32), np.full(width, -1, dtype=np.int64)
        out_d[: d.shape[1]], out_i[: i.shape[1]] = d[0], i[0]
        return out_d, out_i

    return lookup


def consecutive(positions: np.ndarray) -> np.ndarray:
    """continues[t] for `replay`: position t is the token right after position t − 1."""
    return np.r_[False, positions[1:] == positions[:-1] + 1]


def chain_start(ids: np.ndarray, values: np.ndarray, token: int, document_starts: np.ndarray) -> np.ndarray:
    """Where the stored text goes on after `token`, if the nearest neighbour `ids[0]` (values
    `values`, aligned with `ids`) predicted it: the entries after the neighbours that predicted it
    (their values are the next tokens), nearest first, those inside their document. Empty where
    the nearest neighbour did not predict `token`: no evidence of stored text."""
    if len(ids) == 0 or ids[0] < 0 or values[0] != token:
        return np.zeros(0, dtype=np.int64)
    return _inside(ids[(values == token) & (ids >= 0)] + 1, document_starts)


def chain_advance(
    chain: np.ndarray, tokens: list[int], document_starts: np.ndarray, values_at: Callable[[np.ndarray], np.ndarray]
) -> np.ndarray:
    """The chain after the request produced `tokens`: the entries whose stored text went on with
    them, each moved past them (empty once none did). `values_at(entry ids)` reads entries' values."""
    for token in tokens:
        if len(chain) == 0:
            break
        chain = _inside(chain[values_at(chain) == token] + 1, document_starts)
    return chain


def chain_draft(chain: np.ndarray, length: int, document_starts: np.ndarray, values_at: Callable[[np.ndarray], np.ndarray]) -> list[int]:
    """Up to `length` tokens of the stored text ahead of the chain: at each position the value
    most of its entries agree on (the nearer one's on a tie), for as long as one of them stays
    inside its document."""
    draft: list[int] = []
    while len(draft) < length and len(chain):
        read = values_at(chain)
        best = int(read[np.argmax((read[:, None] == read[None, :]).sum(axis=1))])
        draft.append(best)
        chain = _inside(chain[read == best] + 1, document_starts)
    return draft


def _inside(entries: np.ndarray, document_starts: np.ndarray) -> np.ndarray:
    """The `entries` that are not past the end of the document of the entry before them."""
    ends = document_starts[np.searchsorted(document_starts, entries - 1, side="right")]
    return entries[entries < ends]
