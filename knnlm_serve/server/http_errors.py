"""Error kinds to HTTP statuses, in one place: every route's errors go through here."""

from __future__ import annotations

from http import HTTPStatus

from fastapi import HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute

from knnlm_core.errors import ErrorKind, KnnlmError

STATUS = {
    ErrorKind.MALFORMED: 400,
    ErrorKind.INVALID: 422,
    ErrorKind.NOT_FOUND: 404,
    ErrorKind.GONE: 410,
    ErrorKind.FORBIDDEN: 403,
    ErrorKind.UNAVAILABLE: 503,
    ErrorKind.BUSY: 429,
    ErrorKind.TOO_LARGE: 413,
}


class KnnHTTPError(HTTPException):
    """An HTTP error that keeps the request field it is about (`param`)."""

    def __init__(self, status_code: int, detail: str, param: str | None):
        super().__init__(status_code, detail)
        self.param = param


def http_error(e: KnnlmError, registry) -> KnnHTTPError:
    """The error's HTTP status, and its message with no server path in it."""
    return KnnHTTPError(STATUS[e.kind], registry.public(str(e)), e.param)


def error_response(status: int, message: str, param: str | None, kind: str | None = None, code: str | None = None) -> JSONResponse:
    """vLLM's error body, `{"error": {message, type, param, code}}` (type: the status's phrase
    unless given; code: the status unless given, e.g. OpenAI's `invalid_api_key`)."""
    error = {"message": message, "type": kind or HTTPStatus(status).phrase, "param": param, "code": code or status}
    return JSONResponse({"error": error}, status_code=status)


async def knn_http_error_response(request: Request, e: KnnHTTPError) -> JSONResponse:
    """Our errors with `param` naming the field: vLLM's handler for HTTPException drops it."""
    return error_response(e.status_code, e.detail, e.param)


def invalid_field(error: dict) -> KnnlmError:
    """A pydantic validation error as a 400 naming its field (`loc`: from the top of the body, or
    the path or query parameter's name)."""
    if error["type"] == "json_invalid":
        return KnnlmError(f"the body is not valid JSON: {error.get('ctx', {}).get('error', error['msg'])}", ErrorKind.MALFORMED, "body")
    field = ".".join(str(part) for part in error["loc"])
    shown = repr(error.get("input"))
    shown = shown[:80] + "..." if len(shown) > 80 else shown
    return KnnlmError(f"{field or 'the body'}: {error['msg']} (got {shown})", ErrorKind.MALFORMED, field or "body")


class KnnRoute(APIRoute):
    """Our routes answer a request FastAPI cannot parse (a body that is not a JSON object, a path
    or query value of the wrong type) in our format, naming the field; vLLM's app-wide handler
    prints pydantic's error list."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def route(request: Request):
            try:
                return await handler(request)
            except RequestValidationError as e:
                first = e.errors()[0]
                error = invalid_field({**first, "loc": first["loc"][1:]})  # after "body", "path" or "query"
                return error_response(STATUS[error.kind], str(error), error.param)

        return route
