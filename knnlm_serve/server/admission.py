"""Admission of the completion, chat and responses routes' kNN knobs, from the raw JSON, before vLLM parses it.

1. The knobs as the client sent them. vLLM's request models coerce `vllm_xargs` values (JSON
   `true` becomes 1, so `"knn_skip_threshold": false` would mean "skip every search"). A knob of
   the wrong JSON type or value is a 400 naming the field (engine/request_params.py); the parsed
   knobs replace the client's in `vllm_xargs` (`WIRE_KEY`), for the workers.
2. In-context passages (server/context.py): with `vllm_xargs.knn_context`, the request's text
   retrieves passages of its datastore, which go into its prompt; the knob is removed, and the
   response gets a `knn_context` field naming them.
3. `file_search` on the responses route (server/file_search.py): the vector stores' passages go
   into the request's instructions, and the response names the files.
Admission is here, not in a vLLM logits processor, because it must work for every model runner
and with speculative decoding, where vLLM's V1 runner loads no logits processors. A request
without kNN knobs passes through untouched, its body replayed as it came.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace

from knnlm_core.errors import ErrorKind, KnnlmError
from knnlm_serve import metrics
from knnlm_serve.engine.request_params import KNOWN_KEYS, WIRE_KEY, KnnParamError, RequestKnobs, parse_knobs, raw_type_error, with_defaults
from knnlm_serve.server import context as ctx
from knnlm_serve.server import file_search
from knnlm_serve.server.audit import record_of
from knnlm_serve.server.grants import granted, tenant_of, unknown_knob
from knnlm_serve.server.http_errors import STATUS, error_response
from knnlm_serve.server.tenancy import HIDE_USAGE

logger = logging.getLogger("knnlm_serve")

CONTEXT_ROUTES = ("/v1/completions", "/v1/chat/completions")
CHECKED_ROUTES = (*CONTEXT_ROUTES, "/v1/responses")


class AdmissionMiddleware:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in CHECKED_ROUTES:
            return await self.app(scope, receive, send)
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left: let the app see it
                return await self.app(scope, _replay(message, receive), send)
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        state = scope["app"].state
        registry = getattr(state, "knnlm_registry", None)
        search = None
        if registry is not None and scope["path"] == "/v1/responses" and file_search.TOOL.encode() in body:
            try:
                body, search = _with_file_search(state, scope, body)
            except KnnlmError as e:
                refused = error_response(STATUS[e.kind], registry.public(str(e)), e.param, "BadRequestError")
                return await refused(scope, receive, send)
        key = tenant_of(scope)
        request = _knn_request(body, every=key is not None) if registry is not None else None
        context = None
        if registry is not None:
            registry.note_request()
        if registry is not None and request is None:
            _count(registry.runtime, RequestKnobs())
        elif request is not None:
            try:
                request, context = _admitted(state, registry, request, scope)
            except KnnlmError as e:
                refused = error_response(STATUS[e.kind], str(e), _param_of(e), "BadRequestError")
                return await refused(scope, receive, send)
            body = json.dumps(request).encode()
        if context is not None:
            send = _naming_context(send, context, request.get("stream", False))
        if search is not None:
            send = file_search.answering(send, search, bool(json.loads(body).get("stream")))
        await self.app(scope, _replay({"type": "http.request", "body": body, "more_body": False}, receive), send)


def _with_file_search(state, scope, body: bytes) -> tuple[bytes, file_search.FileSearch | None]:
    """The body with a file_search tool's passages in it (server/file_search.py), as it came otherwise."""
    try:
        request = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return body, None  # vLLM reports malformed JSON itself
    if not isinstance(request, dict):
        return body, None
    request, search = file_search.admitted(state, scope, request)
    return (json.dumps(request).encode() if search is not None else body), search


def _param_of(e: KnnlmError) -> str:
    """The request field an admission error names: a body field the passages could not read, a
    knob, or else the passages' knob."""
    return e.param or f"vllm_xargs.{ctx.KNOB}"


def _knn_request(body: bytes, every: bool) -> dict | None:
    """The request, where it has `vllm_xargs` with a kNN knob (`every`: a tenant's, whatever it
    has, for its key's datastore); None for everything else."""
    if b"knn" not in body and not every:
        return None
    try:
        request = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None  # vLLM reports malformed JSON itself (and a tenant's request reaches no datastore: engine/batch_requests.py)
    if not isinstance(request, dict) or not isinstance(request.get("vllm_xargs", {}), dict):
        return None
    if not every and not any(k.startswith("knn") for k in request["vllm_xargs"]):
        return None
    return request


def _admitted(state, registry, request: dict, scope) -> tuple[dict, dict | None]:
    """The request with its knobs parsed into `WIRE_KEY` (and its passages in the prompt), and
    what the response says of the passages."""
    runtime, path = registry.runtime, scope["path"]
    xargs = dict(request.get("vllm_xargs") or {})
    if (error := raw_type_error(xargs)) is not None:
        raise error
    count = ctx.context_count(xargs)
    if ctx.KNOB in xargs and path not in CONTEXT_ROUTES:
        raise KnnParamError(ctx.KNOB, xargs[ctx.KNOB], f"absent: passages go into prompts on {' and '.join(CONTEXT_ROUTES)}")
    xargs.pop(ctx.KNOB, None)
    key = tenant_of(scope)
    checked = {k: v for k, v in xargs.items() if k != "knn_datastore"} if key is not None else xargs  # a key's names: below
    knobs = parse_knobs(checked, runtime.datastores, runtime.knn.max_k, route_keys=(ctx.KNOB,) if path in CONTEXT_ROUTES else ())
    if key is not None:
        knobs = _tenant_knobs(scope, key, knobs, xargs.get("knn_datastore"), runtime, count)
        request = _with_usage(scope, request, path)
    _count(runtime, knobs)
    others = {k: v for k, v in xargs.items() if k not in KNOWN_KEYS}
    request = {**request, "vllm_xargs": {**others, WIRE_KEY: knobs.wire()}}
    if count == 0:
        return request, None
    request, described = _with_context(
        state, registry, request, path.endswith("chat/completions"), count, knobs.datastore or runtime.default
    )
    if (record := record_of(scope)) is not None:
        record.returned(described["passages"], "passage")
    return request, described


