"""Error kinds to HTTP statuses, in one place: every route's errors go through here."""

from __future__ import annotations

from fastapi import HTTPException

from knnlm_core.errors import ErrorKind, KnnlmError

STATUS = {
    ErrorKind.MALFORMED: 400,
    ErrorKind.INVALID: 422,
    ErrorKind.NOT_FOUND: 404,
    ErrorKind.GONE: 410,
    ErrorKind.FORBIDDEN: 403,
    ErrorKind.UNAVAILABLE: 503,
    ErrorKind.BUSY: 429,
}


def http_error(e: KnnlmError, registry) -> HTTPException:
    """The error's HTTP status, and its message with no server path in it."""
    return HTTPException(STATUS[e.kind], registry.public(str(e)))
