"""Per-request kNN settings from OpenAI `vllm_xargs` (= `SamplingParams.extra_args`).

    knn              true/false   use kNN for this request
    knn_datastore    name         one of the server's datastores
    knn_lambda       [0, 1]       weight of p_kNN
    knn_k            1..max_k     neighbours per query
    knn_temperature  > 0          softmax temperature over negative distances
    knn_skip_threshold [0, 1]     skip the search (serve p_LM) where the LM's top probability
                                  exceeds this; 1 = search every step
    knn_pointers     0..max_k     follow pointers: a decode step uses the successors of the last
                                  step's neighbours that predicted its token, without a search,
                                  when at least this many survive; 0 = always search
    knn_explain      {id, top}    set by POST /v1/knn/explain, which returns the explanation:
                                  record this request's evidence (server/explain.py)

A knob the request leaves out takes the datastore's default (runtime.mix_defaults: config
override, else the datastore's calibration, else the config's default; λ may be adaptive).
Parsed the same way in the API server (to reject bad values with HTTP 400) and in the worker.
Keys of other plugins pass; a misspelt `knn_*` key is refused rather than silently ignored.
vLLM coerces `vllm_xargs` values before either sees them (JSON true becomes 1), so the API server
also checks the types the client sent, in the raw JSON (`raw_type_error`, server/knob_types.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from knnlm_core.config import AdaptiveLambda
from knnlm_core.errors import ErrorKind, KnnlmError
from knnlm_serve.runtime import Runtime, mix_defaults

KNOWN_KEYS = ("knn", "knn_datastore", "knn_lambda", "knn_k", "knn_temperature", "knn_skip_threshold", "knn_pointers", "knn_explain")
MAX_EXPLAIN_TOP = 64  # neighbours an explanation shows per token


# Each knob's JSON type, as the client must send it.
RAW_TYPES = {
    "knn": ((bool,), "true or false"),
    "knn_datastore": ((str,), "a datastore name (a string)"),
    "knn_lambda": ((int, float), "a number"),
    "knn_k": ((int,), "an integer"),
    "knn_temperature": ((int, float), "a number"),
    "knn_skip_threshold": ((int, float), "a number"),
    "knn_pointers": ((int,), "an integer"),
}


class KnnParamError(KnnlmError):
    kind = ErrorKind.MALFORMED

    def __init__(self, field: str, value, allowed: str):
        super().__init__(f"vllm_xargs.{field}={value!r} is invalid: must be {allowed}")
        self.field, self.value = field, value


def raw_type_error(xargs: dict) -> KnnParamError | None:
    """The first knob whose JSON value is not of its type (a boolean is no number, a number no boolean)."""
    for field, (types, allowed) in RAW_TYPES.items():
        value = xargs.get(field)
        if field in xargs and (not isinstance(value, types) or (bool not in types and isinstance(value, bool))):
            return KnnParamError(field, value, allowed)
    return None


@dataclass(frozen=True)
class KnnParams:
    enabled: bool
    datastore: str | None
    lambda_: float | None  # None: adaptive, from the nearest neighbour's distance
    k: int
    temperature: float
    adaptive_lambda: AdaptiveLambda | None = None
    skip_threshold: float = 1.0
    min_pointers: int = 0
    explain_id: str | None = None  # record this request's evidence under this id (POST /v1/knn/explain)

    @property
    def active(self) -> bool:
        return self.enabled and self.datastore is not None and (self.lambda_ is None or self.lambda_ > 0)


LM_ONLY = KnnParams(False, None, 0.0, 1, 1.0)


def parse_knn_params(extra_args: dict | None, runtime: Runtime) -> KnnParams:
    args = extra_args or {}
    unknown = sorted(k for k in args if k.startswith("knn") and k not in KNOWN_KEYS)
    if unknown:
        raise KnnParamError(unknown[0], args[unknown[0]], f"one of the known keys {list(KNOWN_KEYS)} (unknown key)")
    config = runtime.knn
    enabled = _bool(args.get("knn", config.enabled))
    datastore = args.get("knn_datastore", runtime.default)
    if "knn_datastore" in args and datastore not in runtime.datastores:
        raise KnnParamError("knn_datastore", datastore, f"one of {sorted(runtime.datastores)}")
    info = runtime.datastores.get(datastore)
    defaults = (info.defaults if info else None) or mix_defaults(config, datastore, info.calibration if info else None)
    adaptive = None
    if "knn_lambda" in args or defaults.lambda_ is not None:
        lambda_ = _number("knn_lambda", args.get("knn_lambda", defaults.lambda_), 0.0, 1.0, "a number in [0, 1]")
    else:
        lambda_, adaptive = None, defaults.adaptive_lambda
    k = args.get("knn_k", defaults.k)
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= config.max_k:
        raise KnnParamError("knn_k", k, f"an integer in [1, {config.max_k}]")
    temperature = _number("knn_temperature", args.get("knn_temperature", defaults.temperature), 0.0, math.inf, "a number > 0")
    if temperature == 0:
        raise KnnParamError("knn_temperature", temperature, "a number > 0")
    skip = _number("knn_skip_threshold", args.get("knn_skip_threshold", defaults.skip_threshold), 0.0, 1.0, "a number in [0, 1]")
    pointers = args.get("knn_pointers", defaults.min_pointers)
    if isinstance(pointers, bool) or not isinstance(pointers, int) or not 0 <= pointers <= config.max_k:
        raise KnnParamError("knn_pointers", pointers, f"an integer in [0, {config.max_k}] (0: always search)")
    explain_id = _explain_id(args.get("knn_explain"))
    return KnnParams(enabled, datastore if enabled else None, lambda_, k, temperature, adaptive, skip, pointers, explain_id)


def _explain_id(value) -> str | None:
    """POST /v1/knn/explain sets `{"id": ..., "top": n}`; a completion request has nowhere to return an explanation."""
    if value is None:
        return None
    if (
        not isinstance(value, dict)
        or not isinstance(value.get("id"), str)
        or not 0 < len(value["id"]) <= 64
        or isinstance(value.get("top"), bool)
        or not isinstance(value.get("top"), int)
        or not 1 <= value["top"] <= MAX_EXPLAIN_TOP
    ):
        raise KnnParamError(
            "knn_explain",
            value,
            f"left out: explanations come from POST /v1/knn/explain (its body takes `vllm_xargs` too, with knn_explain: "
            f"1..{MAX_EXPLAIN_TOP} neighbours per token)",
        )
    return value["id"]


def _bool(value) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
        return value.lower() in ("true", "1")
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise KnnParamError("knn", value, "true or false")


def _number(field: str, value, low: float, high: float, allowed: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise KnnParamError(field, value, allowed)
    return float(value)
