"""Which request and which token each row of a `compute_logits` call belongs to.

vLLM flattens a step's tokens request by request; `query_start_loc[i]` is where the request in
batch slot i starts. A sampling call has, per request, its last scheduled token and, under
speculative decoding, the `d` tokens before it, which are the request's draft tokens: d + 1 rows,
the j-th one predicting the token after the first j drafts (`draft` = j). A prompt-logprob call
has a run of consecutive tokens of one request (V1), or of the whole step (Model Runner V2, which
keeps only the rows of requests that asked).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class LogitsRows:
    token_index: np.ndarray  # int64 [n]: the row's token in the step's flattened batch
    slot: np.ndarray  # int64 [n]: the row's request in the persistent batch
    sampling: bool  # the rows vLLM samples (and verifies drafts) from
    draft: np.ndarray  # int64 [n]: how many of the request's draft tokens the row's context holds (0 without speculation)
    kept: np.ndarray | None = None  # bool [n]: the rows whose logits vLLM uses (None: all); the others are not mixed


def sampling_rows(query_start_loc: np.ndarray, num_reqs: int, drafts: np.ndarray | None = None) -> LogitsRows:
    """The sampling rows; `drafts[i]`: the number of draft tokens scheduled for slot i (None: none)."""
    last = query_start_loc[1 : num_reqs + 1].astype(np.int64) - 1
    if drafts is None or not drafts.any():
        return LogitsRows(last, np.arange(num_reqs, dtype=np.int64), True, np.zeros(num_reqs, dtype=np.int64))
    per_request = drafts.astype(np.int64) + 1
    slot = np.repeat(np.arange(num_reqs, dtype=np.int64), per_request)
    starts = np.cumsum(per_request) - per_request
    draft = np.arange(int(per_request.sum()), dtype=np.int64) - np.repeat(starts, per_request)
    return LogitsRows(last[slot] - drafts[slot] + draft, slot, True, draft)


def prompt_rows(query_start_loc: np.ndarray, num_reqs: int, first_token: int, count: int) -> LogitsRows:
    token_index = np.arange(first_token, first_token + count, dtype=np.int64)
    slot = np.searchsorted(query_start_loc[1 : num_reqs + 1], token_index, side="right")
    return LogitsRows(token_index, slot.astype(np.int64), False, np.zeros(count, dtype=np.int64))


def first_viewed_row(hidden_states: torch.Tensor, model_output: torch.Tensor | None) -> int | None:
    """The row of the model's output where `hidden_states` starts, if it is a view of it (the
    prompt-logprob calls pass slices); None for a copy (the sampling call gathers its rows)."""
    if (
        model_output is None
        or hidden_states.shape[0] == 0
        or hidden_states.untyped_storage().data_ptr() != model_output.untyped_storage().data_ptr()
    ):
        return None
    return (hidden_states.storage_offset() - model_output.storage_offset()) // model_output.stride(0)
