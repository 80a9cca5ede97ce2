"""The requests the model runner holds, by request id, with each one's kNN settings, pinned
version and last neighbours.

The adapter reads each request's vLLM state (its `extra_args` and token lists) from the runner
the first time one of its rows reaches a step (the runner adapter's StepView.request). Its defaults are
filled and its datastore version pinned then: a hot-swap never changes a running request's
datastore, and a step never mixes versions for one request. A request the runner no longer holds
is forgotten at the next step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import numpy as np

from knnlm_serve.engine.request_params import LM_ONLY, WIRE_KEY, KnnParamError, KnnParams, RequestKnobs, with_defaults
from knnlm_serve.runtime import DatastoreInfo, Runtime

logger = logging.getLogger("knnlm_serve")


@dataclass
class LastNeighbours:
    """A request's neighbours at one sampling row, for pointer following at the row after it."""

    ids: np.ndarray  # int64 global entry ids (-1: padding)
    tokens: np.ndarray  # int32 their values
    outputs: int  # how many tokens the row's context held past the prompt (drafts included)
    drafts: tuple[int, ...] = ()  # the draft tokens among them, last in its context


@dataclass
class BatchRequest:
    extra_args: dict | None
    output_tokens: list[int] = field(default_factory=list)  # vLLM's own list, extended as tokens are accepted
    prompt_tokens: list[int] | None = None  # vLLM's own list (None: a prompt of embeddings)
    params: KnnParams | None = None  # set at the request's first step
    pinned: DatastoreInfo | None = None  # the version serving then; None when kNN is off
    last: list[LastNeighbours] = field(default_factory=list)  # its rows' neighbours at its last sampling step
    confident: bool = False  # the skip rule served its last sampling row p_LM (knn.overlap predicts the rule from it)

    def last_sampled(self) -> tuple[LastNeighbours, int] | None:
        """The neighbours of the row that the request's newest token was sampled from, and that
        token, if the row was in its last sampling step (under speculation: the row after its last
        accepted draft)."""
        outputs = len(self.output_tokens) - 1
        for last in self.last:
            accepted = self.output_tokens[outputs - len(last.drafts) : outputs]
            if last.outputs == outputs and tuple(accepted) == last.drafts:
                return last, self.output_tokens[-1]
        return None


class BatchRequests:
    def __init__(self, live: Callable[[], Collection[str]]) -> None:
        self._requests: dict[str, BatchRequest] = {}
        self._live = live  # the ids of the requests the runner holds now

    def __len__(self) -> int:
        return len(self._requests)

    def forget_finished(self) -> None:
        live = self._live()
        if any(request_id not in live for request_id in self._requests):
            self._requests = {i: r for i, r in self._requests.items() if i in live}

    def get(self, request_id: str) -> BatchRequest | None:
        return self._requests.get(request_id)

    def resolve(self, request_id: str, runtime: Runtime, read: Callable[[str], BatchRequest]) -> BatchRequest:
        """The request, its settings filled in and its version pinned if this is its first step;
        `read` makes it from vLLM's state the first time."""
        request = self._requests.get(request_id)
        if request is None:
            request = self._requests[request_id] = read(request_id)
        if request.params is None:
            try:
                knobs = RequestKnobs.from_extra_args(request.extra_args, runtime.datastores, runtime.knn.max_k)
                if runtime.admission_token is not None and knobs.admitted != runtime.admission_token:
                    raise KnnParamError(
                        WIRE_KEY, "...", "set by the API server's admission (with tenants, nothing else reaches a datastore)"
                    )
                request.params = with_defaults(knobs, runtime)
            except (KnnParamError, TypeError, ValueError) as e:  # the API server rejects these; offline callers or forged wires may not
                logger.warning("request %s is served LM-only: %s", request_id, e)
                request.params = LM_ONLY
            if request.params.active:
                request.pinned = runtime.datastores.get(request.params.datastore)
        return request

    def pinned_versions(self) -> set[tuple[str, int]]:
        self.forget_finished()
        return {r.pinned.key for r in self._requests.values() if r.pinned is not None}
