"""The kNN knobs' types as the client sent them, checked before vLLM parses the request.

vLLM's request models coerce `vllm_xargs` values (JSON `true` becomes 1, so `"knn_skip_threshold":
false` would mean "skip every search"), and our validator only sees the coerced values. This ASGI
middleware reads the raw JSON of the completion and chat routes and answers 400 naming the field
when a knob has the wrong JSON type (engine/request_params.py, `RAW_TYPES`); any other request
passes through untouched, its body replayed as it came.
"""

from __future__ import annotations

import json

from starlette.responses import JSONResponse

from knnlm_serve.engine.request_params import raw_type_error

CHECKED_ROUTES = ("/v1/completions", "/v1/chat/completions")


class KnobTypesMiddleware:
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
        error = _knob_error(body)
        if error is not None:
            content = {"error": {"message": str(error), "type": "BadRequestError", "param": f"vllm_xargs.{error.field}", "code": 400}}
            return await JSONResponse(content, status_code=400)(scope, receive, send)
        await self.app(scope, _replay({"type": "http.request", "body": body, "more_body": False}, receive), send)


def _knob_error(body: bytes):
    if b"knn" not in body:
        return None
    try:
        request = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None  # vLLM reports malformed JSON itself
    xargs = request.get("vllm_xargs") if isinstance(request, dict) else None
    return raw_type_error(xargs) if isinstance(xargs, dict) else None


def _replay(first: dict, receive):
    """`receive` with `first` handed out before anything else."""
    pending = [first]

    async def replayed():
        return pending.pop() if pending else await receive()

    return replayed
