"""Draft tokens from the datastore, for vLLM's speculative decoding (`knn.draft_tokens`).

Where a request follows stored text, the datastore already holds what comes next. After each
step, the row its newest token was sampled from kept its neighbours (batch_requests); where the
nearest of them predicted that token, the entries after them hold the stored continuation
(knnlm_core.pointers.stored_continuation), and that is the draft. Elsewhere there is none, so
steps off the stored text cost one lookup per request. vLLM's V1 runner loads this class as a
`custom_class` proposer and calls `propose` after each step; the next step verifies the drafts
against the logits KnnLogits mixes row by row, so the output is the kNN-LM's own and drafts
change only the speed. An error means no drafts for that step, counted.
"""

from __future__ import annotations

import logging

from knnlm_core.pointers import stored_continuation
from knnlm_serve import metrics
from knnlm_serve.engine.batch_requests import BatchRequest

logger = logging.getLogger("knnlm_serve")

DRAFTER = "knnlm_serve.engine.drafts.DatastoreDrafter"


class DatastoreDrafter:
    def __init__(self, vllm_config):
        self.length = vllm_config.speculative_config.num_speculative_tokens
        self._model = None
        self._proposed: dict[str, tuple[str, int, list[int]]] = {}  # request id -> (datastore, its outputs then, draft)

    def load_model(self, model) -> None:
        """vLLM hands over the served model: its `knn_logits` exists once the worker is attached."""
        self._model = model

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec, token_ids_cpu, slot_mappings=None) -> list[list[int]]:
        """Each batch slot's draft (empty: none)."""
        knn = getattr(self._model, "knn_logits", None)
        slots = len(sampled_token_ids)
        if knn is None:
            return [[] for _ in range(slots)]
        try:
            return self._drafts(knn, slots)
        except Exception as e:  # noqa: BLE001 - fail open: the step goes on without drafts
            self._proposed = {}
            metrics.DRAFT_FAILURES.inc()
            knn.faults.failed("propose", e, rows=0)
            return [[] for _ in range(slots)]

    def _drafts(self, knn, slots: int) -> list[list[int]]:
        proposed, self._proposed = self._proposed, {}
        drafts = []
        for slot in range(slots):
            request_id = knn.step.request_id(slot)
            request = knn.batch.get(request_id)
            if request is not None and request_id in proposed:
                _count_accepted(request, *proposed[request_id])
            draft = self._draft(knn, request) if request is not None else []
            if draft:
                self._proposed[request_id] = (request.pinned.name, len(request.output_tokens), draft)
                metrics.DRAFTS.labels(request.pinned.name).inc()
                metrics.DRAFT_TOKENS.labels(request.pinned.name).inc(len(draft))
            drafts.append(draft)
        return drafts

    def _draft(self, knn, request: BatchRequest) -> list[int]:
        """The stored continuation after the request's newest token, where its neighbours give one."""
        info = request.pinned
        if info is None or not request.params.drafts or info.key in knn.faults.unhealthy:
            return []
        sampled = request.last_sampled()
        starts = knn.mixer.document_starts(info) if sampled is not None else None
        if starts is None:
            return []
        last, token = sampled
        return stored_continuation(last.ids, last.tokens, token, starts, knn.mixer.values(info).at, self.length)


def _count_accepted(request: BatchRequest, datastore: str, outputs: int, draft: list[int]) -> None:
    """The draft tokens the engine accepted: those the request's output now repeats, from the first
    (after a rejected draft token it samples a different one)."""
    produced = request.output_tokens[outputs : outputs + len(draft)]
    accepted = next((i for i, (a, b) in enumerate(zip(draft, produced)) if a != b), min(len(draft), len(produced)))
    metrics.DRAFT_ACCEPTED_TOKENS.labels(datastore).inc(accepted)
