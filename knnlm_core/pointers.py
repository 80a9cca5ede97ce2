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

Plain functions over explicit arrays: the server follows pointers per request and step, the
evaluator replays them over a whole text with the same functions.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


def successors(ids: np.ndarray, values: np.ndarray, token: int, document_starts: np.ndarray) -> np.ndarray:
    """The successors (sorted global entry ids) of the neighbours `ids` whose value (`values`,
    aligned with `ids`) is `token`, where the successor lies in the same document."""
    right = ids[values == token]
    document_end = document_starts[np.searchsorted(document_starts, right, side="right")]
    return np.unique(right[right + 1 < document_end] + 1)


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
