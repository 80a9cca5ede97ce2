"""kNN-LM in a vLLM worker: from one `compute_logits` call to the mixed logits, top to bottom.

Per call (one per step for the sampling rows, one per request for prompt-logprob rows):
  1. rows: each logits row's token in the step and its request's batch slot (vllm_adapter);
  2. requests: each row's kNN settings and pinned datastore version (batch_requests);
  3. groups: rows of active requests, by pinned version;
  4. per group: the rows the LM is not confident on (knn_mixer.rows_to_search; the others keep
     p_LM), their keys (capture), the k nearest from that version's shards and the
     rows' λ, τ (knn_mixer.search, on the first tensor-parallel rank only, shared with the
     others), then log(λ·p_kNN + (1−λ)·p_LM) in place of those rows' logits (knn_mixer.mix).
vLLM computes sample and prompt logprobs from what this returns, so clients see the mixture.
"""

from __future__ import annotations

import torch

from knnlm_serve import metrics
from knnlm_serve.engine.batch_requests import BatchRequests
from knnlm_serve.engine.capture import KeyCapture
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

    def set_runtime(self, runtime: Runtime) -> None:
        """A new serving set from the registry; versions no running request is pinned to are released."""
        self.runtime = runtime
        self.mixer.retriever.release(self.batch.pinned_versions() | {i.key for i in runtime.datastores.values()})

    def __call__(self, logits: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        rows = self.step.rows_of(hidden_states, self.capture.hidden)
        if rows is None:  # vLLM's warm-up and profiling calls
            return logits
        groups: dict[tuple[str, int], list[int]] = {}
        versions: dict[tuple[str, int], DatastoreInfo] = {}
        params = []
        for row, slot in enumerate(rows.slot.tolist()):
            request = self.batch.resolve(slot, self.runtime)
            params.append(request.params)
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
        for key, group in groups.items():
            info = versions[key]
            group = self.mixer.rows_to_search(logits, group, [params[r] for r in group], info.name)
            if not group:
                continue
            token_index = torch.as_tensor(rows.token_index[group], device=hidden_states.device)
            keys = self.capture.keys(info.key_type, token_index, hidden_states[group])
            queries = keys.float().cpu().numpy()
            found = self.step.on_first_rank(self.mixer.search, info, queries, [params[r] for r in group], self.runtime)
            if found is not None:
                self.mixer.mix(logits, group, found, info.name)
        return logits
