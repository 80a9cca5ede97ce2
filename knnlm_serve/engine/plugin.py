"""The vLLM entry points: the `vllm.general_plugins` hook and the per-request logits processor.

`register()` runs in every vLLM process. It does nothing unless `knnlm` is named explicitly in
vLLM's plugin allowlist `VLLM_PLUGINS` (knnlm-serve and knnlm-eval do this), so plain vLLM in the
same environment is unaffected. When named, it replaces each supported architecture by its kNN
wrapper (engine/models.py), lazily: nothing is imported until vLLM builds the model, and it gives
our loggers a handler of their own (vLLM spawns its engine processes, so the launcher's logging
setup does not reach them).

`KnnRequestTracker` is a V1 logits processor (vLLM's public per-request extension point): in the
API server it validates `vllm_xargs` at admission (HTTP 400 naming the field); in the worker it
follows the persistent batch through the `BatchUpdate`s vLLM hands it. It never changes logits.
If following the batch fails, it forgets the batch: the requests it held are served LM-only.
"""

from __future__ import annotations

import os

from vllm.exceptions import VLLMValidationError
from vllm.v1.sample.logits_processor import LogitsProcessor

from knnlm_core.errors import KnnlmError
from knnlm_serve import metrics
from knnlm_serve.engine.batch_requests import BatchRequests
from knnlm_serve.engine.faults import Faults
from knnlm_serve.engine.request_params import WIRE_KEY, KnnParamError, parse_knobs, with_defaults
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


class KnnRequestTracker(LogitsProcessor):
    @classmethod
    def validate_params(cls, sampling_params) -> None:
        from knnlm_serve.app_state import published_registry

        registry = published_registry()
        if registry is None:  # offline engines (knnlm-eval): the worker serves bad values LM-only
            return
        runtime = registry.runtime
        try:
            knobs = parse_knobs(sampling_params.extra_args, runtime.datastores, runtime.knn.max_k)
            params = with_defaults(knobs, runtime)
        except KnnParamError as e:
            raise VLLMValidationError(str(e), parameter=f"vllm_xargs.{e.field}", value=e.value) from None
        sampling_params.extra_args = {**(sampling_params.extra_args or {}), WIRE_KEY: knobs.wire()}
        metrics.REQUESTS.labels(params.datastore if params.active else "none").inc()

    def __init__(self, vllm_config, device, is_pin_memory):
        self.batch = BatchRequests()
        self.faults = Faults()  # shared with KnnLogits once the worker is attached

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update) -> None:
        try:
            self.batch.apply(batch_update)
        except Exception as e:  # noqa: BLE001 - fail open: requests whose slot is unknown are served LM-only
            running = len(self.batch)
            self.batch.clear()
            self.faults.failed("update_state", e, running)

    def apply(self, logits):
        return logits


TRACKER = "knnlm_serve.engine.plugin:KnnRequestTracker"


def vllm_environment(plugins: tuple[str, ...] = (PLUGIN_NAME,)) -> dict[str, str]:
    """What vLLM's processes must inherit for kNN: our plugins allowlisted (beside any the user
    allowlisted, or every installed general plugin when the user set none), no compile cache
    (its key ignores our capture hooks, so a cached graph could silently drop them), and vLLM's V1
    model runner, which every Triton host (every CUDA host) would otherwise replace by Model
    Runner V2: that one loads only logits processors of its own interface, and our tracker and
    adapter are written against V1's (docs/model-runner-v2.md says what a port to V2 needs)."""
    from importlib.metadata import entry_points

    if os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "").strip().lower() in ("1", "true"):
        raise KnnlmError(
            "VLLM_USE_V2_MODEL_RUNNER asks for vLLM's Model Runner V2, and kNN serving runs on the V1 model runner "
            "(V2 loads only logits processors of its own interface): unset it, or serve without knn.datastores"
        )
    allowed = [p for p in os.environ.get("VLLM_PLUGINS", "").split(",") if p]
    if not allowed:
        allowed = [e.name for e in entry_points(group="vllm.general_plugins")]
    return {
        "VLLM_PLUGINS": ",".join(dict.fromkeys([*plugins, *allowed])),
        "VLLM_DISABLE_COMPILE_CACHE": "1",
        "VLLM_USE_V2_MODEL_RUNNER": "0",
    }
