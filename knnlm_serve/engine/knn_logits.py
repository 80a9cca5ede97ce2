"""kNN-LM in a vLLM worker: from one `compute_logits` call to the mixed logits, top to bottom.

Per call (one per step for the sampling rows, one per request for prompt-logprob rows):
  1. rows: each logits row's token in the step and its request's batch slot (vllm_adapter);
  2. requests: each row's kNN settings and pinned datastore version (batch_requests);
  3. groups: rows of active requests, by pinned version;
  4. per group: the rows the LM is not confident on (knn_mixer.rows_to_search; the others keep
     p_LM), their keys (capture), their neighbours and λ, τ (knn_mixer.search, on the first
     tensor-parallel rank only, shared with the others): the k nearest from that version's
     shards, or for a sampling row whose last step's neighbours predicted the token it was fed,
     those neighbours' successors (pointer following); then log(λ·p_kNN + (1−λ)·p_LM) in
     place of those rows' logits (knn_mixer.mix). Sampling rows keep their neighbours for the
     next step.
vLLM computes sample and prompt logprobs from what this returns, so clients see the mixture.
"""

from __future__ import annotations

import numpy as np
import torch

from knnlm_core.pointers import successors
from knnlm_serve import metrics
from knnlm_serve.engine.batch_requests import BatchRequest, BatchRequests, LastNeighbours
from knnlm_serve.engine.capture import KeyCapture
from knnlm_serve.engine.explanations import Evidence, ExplanationLog
from knnlm_serve.engine.knn_mixer import KnnMixer
from knnlm_serve.retrieval import make_retriever
from knnlm_serve.runtime import DatastoreInfo, Runtime


class KnnLogits:
    def __init__(self, runtime: Runtime, batch: BatchRequests, capture: KeyCapture, step):
        self.runtime = runtime
        self.batch = batch
        self.capture = capture
        self.step = step  # vllm_adapter.StepView: the runner's view of this step
        self.mixer = KnnMixer(make_retriever(runtime.knn, runtime.ray_address))
        self.explanations = ExplanationLog()

    def set_runtime(self, runtime: Runtime) -> None:
        """A new serving set from the registry; versions no running request is pinned to are released."""
        self.runtime = runtime
        self.mixer.release(self.batch.pinned_versions() | {i.key for i in runtime.datastores.values()})

    def __call__(self, logits: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        rows = self.step.rows_of(hidden_states, self.capture.hidden)
        if rows is None:  # vLLM's warm-up and profiling calls
            return logits
        groups: dict[tuple[str, int], list[int]] = {}
        versions: dict[tuple[str, int], DatastoreInfo] = {}
        params, requests, last = [], [], []
        for row, slot in enumerate(rows.slot.tolist()):
            request = self.batch.resolve(slot, self.runtime)
            params.append(request.params)
            requests.append(request)
            last.append(request.last)
            if rows.sampling:
                request.last = None  # kept only if this row finds neighbours
            if not request.params.active:
                continue
            if request.pinned is None:  # unloaded between admission and the request's first step
                metrics.FALLBACKS.labels(request.params.datastore, "datastore_unloaded").inc()
                continue
            versions[request.pinned.key] = request.pinned
            groups.setdefault(request.pinned.key, []).append(row)
        if not groups:
            return logits
        logits = logits.float()
        explained = [r for members in groups.values() for r in members if params[r].explain_id is not None]
        evidence = Evidence(self.step.positions(rows), rows.sampling, logits, explained) if explained else None
        for key, group in groups.items():
            info = versions[key]
            if evidence:
                evidence.skipped(group, info)
            group = self.mixer.rows_to_search(logits, group, [params[r] for r in group], info.name)
            if not group:
                continue
            token_index = torch.as_tensor(rows.token_index[group], device=hidden_states.device)
            keys = self.capture.keys(info.key_type, token_index, hidden_states[group])
            queries = keys.float().cpu().numpy()
            candidates = [self._pointers(requests[r], last[r], info) if rows.sampling else None for r in group]
            found = self.step.on_first_rank(self.mixer.search, info, queries, [params[r] for r in group], self.runtime, candidates)
            if evidence:
                evidence.found(group, info, found)
            if found is None:
                continue
            self.mixer.mix(logits, group, found, info.name)
            if rows.sampling:
                for i, r in enumerate(group):
                    requests[r].last = LastNeighbours(found.ids[i], found.tokens[i], len(requests[r].output_tokens))
        if evidence:
            evidence.record(self.explanations, requests)
        return logits

    def _pointers(self, request: BatchRequest, last: LastNeighbours | None, info: DatastoreInfo) -> np.ndarray | None:
        """Successors of the request's last neighbours that predicted the token it sampled from them."""
        token = request.sampled_since(last)
        starts = self.mixer.document_starts(info) if request.params.min_pointers else None
        if token is None or starts is None:
            return None
        found = last.ids >= 0
        return successors(last.ids[found], last.tokens[found], token, starts)
