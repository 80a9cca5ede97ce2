"""The worker RPC knnlm-serve adds to vLLM (`--worker-extension-cls`): attach kNN to the served
model with the view of the runner vLLM picked, then answer the registry between steps."""

from __future__ import annotations

import json
import logging
import os
import socket

from knnlm_core.errors import KnnlmError
from knnlm_serve.engine import vllm_adapter
from knnlm_serve.runtime import Runtime

logger = logging.getLogger("knnlm_serve")

EXTENSION = "knnlm_serve.engine.worker_extension.KnnWorkerExtension"
ATTACH, SET_RUNTIME, WORKER_STATE = "knnlm_attach", "knnlm_set_runtime", "knnlm_worker_state"
TAKE_EXPLANATION = "knnlm_take_explanation"


def step_view(worker):
    """The adapter of the runner this worker has (each checks what it reads first)."""
    if vllm_adapter.uses_model_runner_v2(worker):
        from knnlm_serve.engine import vllm_adapter_v2

        return vllm_adapter_v2.StepView(vllm_adapter_v2.self_check(worker))
    vllm_adapter.repair_cpu_draft_sampling()
    return vllm_adapter.StepView(vllm_adapter.self_check(worker))


class KnnWorkerExtension:
    """Worker RPC methods, called with `collective_rpc`."""

    def knnlm_attach(self, runtime_json: str) -> dict:
        from knnlm_serve.engine.knn_logits import KnnLogits

        step = step_view(self)
        model = vllm_adapter.served_model(self)
        if not hasattr(model, "knn_capture"):
            raise KnnlmError(
                f"the served model {type(model).__name__} is not kNN-wrapped: is `knnlm` in VLLM_PLUGINS and its "
                "architecture supported? (knnlm-serve sets both up)"
            )
        model.knn_logits = KnnLogits(Runtime.model_validate_json(runtime_json), model.knn_capture, step)
        runner = "v2" if vllm_adapter.uses_model_runner_v2(self) else "v1"
        logger.info("kNN attached to %s on vLLM's model runner %s", type(model).__name__, runner.upper())
        # The cores vLLM bound this worker's threads to (all of them where it binds none): shard
        # actors on this host keep off them (ShardActor.keep_off).
        return {
            "model": type(model).__name__,
            "model_runner": runner,
            "ffn_input": model.knn_capture.has_ffn_input,
            "host": socket.gethostname(),
            "cpus": sorted(os.sched_getaffinity(0)),
        }

    # The methods below answer the registry between two steps. An error in one never leaves the
    # worker: it comes back as {"error": ...} for the API server to report (engine/faults.py).

    def knnlm_set_runtime(self, runtime_json: str) -> dict:
        return _answer(lambda: _knn(self).set_runtime(Runtime.model_validate_json(runtime_json)))

    def knnlm_take_explanation(self, explain_id: str) -> dict:
        """The recorded rows of an explained request (JSON), once."""
        return _answer(lambda: json.dumps(_knn(self).explanations.take(explain_id)))

    def knnlm_worker_state(self) -> dict:
        """Versions a running request is pinned to, and versions stopped after repeated errors."""

        def state() -> dict:
            knn = _knn(self)
            knn.set_runtime(knn.runtime)  # also releases versions no request uses any more
            return {
                "pinned": [list(key) for key in knn.batch.pinned_versions()],
                "unhealthy": [[*key, error] for key, error in knn.faults.unhealthy.items()],
            }

        return _answer(state)


def _knn(worker):
    return vllm_adapter.served_model(worker).knn_logits


def _answer(call) -> dict:
    try:
        return {"result": call()}
    except Exception as e:  # noqa: BLE001 - reported to the API server, which refuses what it asked
        logger.exception("kNN worker RPC failed")
        return {"error": f"{type(e).__name__}: {e}"}
