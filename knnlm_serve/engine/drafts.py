"""Draft tokens from the datastore, for vLLM's speculative decoding (`knn.draft_tokens`).

Where a request follows stored text, the datastore already holds what comes next. After each
step, the row its newest token was sampled from kept its neighbours (batch_requests); where the
nearest of them predicted that token, the entries after them start a chain: where the stored
text goes on. The chain moves along with the request's tokens for as long as they match the
stored ones, also through steps whose rows were not searched (the skip rule), and the stored
tokens ahead of it are the draft (knnlm_core.pointers.chain_*). The draft grows with the tokens
the request has followed its chain for: one token for a new chain (where a nearest neighbour
predicted a common token by chance, the rejected draft costs one verification row), then up to
`num_speculative_tokens`. A request's own text may repeat too: vLLM's prompt lookup (its
`ngram` drafter, n-grams of CONTEXT_NGRAM tokens) drafts what followed the last place its newest
tokens occurred in its prompt and output, for kNN-off requests too. The longer of the two drafts
is proposed (a new chain's single token loses to a repeated n-gram's continuation; a tie goes to
the datastore). Off the stored text, in text that does not repeat itself, neither finds anything
and there is no draft. vLLM's V1 runner loads this class as a `custom_class` proposer and calls `propose`
after each step; the next step verifies the drafts against the logits KnnLogits mixes row by
row, so the output is the kNN-LM's own and drafts change only the speed. An error means no
drafts for that step, counted.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from knnlm_core.pointers import chain_advance, chain_draft, chain_start
from knnlm_serve import metrics
from knnlm_serve.engine.batch_requests import BatchRequest
from knnlm_serve.engine.vllm_adapter import prompt_lookup

DRAFTER = "knnlm_serve.engine.drafts.DatastoreDrafter"
CONTEXT_NGRAM = (2, 4)  # prompt lookup's n-gram lengths, as vLLM's docs suggest for `ngram`


@dataclass
class Chain:
    version: tuple[str, int]
    outputs: int  # the request's output tokens when the chain was last moved
    entries: np.ndarray  # the entries whose stored text the request is reading (knnlm_core.pointers)
    followed: int  # the tokens the request has produced along the chain since it started


@dataclass
class Proposed:
    datastore: str  # the request's datastore ('none': kNN off), for the metrics
    source: str  # datastore | context
    outputs: int  # the request's output tokens when it was drafted
    draft: list[int]


class DatastoreDrafter:
    def __init__(self, vllm_config):
        self.length = vllm_config.speculative_config.num_speculative_tokens
        self._context = prompt_lookup(vllm_config, *CONTEXT_NGRAM)
        self._model = None
        self._chains: dict[str, Chain] = {}  # request id -> its chain
        self._proposed: dict[str, Proposed] = {}  # request id -> its last draft

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
            return self._drafts(knn, sampled_token_ids, num_tokens_no_spec, token_ids_cpu)
        except Exception as e:  # noqa: BLE001 - fail open: the step goes on without drafts
            self._proposed, self._chains = {}, {}
            metrics.DRAFT_FAILURES.inc()
            knn.faults.failed("propose", e, rows=0)
            return [[] for _ in range(slots)]

    def _drafts(self, knn, sampled_token_ids, num_tokens_no_spec, token_ids_cpu) -> list[list[int]]:
        """Each request's longer draft of two: the datastore's, where it reads stored text, and
        prompt lookup's, where its newest tokens repeat earlier ones (a tie goes to the datastore)."""
        proposed, self._proposed = self._proposed, {}
        chains, self._chains = self._chains, {}
        slots = len(sampled_token_ids)
        ids = [knn.step.request_id(slot) for slot in range(slots)]
        requests = [knn.batch.get(request_id) for request_id in ids]
        drafts, sources = [[] for _ in range(slots)], ["datastore"] * slots
        for slot, (request_id, request) in enumerate(zip(ids, requests)):
            if request is not None and request_id in proposed:
                _count_accepted(request, proposed[request_id])
            if request is not None and request.params.drafts and request.pinned is not None:
                drafts[slot] = self._draft(knn, request_id, request, chains.get(request_id))
        lookup = [
            s for s, r in enumerate(requests) if r is not None and r.params.drafts and len(drafts[s]) < self.length and sampled_token_ids[s]
        ]
        if lookup:
            from_context = self._context.batch_propose(slots, lookup, num_tokens_no_spec, token_ids_cpu, self.length)
            for slot in lookup:
                if len(from_context[slot]) > len(drafts[slot]):
                    drafts[slot], sources[slot] = from_context[slot], "context"
        for request_id, request, draft, source in zip(ids, requests, drafts, sources):
            if draft:
                datastore = metrics.datastore_label(request.pinned.name) if request.pinned is not None else "none"
                self._proposed[request_id] = Proposed(datastore, source, len(request.output_tokens), draft)
                metrics.child(metrics.DRAFTS, datastore, source).inc()
                metrics.child(metrics.DRAFT_TOKENS, datastore, source).inc(len(draft))
        return drafts

    def _draft(self, knn, request_id: str, request: BatchRequest, chain: Chain | None) -> list[int]:
        """The stored text ahead of the request's chain: the one it had, moved along its new
        tokens, or else one started from its newest row's neighbours."""
        info = request.pinned
        if info.key in knn.faults.unhealthy:
            return []
        starts = knn.mixer.document_starts(info)
        if starts is None:
            return []
        values_at = knn.mixer.values(info).at
        entries, followed = np.zeros(0, dtype=np.int64), 0
        if chain is not None and chain.version == info.key:
            produced = request.output_tokens[chain.outputs :]
            entries, followed = chain_advance(chain.entries, produced, starts, values_at), chain.followed + len(produced)
        if len(entries) == 0 and (sampled := request.last_sampled()) is not None:
            last, token = sampled
            entries, followed = chain_start(last.ids, last.tokens, token, starts), 0
        if len(entries):
            self._chains[request_id] = Chain(info.key, len(request.output_tokens), entries, followed)
        return chain_draft(entries, min(self.length, followed + 1), starts, values_at)


def _count_accepted(request: BatchRequest, proposed: Proposed) -> None:
    """The draft tokens the engine accepted: those the request's output now repeats, from the first
    (after a rejected draft token it samples a different one)."""
    draft = proposed.draft
    produced = request.output_tokens[proposed.outputs : proposed.outputs + len(draft)]
    accepted = next((i for i, (a, b) in enumerate(zip(draft, produced)) if a != b), min(len(draft), len(produced)))
    metrics.child(metrics.DRAFT_ACCEPTED_TOKENS, proposed.datastore, proposed.source).inc(accepted)
