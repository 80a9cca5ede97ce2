"""Datastore admin API on vLLM's own server (a `vllm.endpoint_plugins` entry point).

    GET    /v1/knn/datastores          serving (and draining) datastores
    POST   /v1/knn/datastores          load or hot-swap {name, path, default?, key_type?}
    PUT    /v1/knn/default             {name}: the datastore for requests that name none
    DELETE /v1/knn/datastores/{name}   unload
    GET    /v1/knn/health              every shard actor's status

(Attached here too: the admin routes that add and forget documents of a serving datastore,
server/document_admin.py; and the provenance routes, POST /v1/knn/explain and
GET /v1/knn/documents/..., user routes behind vLLM's API key, not admin routes: server/explain.py.)

Every route needs the `X-Admin-Token` header (the admin token is not the inference API key).
Names are 1-64 letters, digits, '-' and '_'. Paths are resolved (symlinks too) and must lie inside
`knn.datastore_root`; responses and errors show them relative to it, never as server paths.
Domain errors carry their kind; `server/http_errors.py` maps it to an HTTP status, and nothing else does.

The plugin's `init_state` also attaches vLLM's workers (collective_rpc, as vLLM's endpoint-plugin
contract prescribes) and connects the registry to them: from then on admin changes reach every
worker between two steps.
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter, Body, Depends, FastAPI, Header, HTTPException, Request
from pydantic import BaseModel, ConfigDict, StrictBool

from knnlm_core.config import KeyType
from knnlm_core.errors import DatastoreError, ErrorKind, KnnlmError
from knnlm_serve.app_state import published_registry, registry_loaded
from knnlm_serve.engine.worker_extension import ATTACH, SET_RUNTIME, WORKER_STATE
from knnlm_serve.runtime import Runtime
from knnlm_serve.server.admin_access import admin_registry, check_name, parse_body, resolve_in_root
from knnlm_serve.server.grants import key_listing, tenant_of
from knnlm_serve.server.http_errors import STATUS, KnnHTTPError, KnnRoute, http_error
from knnlm_serve.server.registry import DatastoreRegistry

logger = logging.getLogger("knnlm_serve")

RPC_TIMEOUT_S = 60.0
UI_PATH = "/knn/ui"  # the kNN page (knn.ui): static files of knnlm_serve/ui/, calling the API from the browser


class LoadRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    path: str  # relative to knn.datastore_root, or absolute inside it
    default: StrictBool = False  # JSON true or false: no "yes" for a switch of the default
    key_type: KeyType | None = None  # refuse the load unless the datastore has this key type


class DefaultRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


def _admin_call(registry: DatastoreRegistry, fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except KnnlmError as e:
        raise http_error(e, registry) from None


router = APIRouter(prefix="/v1/knn", tags=["kNN datastore admin"], route_class=KnnRoute)


@router.get("/datastores")
def list_datastores(request: Request, x_admin_token: str | None = Header(None)) -> dict:
    """Every datastore, for the admin token; a tenant's key sees its own (server/grants.py)."""
    key = tenant_of(request.scope)
    if key is not None and x_admin_token is None:
        registry = getattr(request.app.state, "knnlm_registry", None)
        if registry is None:
            raise HTTPException(503, "kNN is not configured on this server (no knn.datastores)")
        return key_listing(registry.describe(), key)
    return admin_registry(request, x_admin_token).describe()


@router.post("/datastores")
def load_datastore(raw: dict | None = Body(None), registry: DatastoreRegistry = Depends(admin_registry)) -> dict:
    body = _admin_call(registry, parse_body, LoadRequest, raw)
    _admin_call(registry, check_name, body.name)
    path = _admin_call(registry, resolve_in_root, registry.config.datastore_root, body.path)
    try:
        info = registry.load(body.name, path, make_default=body.default, key_type=body.key_type)
    except KnnlmError as e:  # name the path as the client sent it: the server's absolute paths are not theirs
        about_path = e.kind not in (ErrorKind.UNAVAILABLE, ErrorKind.BUSY)  # those are the server's state, not the body's
        param = e.param or ("path" if about_path else None)
        raise KnnHTTPError(STATUS[e.kind], registry.public(str(e).replace(str(path), body.path)), param) from None
    return {"loaded": {**info.listed(), "path": registry.public_path(info.path)}, "default": registry.runtime.default}


@router.put("/default")
def set_default(raw: dict | None = Body(None), registry: DatastoreRegistry = Depends(admin_registry)) -> dict:
    body = _admin_call(registry, parse_body, DefaultRequest, raw)
    _admin_call(registry, registry.set_default, body.name)
    return {"default": body.name}


@router.delete("/datastores/{name}")
def unload_datastore(name: str, registry: DatastoreRegistry = Depends(admin_registry)) -> dict:
    _admin_call(registry, registry.unload, name)
    return {"unloaded": name, "default": registry.runtime.default}


@router.get("/health")
def shard_health(registry: DatastoreRegistry = Depends(admin_registry)) -> dict:
    return registry.health()


