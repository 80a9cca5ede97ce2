"""One error base for the whole project: a message that names the problem and the fix, plus a kind.

The kind says what went wrong from the caller's side, so each front end maps it once: the HTTP
layer to a status code, the CLIs to `error: ...` and exit 1.
"""

from __future__ import annotations

from enum import Enum


class ErrorKind(str, Enum):
    MALFORMED = "malformed"  # a request field is not of its form (a name, a path, a knob's type)
    INVALID = "invalid"  # the input is wrong: fix it and retry
    NOT_FOUND = "not_found"  # a named thing (path, datastore) does not exist
    GONE = "gone"  # it existed and was removed on purpose (a forgotten document)
    FORBIDDEN = "forbidden"  # allowed by nobody in this configuration
    UNAVAILABLE = "unavailable"  # a dependency failed (a shard, the engine): retry later
    BUSY = "busy"  # at capacity for this kind of request: retry later
    TOO_LARGE = "too_large"  # past a size limit or quota: send less, or delete something first


class KnnlmError(Exception):
    kind: ErrorKind = ErrorKind.INVALID

    def __init__(self, message: str, kind: ErrorKind | None = None, param: str | None = None):
        super().__init__(message)
        if kind is not None:
            self.kind = kind
        self.param = param  # the request field it is about (`error.param` in an HTTP answer), where one is


class ConfigError(KnnlmError):
    """A config file or flag that cannot be used; the message names the file and the field."""


class ModelError(KnnlmError):
    """A model path or cache that cannot be used; the message says what to do."""


class DatastoreError(KnnlmError):
    """A datastore that cannot be used as asked; the message names the problem and the fix."""


class CorpusError(KnnlmError):
    """An input text that cannot be read as asked; the message names the file and the fix."""
