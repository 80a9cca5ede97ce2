"""Who may use the admin API, where its paths may point, and its bodies' checks: shared by its routes."""

from __future__ import annotations

import hmac
import os
from pathlib import Path
from typing import TypeVar

from fastapi import Header, HTTPException, Request
from pydantic import BaseModel, ValidationError

from knnlm_core.config import datastore_name_problem
from knnlm_core.errors import ErrorKind, KnnlmError
from knnlm_serve.server.http_errors import invalid_field
from knnlm_serve.server.registry import DatastoreRegistry

ADMIN_TOKEN_ENV = "KNNLM_ADMIN_TOKEN"
M = TypeVar("M", bound=BaseModel)


def admin_registry(request: Request, x_admin_token: str | None = Header(None)) -> DatastoreRegistry:
    registry = getattr(request.app.state, "knnlm_registry", None)
    if registry is None:
        raise HTTPException(503, "kNN is not configured on this server (no knn.datastores)")
    expected = registry.config.admin_token or os.environ.get(ADMIN_TOKEN_ENV)
    if not expected:
        raise HTTPException(403, f"the admin API is disabled: set knn.admin_token or {ADMIN_TOKEN_ENV}")
    if not x_admin_token or not hmac.compare_digest(x_admin_token.encode(), expected.encode()):
        raise HTTPException(401, "missing or wrong X-Admin-Token header")
    return registry


def resolve_in_root(root: str | None, path: str, field: str = "path") -> Path:
    """`path` below knn.datastore_root, resolved; errors name the body `field` it came in."""
    if root is None:
        raise KnnlmError("loading datastores through the admin API is disabled: set knn.datastore_root", ErrorKind.FORBIDDEN)
    if not path or any(not c.isprintable() for c in path):
        raise KnnlmError(
            f"path {path!r} is invalid: give a directory below knn.datastore_root, without control characters", ErrorKind.MALFORMED, field
        )
    root_dir = Path(root).expanduser().resolve()
    candidate = (root_dir / path).resolve()
    if not candidate.is_relative_to(root_dir):
        raise KnnlmError(f"path {path!r} resolves outside the datastore root (knn.datastore_root)", ErrorKind.FORBIDDEN, field)
    return candidate


def check_name(name: str) -> None:
    if problem := datastore_name_problem(name):
        raise KnnlmError(f"name: {problem}", ErrorKind.MALFORMED, "name")


def parse_body(model: type[M], body: object) -> M:
    """An admin route's JSON body as `model`; a 400 naming the field otherwise (validated here, not
    in the route's signature, so that fields such as `default` keep their names in the error)."""
    try:
        return model.model_validate(body if body is not None else {})
    except ValidationError as e:
        raise invalid_field(e.errors()[0]) from None
