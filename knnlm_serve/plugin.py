"""vLLM integration: the `vllm.general_plugins` entry point and the request validator.

vLLM runs `register()` in each of its processes (API server, engine core, workers). It is inert
unless the launcher set `KNNLM_SERVE_CONFIG`, so plain vLLM on the same environment is unaffected.
"""

from __future__ import annotations

from vllm.exceptions import VLLMValidationError
from vllm.v1.sample.logits_processor import LogitsProcessor

from knnlm_serve import metrics
from knnlm_serve.request_params import KnnParamError, parse_knn_params
from knnlm_serve.runtime import RuntimeWatcher, runtime_path

_registered = False


def register() -> None:
    global _registered
    if runtime_path() is None or _registered:
        return
    from vllm import ModelRegistry

    from knnlm_serve.vllm_model import KnnLlamaForCausalLM

    ModelRegistry.register_model("LlamaForCausalLM", KnnLlamaForCausalLM)
    _registered = True


class KnnParamsValidator(LogitsProcessor):
    """Rejects bad `vllm_xargs` at admission (HTTP 400 naming the field) against the datastores
    serving right now, and counts admitted requests per datastore; does nothing per step."""

    _watcher: RuntimeWatcher | None = None

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        if cls._watcher is None:
            if runtime_path() is None:
                return
            cls._watcher = RuntimeWatcher(runtime_path())
        try:
            params = parse_knn_params(sampling_params.extra_args, cls._watcher.current().knn)
        except KnnParamError as e:
            raise VLLMValidationError(str(e), parameter=f"vllm_xargs.{e.field}", value=e.value) from None
        metrics.REQUESTS.labels(params.datastore if params.active else "none").inc()

    def __init__(self, vllm_config, device, is_pin_memory):
        pass

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update) -> None:
        pass

    def apply(self, logits):
        return logits