class VllmEngineLink:
    """`EngineLink` over vLLM's collective_rpc, callable from the registry's threads (not the event loop)."""

    def __init__(self, engine_client, loop: asyncio.AbstractEventLoop):
        self._engine_client, self._loop = engine_client, loop

    def _call(self, method: str, *args) -> list:
        """Each worker's answer; a worker's error (worker_extension's `_answer`) refuses what was asked."""
        rpc = self._engine_client.collective_rpc(method, timeout=RPC_TIMEOUT_S, args=args)
        answers = asyncio.run_coroutine_threadsafe(rpc, self._loop).result(RPC_TIMEOUT_S)
        for answer in answers:
            if "error" in answer:
                raise DatastoreError(f"vLLM's worker could not apply it ({answer['error']}); nothing changed", ErrorKind.UNAVAILABLE)
        return [answer["result"] for answer in answers]

    def set_runtime(self, runtime: Runtime) -> None:
        self._call(SET_RUNTIME, runtime.model_dump_json())

    def worker_state(self) -> tuple[set[tuple[str, int]], dict[tuple[str, int], str]]:
        states = self._call(WORKER_STATE)
        pinned = {(name, version) for state in states for name, version in state["pinned"]}
        return pinned, {(name, version): error for state in states for name, version, error in state["unhealthy"]}


def model_cpus(attached: list[dict]) -> dict[str, list[int]]:
    """host -> the CPUs vLLM's workers there are bound to, from what each worker's attach returned."""
    cpus: dict[str, set[int]] = {}
    for worker in attached:
        cpus.setdefault(worker["host"], set()).update(worker["cpus"])
    return {host: sorted(c) for host, c in cpus.items()}


class KnnAdminPlugin:
    """vLLM endpoint plugin: the admin routes, and the registry's connection to the workers."""

    name = "knnlm_admin"
    required_tasks = ("generate",)

    def attach_router(self, app: FastAPI) -> None:
        from knnlm_serve.server.admission import AdmissionMiddleware
        from knnlm_serve.server.document_admin import router as document_router
        from knnlm_serve.server.explain import router as explain_router
        from knnlm_serve.server.files_api import router as files_router
        from knnlm_serve.server.http_errors import KnnHTTPError, knn_http_error_response
        from knnlm_serve.server.vector_stores_api import router as vector_stores_router

        app.add_exception_handler(KnnHTTPError, knn_http_error_response)
        app.include_router(router)
        app.include_router(document_router)
        app.include_router(explain_router)
        app.include_router(files_router)
        app.include_router(vector_stores_router)
        app.add_middleware(AdmissionMiddleware)
        registry = published_registry()
        if registry is not None and registry.config.ui:
            from pathlib import Path

            from starlette.staticfiles import StaticFiles

            app.mount(UI_PATH, StaticFiles(directory=Path(__file__).parents[1] / "ui", html=True), name="knnlm_ui")
        if registry is not None and registry.config.keys_file is not None:  # outside admission: a key first
            from knnlm_serve.server.audit import AuditLog
            from knnlm_serve.server.keyring import Keyring
            from knnlm_serve.server.tenancy import TenantMiddleware

            keyring = Keyring(registry.config.keys_file, lambda: {*registry.config.datastores, *registry.runtime.datastores})
            app.add_middleware(TenantMiddleware, keyring=keyring, audit=AuditLog(registry.config.audit_log))

    async def init_state(self, engine_client, state, args) -> None:
        registry = published_registry()
        if registry is None or engine_client is None:
            return
        try:
            await asyncio.wrap_future(registry_loaded())  # loading since before vLLM started its engine
        except Exception as e:  # noqa: BLE001 - whatever stops a configured datastore stops the server
            raise SystemExit(f"knnlm-serve: error: {e}") from None
        attached = await engine_client.collective_rpc(ATTACH, timeout=RPC_TIMEOUT_S, args=(registry.runtime.model_dump_json(),))
        state.knnlm_registry = registry
        registry.connect(VllmEngineLink(engine_client, asyncio.get_running_loop()), model_cpus(attached))
        logger.info("kNN attached to %d worker(s): %s", len(attached), attached)
        from knnlm_serve.server.document_admin import document_jobs, sweep_added_texts

        stores = None
        if registry.config.datastore_root:  # the Files and Vector Stores API keeps its objects there
            from knnlm_serve.server.vector_stores import VectorStores

            stores = state.knnlm_vector_stores = VectorStores(registry, document_jobs(state), registry.config.files)
            await asyncio.to_thread(stores.load)  # a load asks the workers through this loop: never block it
        try:
            sweep_added_texts(registry)
        except (OSError, KnnlmError) as e:  # the server serves without it; the next start sweeps again
            logger.warning("could not sweep the added texts below knn.datastore_root: %s", e)
        if stores is not None:
            stores.start()
        if registry.config.follow_changes_s:
            from knnlm_serve.server.disk_follower import DiskFollower

            DiskFollower(registry, document_jobs(state), registry.config.follow_changes_s).start()
