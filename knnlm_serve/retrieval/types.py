"""What a search returns, and how it fails."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from knnlm_core.errors import ErrorKind, KnnlmError


class RetrievalError(KnnlmError):
    """A search that produced no usable answer; `reason` labels the fallback metric."""

    kind = ErrorKind.UNAVAILABLE

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


@dataclass
class SearchResult:
    distances: np.ndarray
    tokens: np.ndarray
    ids: np.ndarray  # global entry ids
    shard_seconds: dict[str, float]
    failed_shards: dict[str, str] = field(default_factory=dict)  # shard -> reason
    transports: dict[str, str] = field(default_factory=dict)  # shard -> "graph" (compiled), "call" or "local"


def timed(method, *args):
    """(distances, tokens, ids, seconds) of a shard's answer."""
    start = time.perf_counter()
    return (*method(*args), time.perf_counter() - start)
