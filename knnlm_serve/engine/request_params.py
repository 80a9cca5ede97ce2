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
    knn_drafts       true/false   with knn.draft_tokens: let the datastore (or prompt lookup)
                                  draft this request's next tokens for speculative decoding
                                  (engine/drafts.py)
    knn_explain      {id, top}    set by POST /v1/knn/explain, which returns the explanation:
                                  record this request's evidence (server/explain.py)

A knob the request leaves out takes the datastore's default (runtime.mix_defaults: config
override, else the datastore's calibration, else the config's default; λ may be adaptive).
Parsed once, at admission in the API server (server/admission.py: a bad value is an HTTP 400),
from the JSON the client sent, before vLLM's request models coerce it (JSON true would become 1):
`raw_type_error` checks the types, `parse_knobs` the values. The `RequestKnobs` travel to the
workers inside `extra_args` (`WIRE_KEY`); a worker fills the defaults when it pins the request's
datastore version (`with_defaults`), so a hot-swap in between cannot mix two versions' settings.
Keys of other plugins pass; a misspelt `knn_*` key is refused rather than silently ignored.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection
from dataclasses import asdict, dataclass

from knnlm_core.config import AdaptiveLambda
from knnlm_core.errors import ErrorKind, KnnlmError
from knnlm_serve.runtime import Runtime, mix_defaults

WIRE_KEY = "knnlm"  # where the API server puts the parsed RequestKnobs; a client sending it is refused as unknown
KNOWN_KEYS = (
    "knn",
    "knn_datastore",
    "knn_lambda",
    "knn_k",
    "knn_temperature",
    "knn_skip_threshold",
    "knn_pointers",
    "knn_drafts",
    "knn_explain",
)
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
    "knn_drafts": ((bool,), "true or false"),
}


class KnnParamError(KnnlmError):
    kind = ErrorKind.MALFORMED

    def __init__(self, field: str, value, allowed: str):
        super().__init__(f"vllm_xargs.{field}={value!r} is invalid: must be {allowed}", param=f"vllm_xargs.{field}")


def raw_type_error(xargs: dict) -> KnnParamError | None:
    """The first knob whose JSON value is not of its type (a boolean is no number, a number no boolean)."""
    for field, (types, allowed) in RAW_TYPES.items():
        value = xargs.get(field)
        if field in xargs and (not isinstance(value, types) or (bool not in types and isinstance(value, bool))):
            return KnnParamError(field, value, allowed)
    return None


@dataclass(frozen=True)
class RequestKnobs:
    """The knobs one request set, checked; a knob it left out is None and takes the default of the
    version its request is pinned to. The API server parses the client's `vllm_xargs` once, into
    this, and hands it to the workers inside `extra_args` (`WIRE_KEY`), where defaults are filled."""

    enabled: bool | None = None
    datastore: str | None = None
    lambda_: float | None = None
    k: int | None = None
    temperature: float | None = None
    skip_threshold: float | None = None
    min_pointers: int | None = None
    drafts: bool | None = None
    explain_id: str | None = None  # record this request's evidence under this id (POST /v1/knn/explain)
    admitted: str | None = None  # with tenants: the runtime's admission token, set by the API server

    def wire(self) -> str:
        """As JSON: `vllm_xargs` values are strings, numbers or lists."""
        return json.dumps(asdict(self))

    @classmethod
    def from_extra_args(cls, extra_args: dict | None, datastores: Collection[str], max_k: int) -> RequestKnobs:
        """The parsed knobs the API server wrote, or, for engines without one (knnlm-eval), a parse here."""
        args = extra_args or {}
        if isinstance(args.get(WIRE_KEY), str):
            return cls(**json.loads(args[WIRE_KEY]))
        return parse_knobs(args, datastores, max_k)


@dataclass(frozen=True)
class KnnParams:
    """A request's settings with every default filled, from the version it is pinned to."""

    enabled: bool
    datastore: str | None
    lambda_: float | None  # None: adaptive, from the nearest neighbour's distance
    k: int
    temperature: float
    adaptive_lambda: AdaptiveLambda | None = None
    skip_threshold: float = 1.0
    min_pointers: int = 0
    explain_id: str | None = None
    drafts: bool = True  # the datastore may draft its next tokens (where the server drafts at all)

    @property
    def active(self) -> bool:
        return self.enabled and self.datastore is not None and (self.lambda_ is None or self.lambda_ > 0)


