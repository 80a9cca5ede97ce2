"""The requests in vLLM's persistent batch, by slot, with each one's kNN settings and pinned version.

vLLM hands every logits processor a `BatchUpdate` before each step (requests added to, removed
from and moved within the batch, with their `SamplingParams`); slot i is logits row i of the
step's sampling call. A request's settings are parsed, and its datastore version pinned, the first
time it reaches a step: a hot-swap never changes a running request's datastore, and a step never
mixes versions for one request.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

from knnlm_serve.engine.request_params import LM_ONLY, KnnParamError, KnnParams, parse_knn_params
from knnlm_serve.runtime import DatastoreInfo, Runtime

logger = logging.getLogger("knnlm_serve")


@dataclass
class BatchRequest:
    extra_args: dict | None
    params: KnnParams | None = None  # set at the request's first step
    pinned: DatastoreInfo | None = None  # the version serving then; None when kNN is off


class BatchRequests:
    def __init__(self) -> None:
        self._slots: dict[int, BatchRequest] = {}

    def apply(self, update: BatchUpdate | None) -> None:
        """vLLM's documented order: removed, then added, then moved."""
        if update is None:
            return
        for slot in update.removed:
            self._slots.pop(slot, None)
        for slot, sampling_params, _, _ in update.added:
            self._slots[slot] = BatchRequest(sampling_params.extra_args)
        for a, b, direction in update.moved:
            if direction == MoveDirectionality.SWAP:
                self._slots[a], self._slots[b] = self._slots.get(b), self._slots.get(a)
                self._slots = {s: r for s, r in self._slots.items() if r is not None}
            else:
                request = self._slots.pop(a, None)
                if request is not None:
                    self._slots[b] = request

    def resolve(self, slot: int, runtime: Runtime) -> BatchRequest:
        """The request in `slot`, its settings parsed and its version pinned if this is its first step."""
        request = self._slots.get(slot)
        if request is None:  # not announced by a BatchUpdate: serve it as plain vLLM would
            return BatchRequest(None, LM_ONLY)
        if request.params is None:
            try:
                request.params = parse_knn_params(request.extra_args, runtime)
            except KnnParamError as e:  # the API server rejects these; offline callers may not
                logger.warning("a request in slot %d is served LM-only: %s", slot, e)
                request.params = LM_ONLY
            if request.params.active:
                request.pinned = runtime.datastores.get(request.params.datastore)
        return request

    def pinned_versions(self) -> set[tuple[str, int]]:
        return {r.pinned.key for r in self._slots.values() if r.pinned is not None}
