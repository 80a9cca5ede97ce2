"""Which request and which token each row of a `compute_logits` call belongs to.

vLLM flattens a step's tokens request by request; `query_start_loc[i]` is where the request in
batch slot i starts. A sampling call has one row per request, its last scheduled token (no
speculative decoding). A prompt-logprob call has a run of consecutive tokens of one request.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LogitsRows:
    token_index: np.ndarray  # int64 [n]: the row's token in the step's flattened batch
    slot: np.ndarray  # int64 [n]: the row's request in the persistent batch
    sampling: bool  # one row per request, the one its next token is sampled from


def sampling_rows(query_start_loc: np.ndarray, num_reqs: int) -> LogitsRows:
    return LogitsRows(query_start_loc[1 : num_reqs + 1].astype(np.int64) - 1, np.arange(num_reqs, dtype=np.int64), True)


def prompt_rows(query_start_loc: np.ndarray, num_reqs: int, first_token: int, count: int) -> LogitsRows:
    token_index = np.arange(first_token, first_token + count, dtype=np.int64)
    slot = np.searchsorted(query_start_loc[1 : num_reqs + 1], token_index, side="right")
    return LogitsRows(token_index, slot.astype(np.int64), False)
