"""The vLLM entry point: the `vllm.general_plugins` hook, and the environment vLLM's processes need.

`register()` runs in every vLLM process. It does nothing unless `knnlm` is named explicitly in
vLLM's plugin allowlist `VLLM_PLUGINS` (knnlm-serve and knnlm-eval do this), so plain vLLM in the
same environment is unaffected. When named, it replaces each supported architecture by its kNN
wrapper (engine/models.py), lazily: nothing is imported until vLLM builds the model, and it gives
our loggers a handler of their own (vLLM spawns its engine processes, so the launcher's logging
setup does not reach them).
"""

from __future__ import annotations

import os

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

    log_to_stderr()
    for architecture in SUPPORTED_ARCHITECTURES:
        ModelRegistry.register_model(architecture, f"knnlm_serve.engine.models:{architecture}")


def vllm_environment(plugins: tuple[str, ...] = (PLUGIN_NAME,)) -> dict[str, str]:
    """What vLLM's processes must inherit for kNN: our plugins allowlisted (beside any the user
    allowlisted, or every installed general plugin when the user set none), no compile cache
    (its key ignores our capture hooks, so a cached graph could silently drop them), and vLLM's V1
    model runner, which every Triton host (every CUDA host) would otherwise replace by Model
    Runner V2: our adapter reads V1's batch (docs/model-runner-v2.md says what a port to V2 needs)."""
    from importlib.metadata import entry_points

    if os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "").strip().lower() in ("1", "true"):
        raise KnnlmError(
            "VLLM_USE_V2_MODEL_RUNNER asks for vLLM's Model Runner V2, and kNN serving runs on the V1 model runner: "
            "unset it, or serve without knn.datastores"
        )
    allowed = [p for p in os.environ.get("VLLM_PLUGINS", "").split(",") if p]
    if not allowed:
        allowed = [e.name for e in entry_points(group="vllm.general_plugins")]
    return {
        "VLLM_PLUGINS": ",".join(dict.fromkeys([*plugins, *allowed])),
        "VLLM_DISABLE_COMPILE_CACHE": "1",
        "VLLM_USE_V2_MODEL_RUNNER": "0",
    }