LM_ONLY = KnnParams(False, None, 0.0, 1, 1.0)


def parse_knobs(extra_args: dict | None, datastores: Collection[str], max_k: int, route_keys: tuple[str, ...] = ()) -> RequestKnobs:
    """The client's `vllm_xargs`, checked against the served datastores and `knn.max_k`.
    `route_keys` are knobs the route reads itself (named among the known keys, not parsed here)."""
    args = extra_args or {}
    known = (*KNOWN_KEYS, *route_keys)
    unknown = sorted(k for k in args if k.startswith("knn") and k not in known)
    if unknown:
        raise KnnParamError(unknown[0], args[unknown[0]], f"one of the known keys {list(known)} (unknown key)")
    datastore = args.get("knn_datastore")
    if "knn_datastore" in args and datastore not in datastores:
        raise KnnParamError("knn_datastore", datastore, f"one of {sorted(datastores)}")
    k = args.get("knn_k")
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= max_k):
        raise KnnParamError("knn_k", k, f"an integer in [1, {max_k}]")
    pointers = args.get("knn_pointers")
    if pointers is not None and (isinstance(pointers, bool) or not isinstance(pointers, int) or not 0 <= pointers <= max_k):
        raise KnnParamError("knn_pointers", pointers, f"an integer in [0, {max_k}] (0: always search)")
    temperature = _number("knn_temperature", args.get("knn_temperature"), 0.0, math.inf, "a number > 0")
    if temperature == 0:
        raise KnnParamError("knn_temperature", temperature, "a number > 0")
    return RequestKnobs(
        enabled=None if args.get("knn") is None else _bool("knn", args["knn"]),
        datastore=datastore,
        lambda_=_number("knn_lambda", args.get("knn_lambda"), 0.0, 1.0, "a number in [0, 1]"),
        k=k,
        temperature=temperature,
        skip_threshold=_number("knn_skip_threshold", args.get("knn_skip_threshold"), 0.0, 1.0, "a number in [0, 1]"),
        min_pointers=pointers,
        drafts=None if args.get("knn_drafts") is None else _bool("knn_drafts", args["knn_drafts"]),
        explain_id=_explain_id(args.get("knn_explain")),
    )


def with_defaults(knobs: RequestKnobs, runtime: Runtime) -> KnnParams:
    """Fill what the request left out from the named (or default) datastore's current defaults
    (runtime.mix_defaults: config override, else calibration, else config default; λ may be adaptive)."""
    config = runtime.knn
    enabled = config.enabled if knobs.enabled is None else knobs.enabled
    datastore = knobs.datastore or runtime.default
    if knobs.datastore is not None and datastore not in runtime.datastores:
        raise KnnParamError("knn_datastore", datastore, f"one of {sorted(runtime.datastores)} (it was unloaded)")
    info = runtime.datastores.get(datastore)
    defaults = (info.defaults if info else None) or mix_defaults(config, datastore, info.calibration if info else None)
    lambda_ = knobs.lambda_ if knobs.lambda_ is not None else defaults.lambda_
    return KnnParams(
        enabled,
        datastore if enabled else None,
        lambda_,
        _default(knobs.k, defaults.k),
        _default(knobs.temperature, defaults.temperature),
        defaults.adaptive_lambda if lambda_ is None else None,
        _default(knobs.skip_threshold, defaults.skip_threshold),
        _default(knobs.min_pointers, defaults.min_pointers),
        knobs.explain_id,
        _default(knobs.drafts, True),
    )


def _default(value, default):
    return default if value is None else value


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


def _bool(field: str, value) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
        return value.lower() in ("true", "1")
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise KnnParamError(field, value, "true or false")


def _number(field: str, value, low: float, high: float, allowed: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise KnnParamError(field, value, allowed)
    return float(value)
