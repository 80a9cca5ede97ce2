"""Everything knnlm-serve reads from vLLM's Model Runner V2, in one place, checked at startup.

V2 keeps less on the runner than V1 (vllm_adapter), so three of its methods are wrapped on the
runner instance, each calling the original:
  * `prepare_inputs` returns the step's `InputBatch`, which the runner keeps only as a local of
    `execute_model`: this view holds it from then until `sample_tokens` returns, and holds none
    in dummy runs (`execute_model` clears it). From it: `req_ids`, `query_start_loc_np` and
    `num_computed_tokens_np` by batch index (the V1 row formulas, with the batch index for the
    slot: V2 re-sorts its batch every step), `cu_num_logits_np` (one sampling row per draft
    token and one more, request by request, as on V1) and `input_ids` (the draft tokens fed);
  * `add_requests`: V2 keeps no `SamplingParams`, so each new request's `extra_args` and prompt
    are taken from `scheduled_new_reqs` (resumed requests come back there too).
Read from the runner: `req_states` (`req_id_to_index`, and the output tokens in `all_token_ids`
between `prompt_len` and `total_len`) and `prompt_logprobs_worker` (which requests asked for
prompt logprobs: V2 computes them on slices of the whole step, and only those requests' rows are
mixed). Prompt-logprob calls pass views of the model's output and sampling calls a gathered copy,
as on V1. The mix stays in `compute_logits`, upstream of V2's sampler stages (logit bias,
penalties, its logits processors, temperature), as on V1: sample and prompt logprobs see it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Collection, Sequence

import numpy as np
import torch

from knnlm_core.errors import ConfigError
from knnlm_serve.engine.batch_requests import BatchRequest
from knnlm_serve.engine.rows import LogitsRows, first_viewed_row, prompt_rows, sampling_rows
from knnlm_serve.engine.vllm_adapter import checked, incompatible

logger = logging.getLogger("knnlm_serve")

BATCH_FIELDS = (
    "req_ids",
    "num_reqs",
    "idx_mapping_np",
    "query_start_loc_np",
    "num_computed_tokens_np",
    "num_computed_prefill_tokens_np",
    "prefill_len_np",
    "num_draft_tokens",
    "cu_num_logits_np",
    "input_ids",
)


def self_check(worker):
    """The V2 runner, after checking every internal this module reads; settings under which
    `compute_logits` does not see every row are refused."""
    from vllm.v1.worker.gpu.input_batch import InputBatch

    runner = getattr(worker, "model_runner", None)
    states = getattr(runner, "req_states", None)
    prompt_logprobs = getattr(runner, "prompt_logprobs_worker", None)
    fields = {f.name for f in dataclasses.fields(InputBatch)}
    checks = [
        (runner is not None, "the worker has no model_runner"),
        (
            all(callable(getattr(runner, m, None)) for m in ("prepare_inputs", "execute_model", "sample_tokens", "add_requests")),
            "the runner's prepare_inputs, execute_model, sample_tokens or add_requests is missing",
        ),
        (set(BATCH_FIELDS) <= fields, f"InputBatch lacks {sorted(set(BATCH_FIELDS) - fields)}"),
        (isinstance(getattr(states, "req_id_to_index", None), dict), "req_states.req_id_to_index is missing"),
        (all(hasattr(states, a) for a in ("all_token_ids", "prompt_len", "total_len")), "req_states' token buffers are missing"),
        (isinstance(getattr(prompt_logprobs, "uses_prompt_logprobs", None), np.ndarray), "prompt_logprobs_worker is missing"),
        (isinstance(getattr(prompt_logprobs, "token_id_scores", None), dict), "prompt_logprobs_worker.token_id_scores is missing"),
        (callable(getattr(runner, "get_model", None)), "model_runner.get_model is missing"),
        (hasattr(runner, "speculative_config"), "model_runner.speculative_config is missing"),
    ]
    for ok, what in checks:
        if not ok:
            raise incompatible(f"Model Runner V2's {what}")
    refused = [
        ("batch_sharder", "batch-sharded sampling (--enable-batch-sharded-sampling) computes logits without compute_logits"),
        ("adaptive_verification", "adaptive verification changes draft counts on the device only"),
        ("pcp_manager", "prefill context parallelism splits a request's tokens across ranks"),
    ]
    for attribute, why in refused:
        if getattr(runner, attribute, None) is not None:
            raise ConfigError(f"kNN cannot serve on Model Runner V2 with this setting: {why}. Turn it off, or set knn.model_runner: v1")
    return runner


class StepView:
    """Model Runner V2's view of the current step, for one worker (the same calls as V1's)."""

    def __init__(self, runner):
        self._runner = runner
        self._batch = None  # the step's InputBatch, from prepare_inputs to the end of sample_tokens
        self._added: dict[str, tuple[dict | None, list[int] | None]] = {}  # request id -> extra_args, prompt
        self._outputs: dict[str, list[int]] = {}  # output tokens read this step, by request id
        self._wrap(runner)

    def _wrap(self, runner) -> None:
        execute_model, prepare_inputs, sample_tokens, add_requests = (
            runner.execute_model,
            runner.prepare_inputs,
            runner.sample_tokens,
            runner.add_requests,
        )

        def execute(*args, **kwargs):
            self._end_step()  # a dummy run builds its batch without prepare_inputs: it sees none
            return execute_model(*args, **kwargs)

        def prepare(*args, **kwargs):
            self._batch = prepare_inputs(*args, **kwargs)
            return self._batch

        def sample(*args, **kwargs):
            try:
                return sample_tokens(*args, **kwargs)
            finally:
                self._end_step()

        def add(scheduler_output):
            try:
                for new in scheduler_output.scheduled_new_reqs:
                    params = new.sampling_params
                    self._added[new.req_id] = (params.extra_args if params is not None else None, new.prompt_token_ids)
            except Exception:  # noqa: BLE001 - fail open: vLLM adds its requests; ours fail at their rows (KnnLogits' faults)
                logger.exception("knnlm: reading the step's new requests failed")
            result = add_requests(scheduler_output)
            live = runner.req_states.req_id_to_index
            self._added = {i: added for i, added in self._added.items() if i in live}
            return result

        runner.execute_model, runner.prepare_inputs, runner.sample_tokens, runner.add_requests = execute, prepare, sample, add

    def _end_step(self) -> None:
        self._batch = None
        self._outputs = {}

    def rows_of(
        self, hidden_states: torch.Tensor, model_output: torch.Tensor | None, sampling: LogitsRows | None = None
    ) -> LogitsRows | None:
        """Each logits row's token and batch index; None for calls outside a real step (warm-up).
        `sampling`: this step's sampling rows where they were read already (mid-forward), which a
        sampling call then returns as they are."""
        batch = self._batch
        if batch is None or batch.num_reqs == 0:
            return None
        first = first_viewed_row(hidden_states, model_output)
        if first is not None:
            rows = prompt_rows(batch.query_start_loc_np, batch.num_reqs, first, hidden_states.shape[0])
            return dataclasses.replace(rows, kept=self._asked_for_prompt_logprobs()[rows.slot])
        return checked(self.sampling_rows() if sampling is None else sampling, hidden_states.shape[0], batch.num_reqs)

    def sampling_rows(self) -> LogitsRows | None:
        """The rows this step's sampling call will have, known before the forward pass ends; None
        outside a real step."""
        batch = self._batch
        if batch is None or batch.num_reqs == 0:
            return None
        return sampling_rows(batch.query_start_loc_np, batch.num_reqs, self._draft_counts() if batch.num_draft_tokens else None)

    def _draft_counts(self) -> np.ndarray:
        return np.diff(self._batch.cu_num_logits_np[: self._batch.num_reqs + 1]).astype(np.int64) - 1

    def _asked_for_prompt_logprobs(self) -> np.ndarray:
        """By batch index: whether vLLM keeps the request's prompt-logprob rows this step (the
        rule of V2's PromptLogprobsWorker)."""
        batch, worker = self._batch, self._runner.prompt_logprobs_worker
        index = batch.idx_mapping_np[: batch.num_reqs]
        prompt_len = self._runner.req_states.prompt_len.np[index]
        asked = worker.uses_prompt_logprobs[index] & (batch.num_computed_prefill_tokens_np[: batch.num_reqs] < prompt_len)
        asked &= prompt_len >= batch.prefill_len_np[: batch.num_reqs]  # resumed after its prompt: done before
        scored = np.fromiter((r in worker.token_id_scores for r in batch.req_ids[: batch.num_reqs]), dtype=bool, count=batch.num_reqs)
        return asked | scored

    def request_id(self, slot: int) -> str:
        return self._batch.req_ids[slot]

    def request(self, request_id: str) -> BatchRequest:
        """A request as vLLM holds it; its output tokens are read from the runner as it runs."""
        extra_args, prompt = self._added[request_id]
        return BatchRequest(extra_args, OutputTokens(self, request_id), prompt)

    def running(self) -> Collection[str]:
        """The ids of the requests the runner holds."""
        return self._runner.req_states.req_id_to_index.keys()

    def drafts(self, slot: int) -> list[int]:
        """The draft tokens fed to the request at batch index `slot` this step (the last of its
        scheduled tokens)."""
        end = int(self._batch.query_start_loc_np[slot + 1])
        return self._batch.input_ids[end - int(self._draft_counts()[slot]) : end].tolist()

    def positions(self, rows: LogitsRows) -> np.ndarray:
        """Each row's token position in its request (prompt and output tokens counted together)."""
        batch = self._batch
        return batch.num_computed_tokens_np[rows.slot].astype(np.int64) + rows.token_index - batch.query_start_loc_np[rows.slot]

    def output_tokens(self, request_id: str) -> list[int]:
        """The request's tokens after its prompt, as the runner holds them this step (read once a step)."""
        tokens = self._outputs.get(request_id)
        if tokens is None:
            states = self._runner.req_states
            slot = states.req_id_to_index[request_id]  # a resumed request may have another slot
            start, end = int(states.prompt_len.np[slot]), int(states.total_len.gpu[slot])
            tokens = self._outputs[request_id] = states.all_token_ids.gpu[slot, start:end].tolist()
        return tokens


class OutputTokens(Sequence):
    """A request's output tokens on Model Runner V2, which holds them in a tensor, not a list."""

    def __init__(self, view: StepView, request_id: str):
        self._view, self._request_id = view, request_id

    def __len__(self) -> int:
        return len(self._view.output_tokens(self._request_id))

    def __getitem__(self, index):
        return self._view.output_tokens(self._request_id)[index]
