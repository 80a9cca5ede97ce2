"""The kNN wrapper around whichever vLLM model class an architecture resolves to.

One generic subclass per served architecture, made on demand (`knnlm_serve.engine.models:<Arch>`
is what `register()` hands vLLM): it captures the keys during the forward pass and mixes p_kNN
into what the model's own `compute_logits` returns, i.e. after any soft-cap or scale. Until the
worker is attached (worker_extension.KnnWorkerExtension.knnlm_attach) it behaves as the base class.
"""

from __future__ import annotations

from functools import cache

import torch

from knnlm_serve.engine.capture import KEY_READY_OP, KeyCapture
from knnlm_serve.engine.plugin import SUPPORTED_ARCHITECTURES
from knnlm_serve.engine.vllm_adapter import eager_at_replay, vllm_model_class


def knn_model_class(base: type[torch.nn.Module]) -> type[torch.nn.Module]:
    def __init__(self, *, vllm_config, prefix: str = "", **kwargs):
        base.__init__(self, vllm_config=vllm_config, prefix=prefix, **kwargs)
        self.knn_capture = KeyCapture(self)  # before vLLM compiles the model: the hooks are traced in
        eager_at_replay(vllm_config, KEY_READY_OP)
        self.knn_logits = None  # engine.knn_logits.KnnLogits, set when the worker is attached

    def compute_logits(self, hidden_states: torch.Tensor, *args, **kwargs):
        logits = base.compute_logits(self, hidden_states, *args, **kwargs)
        if logits is None or self.knn_logits is None:
            return logits
        return self.knn_logits(logits, hidden_states)

    name = f"Knn{base.__name__}"
    return type(name, (base,), {"__init__": __init__, "compute_logits": compute_logits, "__module__": __name__, "__qualname__": name})


@cache
def __getattr__(architecture: str) -> type[torch.nn.Module]:
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise AttributeError(architecture)
    return knn_model_class(vllm_model_class(architecture))
