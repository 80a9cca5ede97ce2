"""Shards' answers padded to k and merged into the global top-k."""

from __future__ import annotations

import numpy as np


def pad(distances: np.ndarray, tokens: np.ndarray, ids: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    missing = k - distances.shape[1]
    if missing <= 0:
        return distances, tokens, ids.astype(np.int64)
    n = distances.shape[0]
    return (
        np.concatenate([distances, np.full((n, missing), np.inf, np.float32)], axis=1),
        np.concatenate([tokens, np.full((n, missing), -1, np.int32)], axis=1),
        np.concatenate([ids.astype(np.int64), np.full((n, missing), -1, np.int64)], axis=1),
    )


def merge_topk(answers: list[tuple[np.ndarray, ...]], k: int) -> tuple[np.ndarray, ...]:
    """Merge per-shard (distances, tokens, ids) answers into the global k nearest, sorted by distance."""
    if len(answers) == 1:  # one shard's answer is already its top-k, sorted
        return tuple(a[:, :k] for a in answers[0])
    columns = [np.concatenate(column, axis=1) for column in zip(*answers)]
    order = np.argsort(columns[0], axis=1, kind="stable")[:, :k]
    return tuple(np.take_along_axis(c, order, axis=1) for c in columns)