def _tenant_knobs(scope, key, knobs: RequestKnobs, requested, runtime, count: int) -> RequestKnobs:
    """The knobs with the datastore the key may generate with: the one named, else its default,
    else kNN off (never the server's default, which may be another tenant's)."""
    enabled = runtime.knn.enabled if knobs.enabled is None else knobs.enabled
    unknown = unknown_knob(requested)
    name = granted(scope, key, requested, "generate", runtime.datastores, unknown) if enabled or requested is not None or count else None
    if name is None and count:
        raise KnnParamError(ctx.KNOB, count, "absent, or beside vllm_xargs.knn_datastore: this API key has no default datastore")
    return replace(knobs, datastore=name, enabled=False if name is None else knobs.enabled, admitted=runtime.admission_token)


def _with_usage(scope, request: dict, path: str) -> dict:
    """A tenant's stream asked for its usage (charged to its key); the usage event is dropped
    again where its client did not ask for it (server/tenancy.py)."""
    options = request.get("stream_options")
    if path not in CONTEXT_ROUTES or not request.get("stream") or not isinstance(options or {}, dict):
        return request
    if (options or {}).get("include_usage"):
        return request
    scope[HIDE_USAGE] = True
    return {**request, "stream_options": {**(options or {}), "include_usage": True}}


def _count(runtime, knobs: RequestKnobs) -> None:
    """Count the request under the datastore it is served from ('none': kNN off)."""
    params = with_defaults(knobs, runtime)  # refuses only a named datastore that is not served
    metrics.REQUESTS.labels(metrics.datastore_label(params.datastore) if params.active else "none").inc()


def _with_context(state, registry, request: dict, chat: bool, count: int, name: str | None) -> tuple[dict, dict]:
    """The request with its passages in the prompt, and what the response says of them."""
    info = registry.runtime.datastores.get(name)
    if info is None:
        raise KnnParamError("knn_datastore", name, f"one of {sorted(registry.runtime.datastores)}")
    tokenizer = ctx.tokenizer_of(str(registry.model.path))
    tokens = lambda text: len(tokenizer(text, add_special_tokens=False).input_ids)  # noqa: E731
    query = ctx.query_text(request, chat, tokenizer)
    prompt_tokens = tokens(ctx.prompt_text(request, chat, query))
    budget = ctx.token_budget(request, chat, prompt_tokens, state.vllm_config.model_config.max_model_len)
    if info.passages is None:
        raise KnnlmError(
            f"datastore {info.name!r} has no passages (built before in-context retrieval existed): "
            f"rebuild it with `knnlm-index build`, or leave out vllm_xargs.{ctx.KNOB}",
            ErrorKind.MALFORMED,
        )
    from knnlm_serve.server.explain import origin, provenance_of

    try:
        context = ctx.retrieve(info, query, count, budget, tokens)
        table = provenance_of(info.path).table
        described = context.described(lambda document: origin(table, document, registry))
    except Exception as e:  # noqa: BLE001 - fail open: the request is served without passages, counted
        logger.warning("in-context retrieval from datastore %r failed, served without passages: %s", info.name, e)
        metrics.CONTEXT_FAILURES.labels(metrics.datastore_label(info.name)).inc()
        context = ctx.Context(info.name, [], 0, 0, error=f"retrieval failed: {type(e).__name__}")
        described = context.described(None)
    request, ids = ctx.with_context(request, chat, context, tokenizer)
    return request, described | ({"token_ids": ids} if ids else {})


def _naming_context(send, described: dict, stream: bool):
    """`send` with the response's JSON (or a stream's first event) given a `knn_context` field;
    an error response (vLLM refused the request) is passed on as it is: no passage was used."""
    state = {"done": False, "headers": None}
    pending = []

    async def sending(message):
        if message["type"] == "http.response.start":
            state["done"] = message.get("status", 200) >= 400  # refused: the body is passed on as it is
            if stream or state["done"]:
                return await send(message)
            pending.append(message)  # its content-length changes with the body
            return None
        if message["type"] != "http.response.body" or state["done"]:
            return await send(message)
        body = message.get("body", b"")
        if stream:
            if body.startswith(b"data: {"):
                event = json.loads(body[len(b"data: ") :].split(b"\n\n", 1)[0])
                rest = body.split(b"\n\n", 1)[1] if b"\n\n" in body else b""
                body = b"data: " + json.dumps({**event, "knn_context": described}).encode() + b"\n\n" + rest
                state["done"] = True
            return await send({**message, "body": body})
        pending.append(body)
        if message.get("more_body", False):
            return None
        start, *parts = pending
        whole = b"".join(parts)
        try:
            whole = json.dumps({**json.loads(whole), "knn_context": described}).encode()
        except ValueError:
            pass  # not JSON: passed on as it is
        headers = [(k, v) for k, v in start["headers"] if k.lower() != b"content-length"]
        await send({**start, "headers": [*headers, (b"content-length", str(len(whole)).encode())]})
        state["done"] = True
        return await send({"type": "http.response.body", "body": whole, "more_body": False})

    return sending


def _replay(first: dict, receive):
    """`receive` with `first` handed out before anything else."""
    pending = [first]

    async def replayed():
        return pending.pop() if pending else await receive()

    return replayed
