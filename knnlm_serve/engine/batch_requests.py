"""The requests in vLLM's persistent batch, by slot, with each one's kNN settings and pinned version.

vLLM hands every logits processor a `BatchUpdate` before each step (requests added to, removed
from and moved within the batch, with their `SamplingParams`); slot i is logits row i of the
step's sampling call. A request's defaults are filled, and its datastore version pinned, the first
time it reaches a step: a hot-swap never changes a running request's datastore, and a step never
mixes versions for one request.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

from knnlm_serve.engine.request_params import LM_ONLY, KnnParamError, KnnParams, RequestKnobs, with_defaults
from knnlm_serve.runtime import DatastoreInfo, Runtime

logger = logging.getLogger("knnlm_serve")


@dataclass
class LastNeighbours:
    """A request's neighbours at its last sampling row, for pointer following at the next one."""

    ids: np.ndarray  # int64 global entry ids (-1: padding)
    tokens: np.ndarray  # int32 their values
    outputs: int  # how many tokens the request had generated then


@dataclass
class BatchRequest:
    extra_args: dict | None
    output_tokens: list[int] = field(default_factory=list)  # vLLM's own list, appended as tokens are sampled
    prompt_tokens: list[int] | None = None  # vLLM's own list (None: a prompt of embeddings)
    params: KnnParams | None = None  # set at the request's first step
    pinned: DatastoreInfo | None = None  # the version serving then; None when kNN is off
    last: LastNeighbours | None = None

    def sampled_since(self, last: LastNeighbours | None) -> int | None:
        """The token sampled from the row that had `last` as neighbours, if that was the previous sampling row."""
        if last is None or len(self.output_tokens) != last.outputs + 1:
            return None
        return self.output_tokens[-1]


class BatchRequests:
    def __init__(self) -> None:
        self._slots: dict[int, BatchRequest] = {}

    def __len__(self) -> int:
        return len(self._slots)

    def clear(self) -> None:
        """Forget every request: each is then served as plain vLLM would (`resolve`)."""
        self._slots.clear()

    def apply(self, update: BatchUpdate | None) -> None:
        """vLLM's documented order: removed, then added, then moved."""
        if update is None:
            return
        for slot in update.removed:
            self._slots.pop(slot, None)
        for slot, sampling_params, prompt_tokens, output_tokens in update.added:
            self._slots[slot] = BatchRequest(sampling_params.extra_args, output_tokens, prompt_tokens)
        for a, b, direction in update.moved:
            if direction == MoveDirectionality.SWAP:
                self._slots[a], self._slots[b] = self._slots.get(b), self._slots.get(a)
                self._slots = {s: r for s, r in self._slots.items() if r is not None}
            else:
                request = self._slots.pop(a, None)
                if request is not None:
                    self._slots[b] = request

    def resolve(self, slot: int, runtime: Runtime) -> BatchRequest:
        """The request in `slot`, its settings filled in and its version pinned if this is its first step."""
        request = self._slots.get(slot)
        if request is None:  # not announced by a BatchUpdate: serve it as plain vLLM would
            return BatchRequest(None, params=LM_ONLY)
        if request.params is None:
            try:
                knobs = RequestKnobs.from_extra_args(request.extra_args, runtime.datastores, runtime.knn.max_k)
                request.params = with_defaults(knobs, runtime)
            except KnnParamError as e:  # the API server rejects these; offline callers may not
                logger.warning("a request in slot %d is served LM-only: %s", slot, e)
                request.params = LM_ONLY
            if request.params.active:
                request.pinned = runtime.datastores.get(request.params.datastore)
        return request

    def pinned_versions(self) -> set[tuple[str, int]]:
        return {r.pinned.key for r in self._slots.values() if r.pinned is not None}
