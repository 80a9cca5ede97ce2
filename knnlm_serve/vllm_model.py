"""kNN-LM inside vLLM's batched step: a LlamaForCausalLM whose `compute_logits` mixes in p_kNN.

Data path, per call of `compute_logits(hidden_states)` (one per step for sampling rows, and one
per request for prompt-logprob rows):
  1. map each row to its token in the step and its request (from the V1 model runner's batch);
  2. parse each request's `extra_args` into KnnParams and find the datastore version the request
     is pinned to (the one serving when the request started: a hot-swap never changes a running
     request's datastore, and a step never mixes versions for one request);
  3. take each row's key vector (`final` = these hidden states, `ffn_input` = the captured input
     of the last layer's MLP), search that version's shards, merge into the global top-k;
  4. replace those rows' logits by log(λ·p_kNN + (1−λ)·p_LM).
vLLM computes sample and prompt logprobs from what this returns, so clients see the mixture.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections import defaultdict

import numpy as np
import torch
from vllm.model_executor.models.llama import LlamaForCausalLM

from knnlm_serve import metrics
from knnlm_serve.interpolate import adaptive_lambda, interpolate
from knnlm_serve.request_params import KnnParamError, KnnParams, parse_knn_params
from knnlm_serve.retrieval import RetrievalError, make_retriever
from knnlm_serve.runtime import DatastoreInfo, Runtime, RuntimeWatcher, in_use_file, runtime_path

logger = logging.getLogger("knnlm_serve")


class KnnLlamaForCausalLM(LlamaForCausalLM):
    def __init__(self, *, vllm_config, prefix: str = "", **kwargs):
        super().__init__(vllm_config=vllm_config, prefix=prefix, **kwargs)
        self._captured: dict[str, torch.Tensor] = {}
        self._runner = None
        self._watcher = RuntimeWatcher(runtime_path())
        runtime = self._watcher.current()
        self._retriever = make_retriever(runtime.knn, runtime.ray_address)
        self._step_runtime: Runtime = runtime
        self._pins: dict[str, DatastoreInfo] = {}  # request id -> datastore version it started on
        self._published_in_use: set | None = None
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
        token_index, req_ids = rows
        groups: dict[tuple[str, int], list[int]] = defaultdict(list)
        params: list[KnnParams] = []
        infos: dict[tuple[str, int], DatastoreInfo] = {}
        for row, req_id in enumerate(req_ids):
            p = self._params(req_id)
            params.append(p)
            if p.active:
                info = self._pinned(req_id, p.datastore)
                if info is None:  # unloaded between admission and the request's first step
                    metrics.FALLBACKS.labels(p.datastore, "datastore_unloaded").inc()
                    continue
                infos[(info.name, info.version)] = info
                groups[(info.name, info.version)].append(row)
        if not groups:
            return logits
        logits = logits.float()
        for key, group in groups.items():
            self._mix_datastore(logits, infos[key], group, token_index, params)
        return logits

    def _mix_datastore(self, logits, info: DatastoreInfo, group: list[int], token_index: np.ndarray, params: list[KnnParams]) -> None:
        keys = self._captured[info.key_type][torch.as_tensor(token_index[group], device=logits.device)]
        ks = np.array([params[r].k for r in group])
        nprobe = self._step_runtime.knn.nprobe or info.nprobe
        start = time.perf_counter()
        try:
            result = self._retriever.search(info, keys.float().cpu().numpy(), int(ks.max()), nprobe)
        except RetrievalError as e:
            metrics.FALLBACKS.labels(info.name, e.reason).inc(len(group))
            logger.warning("knnlm: serving %d row(s) LM-only: %s", len(group), e)
            return
        searched = time.perf_counter()
        distances, tokens = result.distances, result.tokens
        beyond_k = np.arange(distances.shape[1])[None, :] >= ks[:, None]  # rows that asked for fewer
        distances[beyond_k], tokens[beyond_k] = np.inf, -1
        index = torch.as_tensor(group, device=logits.device)
        logits[index] = interpolate(
            logits[index],
            torch.from_numpy(distances).to(logits.device),
            torch.from_numpy(tokens).to(logits.device),
            torch.from_numpy(self._lambdas(info.name, [params[r] for r in group], distances[:, 0])).to(logits.device),
            torch.tensor([params[r].temperature for r in group], device=logits.device),
        )
        metrics.RETRIEVAL_SECONDS.labels(info.name).observe(searched - start)
        metrics.INTERPOLATION_SECONDS.labels(info.name).observe(time.perf_counter() - searched)
        metrics.RETRIEVAL_STEPS.labels(info.name).inc()
        metrics.QUERIES.labels(info.name).inc(len(group))
        metrics.NEIGHBOURS.labels(info.name).inc(int(ks.sum()))
        for shard, seconds in result.shard_seconds.items():
            metrics.SHARD_SEARCH_SECONDS.labels(info.name, shard).observe(seconds)
        metrics.SLOWEST_SHARD_SECONDS.labels(info.name).observe(max(result.shard_seconds.values()))
        for reason in result.failed_shards.values():
            metrics.FALLBACKS.labels(info.name, reason).inc(len(group))

    def _lambdas(self, datastore: str, params: list[KnnParams], nearest: np.ndarray) -> np.ndarray:
        """Each row's λ: the request's, or adaptive from its nearest neighbour's distance."""
        fixed = np.array([np.nan if p.lambda_ is None else p.lambda_ for p in params], dtype=np.float32)
        if np.isnan(fixed).any():
            a = self._step_runtime.knn.adaptive_lambda[datastore]
            fixed = np.where(np.isnan(fixed), adaptive_lambda(nearest, a.lambda_max, a.slope, a.center), fixed)
        return fixed.astype(np.float32)

    def _rows_of(self, hidden_states: torch.Tensor) -> tuple[np.ndarray, list[str]] | None:
        """Each logits row's token index in this step's flattened batch and its request id.

        Sampling calls pass `hidden[logits_indices]` (a copy, one row per request, last token);
        prompt-logprob calls pass a view `hidden[start:start + n]` of one request's tokens and
        come after the step's sampling call."""
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
            self._start_step(runner)
        request_index = np.searchsorted(query_start[1:], token_index, side="right")
        return token_index, [batch.req_ids[i] for i in request_index]

    def _start_step(self, runner) -> None:
        """Once per step: pick up admin changes, forget finished requests, report pinned versions."""
        self._step_runtime = self._watcher.current()
        for req_id in [r for r in self._pins if r not in runner.requests]:
            del self._pins[req_id]
        in_use = {(i.name, i.version) for i in self._pins.values()}
        current = {(i.name, i.version) for i in self._step_runtime.datastores.values()}
        self._retriever.release(in_use | current)
        if in_use != self._published_in_use:
            target = in_use_file(self._watcher.path, os.getpid())
            tmp = target.with_name(f".{target.name}.tmp")
            tmp.write_text(json.dumps(sorted(in_use)))
            os.replace(tmp, target)
            self._published_in_use = in_use

    def _pinned(self, req_id: str, datastore: str) -> DatastoreInfo | None:
        """The version serving when the request first reached a step; kept for its whole life."""
        if req_id not in self._pins and datastore in self._step_runtime.datastores:
            self._pins[req_id] = self._step_runtime.datastores[datastore]
        return self._pins.get(req_id)

    def _params(self, req_id: str) -> KnnParams:
        extra_args = self._runner.requests[req_id].sampling_params.extra_args
        knn = self._step_runtime.knn
        pinned = self._pins.get(req_id)
        if pinned is not None and pinned.name not in knn.datastores:  # unloaded while running
            knn = knn.model_copy(update={"datastores": {**knn.datastores, pinned.name: pinned.path}})
        try:
            return parse_knn_params(extra_args, knn)
        except KnnParamError as e:  # the API server rejects these; offline callers may not
            logger.warning("knnlm: request %s served LM-only: %s", req_id, e)
            return parse_knn_params({"knn": False}, knn)

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
