"""Datastore admin API on vLLM's own server (a `vllm.endpoint_plugins` entry point).

    GET    /v1/knn/datastores          serving (and draining) datastores
    POST   /v1/knn/datastores          load or hot-swap {name, path, default?, key_type?}
    PUT    /v1/knn/default             {name}: the datastore for requests that name none
    DELETE /v1/knn/datastores/{name}   unload
    GET    /v1/knn/health              every shard actor's status

Every route needs the `X-Admin-Token` header (the admin token is not the inference API key).
Paths are resolved (symlinks too) and must lie inside `knn.datastore_root`.
"""

from __future__ import annotations

import hmac
import os
from pathlib import Path

from fastapi import APIRouter, Depends, FastAPI, Header, HTTPException
from pydantic import BaseModel, ConfigDict

from knnlm_serve import registry as registry_module
from knnlm_serve.config import KeyType
from knnlm_serve.registry import AdminError, DatastoreRegistry

ADMIN_TOKEN_ENV = "KNNLM_ADMIN_TOKEN"


class LoadRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    path: str  # relative to knn.datastore_root, or absolute inside it
    default: bool = False
    key_type: KeyType | None = None  # refuse the load unless the datastore has this key type


class DefaultRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


def admin_registry(x_admin_token: str | None = Header(None)) -> DatastoreRegistry:
    registry = registry_module.REGISTRY
    if registry is None:
        raise HTTPException(503, "kNN is not configured on this server (no knn.datastores)")
    expected = registry.runtime.knn.admin_token or os.environ.get(ADMIN_TOKEN_ENV)
    if not expected:
        raise HTTPException(403, f"the admin API is disabled: set knn.admin_token or {ADMIN_TOKEN_ENV}")
    if not x_admin_token or not hmac.compare_digest(x_admin_token.encode(), expected.encode()):
        raise HTTPException(401, "missing or wrong X-Admin-Token header")
    return registry


def resolve_in_root(root: str | None, path: str) -> Path:
    if root is None:
        raise HTTPException(403, "loading datastores through the admin API is disabled: set knn.datastore_root")
    root_dir = Path(root).expanduser().resolve()
    candidate = (root_dir / path).resolve()
    if not candidate.is_relative_to(root_dir):
        raise HTTPException(403, f"path {path!r} resolves to {candidate}, outside the datastore root {root_dir}")
    return candidate


def _admin_call(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except AdminError as e:
        raise HTTPException(e.status, str(e)) from None


router = APIRouter(prefix="/v1/knn", tags=["kNN datastore admin"])


@router.get("/datastores")
def list_datastores(registry: DatastoreRegistry = Depends(admin_registry)) -> dict:
    return registry.describe()


@router.post("/datastores")
def load_datastore(body: LoadRequest, registry: DatastoreRegistry = Depends(admin_registry)) -> dict:
    path = resolve_in_root(registry.runtime.knn.datastore_root, body.path)
    info = _admin_call(registry.load, body.name, path, make_default=body.default, key_type=body.key_type)
    return {"loaded": info.model_dump(), "default": registry.runtime.knn.default_datastore}


@router.put("/default")
def set_default(body: DefaultRequest, registry: DatastoreRegistry = Depends(admin_registry)) -> dict:
    _admin_call(registry.set_default, body.name)
    return {"default": body.name}


@router.delete("/datastores/{name}")
def unload_datastore(name: str, registry: DatastoreRegistry = Depends(admin_registry)) -> dict:
    _admin_call(registry.unload, name)
    return {"unloaded": name, "default": registry.runtime.knn.default_datastore}


@router.get("/health")
def shard_health(registry: DatastoreRegistry = Depends(admin_registry)) -> dict:
    return registry.health()


class KnnAdminPlugin:
    """vLLM endpoint plugin: attaches the admin routes (and their OpenAPI schema) to the server."""

    name = "knnlm_admin"
    required_tasks = None

    def attach_router(self, app: FastAPI) -> None:
        app.include_router(router)

    async def init_state(self, engine_client, state, args) -> None:
        pass
