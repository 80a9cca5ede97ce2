"""kNN-LM inside vLLM's batched step: a LlamaForCausalLM whose `compute_logits` mixes in p_kNN.

Data path, per call of `compute_logits(hidden_states)` (one per step for sampling rows, and one
per request for prompt-logprob rows):
  1. map each row to its token in the step and its request (from the V1 model runner's batch);
  2. parse each request's `extra_args` into KnnParams; group the active rows by datastore;
  3. take each row's key vector (`final` = these hidden states, `ffn_input` = the captured input
     of the last layer's MLP), search the datastore's shards, merge into the global top-k;
  4. replace those rows' logits by log(λ·p_kNN + (1−λ)·p_LM).
vLLM computes sample and prompt logprobs from what this returns, so clients see the mixture.
"""

from __future__ import annotations

import logging
import sys
from collections import defaultdict

import numpy as np
import torch
from vllm.model_executor.models.llama import LlamaForCausalLM

from knnlm_serve.interpolate import interpolate
from knnlm_serve.request_params import KnnParamError, KnnParams, parse_knn_params
from knnlm_serve.retrieval import RetrievalError, make_retriever
from knnlm_serve.runtime import Runtime

logger = logging.getLogger("knnlm_serve")


class KnnLlamaForCausalLM(LlamaForCausalLM):
    runtime: Runtime  # set by the plugin before vLLM builds the model

    def __init__(self, *, vllm_config, prefix: str = "", **kwargs):
        super().__init__(vllm_config=vllm_config, prefix=prefix, **kwargs)
        self._captured: dict[str, torch.Tensor] = {}
        self._runner = None
        self._retriever = make_retriever(self.runtime)
        # Registered before the first (compiled) forward so Dynamo traces it into the graph.
        self.model.layers[self.model.end_layer - 1].mlp.register_forward_pre_hook(self._capture_ffn_input)

    def _capture_ffn_input(self, module, args):
        self._captured["ffn_input"] = args[0]

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs):
        self._captured.pop("ffn_input", None)
        hidden = super().forward(input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs)
        self._captured["final"] = hidden
        ffn_input = self._captured.get("ffn_input")
        if ffn_input is None or ffn_input.shape[0] != hidden.shape[0]:
            raise RuntimeError("knnlm: the last layer's MLP input was not captured (a cached compiled graph without the hook?)")
        return hidden

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        logits = super().compute_logits(hidden_states)
        if logits is None:
            return logits
        rows = self._rows_of(hidden_states)
        if rows is None:
            return logits
        token_index, params = rows
        groups: dict[str, list[int]] = defaultdict(list)
        for row, p in enumerate(params):
            if p.active:
                groups[p.datastore].append(row)
        if not groups:
            return logits
        logits = logits.float()
        for name, group in groups.items():
            self._mix_datastore(logits, name, group, token_index, params)
        return logits

    def _mix_datastore(self, logits, name: str, group: list[int], token_index: np.ndarray, params: list[KnnParams]) -> None:
        info = self.runtime.datastores[name]
        keys = self._captured[info.key_type][torch.as_tensor(token_index[group], device=logits.device)]
        ks = np.array([params[r].k for r in group])
        nprobe = self.runtime.knn.nprobe or info.nprobe
        try:
            distances, tokens = self._retriever.search(name, keys.float().cpu().numpy(), int(ks.max()), nprobe)
        except RetrievalError as e:
            logger.warning("knnlm: serving %d row(s) LM-only: %s", len(group), e)
            return
        beyond_k = np.arange(distances.shape[1])[None, :] >= ks[:, None]  # rows that asked for fewer
        distances[beyond_k], tokens[beyond_k] = np.inf, -1
        index = torch.as_tensor(group, device=logits.device)
        logits[index] = interpolate(
            logits[index],
            torch.from_numpy(distances).to(logits.device),
            torch.from_numpy(tokens).to(logits.device),
            torch.tensor([params[r].lambda_ for r in group], device=logits.device),
            torch.tensor([params[r].temperature for r in group], device=logits.device),
        )

    def _rows_of(self, hidden_states: torch.Tensor) -> tuple[np.ndarray, list[KnnParams]] | None:
        """Each logits row's token index in this step's flattened batch and its request's params.

        Sampling calls pass `hidden[logits_indices]` (a copy, one row per request, last token);
        prompt-logprob calls pass a view `hidden[start:start + n]` of one request's tokens."""
        runner = self._model_runner()
        batch = runner.input_batch
        num_reqs = batch.num_reqs
        if num_reqs == 0:  # vLLM's profiling and warm-up calls
            return None
        query_start = runner.query_start_loc.np[: num_reqs + 1]
        full = self._captured["final"]
        if hidden_states.untyped_storage().data_ptr() == full.untyped_storage().data_ptr() and hidden_states.shape[0] > 0:
            start = (hidden_states.storage_offset() - full.storage_offset()) // full.stride(0)
            token_index = np.arange(start, start + hidden_states.shape[0])
        else:
            if runner.speculative_config is not None or hidden_states.shape[0] != num_reqs:
                raise RuntimeError("knnlm: speculative decoding is not supported")
            token_index = query_start[1:] - 1
        request_index = np.searchsorted(query_start[1:], token_index, side="right")
        params = [self._params(runner, batch.req_ids[i]) for i in request_index]
        return token_index, params

    def _params(self, runner, req_id: str) -> KnnParams:
        extra_args = runner.requests[req_id].sampling_params.extra_args
        try:
            return parse_knn_params(extra_args, self.runtime.knn)
        except KnnParamError as e:  # the API server rejects these; offline callers may not
            logger.warning("knnlm: request %s served LM-only: %s", req_id, e)
            return parse_knn_params({"knn": False}, self.runtime.knn)

    def _model_runner(self):
        """The V1 model runner that called us (found once, by walking up the call stack)."""
        if self._runner is None:
            from vllm.v1.worker.gpu_model_runner import GPUModelRunner

            frame = sys._getframe(2)
            while frame is not None and not isinstance(frame.f_locals.get("self"), GPUModelRunner):
                frame = frame.f_back
            if frame is None:
                raise RuntimeError("knnlm: compute_logits was not called by vLLM's V1 model runner")
            self._runner = frame.f_locals["self"]
        return self._runner
