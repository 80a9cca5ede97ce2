"""OpenAI's Files API, `/v1/files`: what a key uploads, to put in its vector stores.

The routes are thin: storage, limits and ownership are knnlm_serve/server/file_store.py's, and a
deleted file leaves its vector stores first (knnlm_serve/server/vector_stores.py). Every error
goes through the one error map (server/http_errors.py) and names its field.
"""

from __future__ import annotations

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile

from knnlm_core.errors import ErrorKind, KnnlmError
from knnlm_serve.server.audit import record_of
from knnlm_serve.server.grants import tenant_of
from knnlm_serve.server.http_errors import KnnRoute, http_error

router = APIRouter(prefix="/v1", tags=["files"], route_class=KnnRoute)


def owner_of(request: Request) -> str | None:
    """Whose objects the request sees: its key's id, or None on a server without keys."""
    key = tenant_of(request.scope)
    return key.id if key is not None else None


def created(request: Request, object_id: str) -> None:
    """The audit line names what the request made."""
    if (record := record_of(request.scope)) is not None:
        record.created = object_id


def services(request: Request):
    """The server's files and vector stores; a 503 where it keeps none (no knn.datastore_root)."""
    stores = getattr(request.app.state, "knnlm_vector_stores", None)
    if stores is None:
        registry = getattr(request.app.state, "knnlm_registry", None)
        raise http_error(
            KnnlmError(
                "this server keeps no files: set knn.datastore_root (and serve a datastore) to use the Files and Vector Stores API",
                ErrorKind.UNAVAILABLE,
            ),
            registry,
        )
    return stores


def failing(request: Request, e: KnnlmError):
    return http_error(e, request.app.state.knnlm_registry)


def page(objects: list[dict], limit: int, order: str, after: str | None, before: str | None) -> dict:
    """OpenAI's list page over `objects` (oldest first): `data`, `first_id`, `last_id`, `has_more`."""
    ordered = objects if order == "asc" else objects[::-1]
    ids = [o["id"] for o in ordered]
    if after is not None:
        ordered = ordered[ids.index(after) + 1 :] if after in ids else []
    if before is not None:
        ids = [o["id"] for o in ordered]
        ordered = ordered[: ids.index(before)] if before in ids else ordered
    data = ordered[:limit]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": len(ordered) > limit,
    }


LIMIT = Query(20, ge=1, le=100)
ORDER = Query("desc", pattern="^(asc|desc)$")


@router.post("/files")
async def create_file(request: Request) -> dict:
    stores = services(request)
    form = await request.form()
    upload = form.get("file")
    try:
        if not isinstance(upload, UploadFile):
            raise KnnlmError("file is missing: send the file as the multipart part `file`", ErrorKind.MALFORMED, "file")
        purpose = form.get("purpose")
        if not isinstance(purpose, str):
            raise KnnlmError("purpose is missing: send `purpose` (assistants or user_data)", ErrorKind.MALFORMED, "purpose")
        expires = None
        if "expires_after[seconds]" in form:
            seconds = str(form["expires_after[seconds]"])
            if not seconds.isdigit():
                raise KnnlmError("expires_after.seconds must be a whole number of seconds", ErrorKind.MALFORMED, "expires_after")
            expires = {"anchor": form.get("expires_after[anchor]", "created_at"), "seconds": int(seconds)}
        data = await upload.read(stores.files.limits.max_file_bytes + 1)
        stored = await run_in_threadpool(stores.files.create, owner_of(request), upload.filename or "upload", purpose, data, expires)
        created(request, stored.id)
    except KnnlmError as e:
        raise failing(request, e) from None
    finally:
        await form.close()
    return stored.public()


@router.get("/files")
def list_files(request: Request, limit: int = LIMIT, order: str = ORDER, after: str | None = None, purpose: str | None = None) -> dict:
    files = services(request).files.owned(owner_of(request))
    return page([f.public() for f in files if purpose in (None, f.purpose)], limit, order, after, None)


@router.get("/files/{file_id}")
def retrieve_file(file_id: str, request: Request) -> dict:
    try:
        return services(request).files.get(owner_of(request), file_id).public()
    except KnnlmError as e:
        raise failing(request, e) from None


@router.get("/files/{file_id}/content")
def file_content(file_id: str, request: Request) -> Response:
    files = services(request).files
    try:
        stored = files.get(owner_of(request), file_id)
    except KnnlmError as e:
        raise failing(request, e) from None
    return Response(files.content(stored), media_type="application/octet-stream")


@router.delete("/files/{file_id}")
def delete_file(file_id: str, request: Request) -> dict:
    stores = services(request)
    owner = owner_of(request)
    try:
        stores.delete_file(owner, stores.files.get(owner, file_id))
    except KnnlmError as e:
        raise failing(request, e) from None
    return {"id": file_id, "object": "file", "deleted": True}
