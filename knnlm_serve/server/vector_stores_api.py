"""OpenAI's Vector Stores API, `/v1/vector_stores`: stores, their files and file batches, and
search, each store a kNN datastore of its owner's (knnlm_serve/server/vector_stores.py).

A vector-store file's id is its file's id, as OpenAI's client polls it. Bodies are checked here
against OpenAI's bounds, each error a 400 naming its field.
"""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Body, Request, Response
from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.concurrency import run_in_threadpool

from knnlm_core.errors import ErrorKind, KnnlmError
from knnlm_serve.server.admin_access import parse_body
from knnlm_serve.server.files_api import LIMIT, ORDER, created, failing, owner_of, page, services
from knnlm_serve.server.http_errors import KnnRoute
from knnlm_serve.server.vector_store_search import search_store

router = APIRouter(prefix="/v1/vector_stores", tags=["vector stores"], route_class=KnnRoute)
POLL_AFTER, POLL_AFTER_MS = "openai-poll-after-ms", "250"  # OpenAI's client polls a file or batch this often


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StaticChunking(_Body):
    max_chunk_size_tokens: int = Field(ge=100, le=4096)
    chunk_overlap_tokens: int = Field(ge=0)

    @model_validator(mode="after")
    def _overlap_at_most_half(self) -> StaticChunking:
        if self.chunk_overlap_tokens > self.max_chunk_size_tokens // 2:
            raise ValueError("chunk_overlap_tokens must not exceed half of max_chunk_size_tokens")
        return self


class Chunking(_Body):
    type: Literal["auto", "static"] = "auto"
    static: StaticChunking | None = None

    @model_validator(mode="after")
    def _static_has_sizes(self) -> Chunking:
        if (self.type == "static") != (self.static is not None):
            raise ValueError("give `static` {max_chunk_size_tokens, chunk_overlap_tokens} exactly when type is static")
        return self


class StoreExpiry(_Body):
    anchor: Literal["last_active_at"]
    days: int = Field(ge=1, le=365)


Metadata = Annotated[dict[str, str], Field(max_length=16)]
Attributes = Annotated[dict[str, str | float | bool], Field(max_length=16)]


class CreateStore(_Body):
    name: str | None = Field(None, max_length=256)
    file_ids: list[str] = Field(default_factory=list, max_length=500)
    metadata: Metadata = Field(default_factory=dict)
    expires_after: StoreExpiry | None = None
    chunking_strategy: Chunking = Field(default_factory=Chunking)


class ModifyStore(_Body):
    name: str | None = Field(None, max_length=256)
    metadata: Metadata | None = None
    expires_after: StoreExpiry | None = None


class AttachFile(_Body):
    file_id: str
    attributes: Attributes = Field(default_factory=dict)
    chunking_strategy: Chunking = Field(default_factory=Chunking)


class BatchFile(_Body):
    file_id: str
    attributes: Attributes | None = None


class AttachBatch(_Body):
    file_ids: list[str] = Field(default_factory=list, max_length=500)
    files: list[BatchFile] = Field(default_factory=list, max_length=500)
    attributes: Attributes = Field(default_factory=dict)
    chunking_strategy: Chunking = Field(default_factory=Chunking)

    @model_validator(mode="after")
    def _some_files(self) -> AttachBatch:
        if not self.file_ids and not self.files:
            raise ValueError("give file_ids or files")
        return self


class Search(_Body):
    query: str | list[str] = Field(min_length=1)
    max_num_results: int = Field(10, ge=1, le=50)


def _call(request: Request, action, *args):
    try:
        return action(*args)
    except KnnlmError as e:
        raise failing(request, e) from None


def _store(request: Request, store_id: str):
    stores = services(request)
    return stores, _call(request, stores.get, owner_of(request), store_id)


def _files(request: Request, stores, file_ids: list[str], param: str) -> list:
    owner = owner_of(request)
    return [_call(request, stores.files.get, owner, f, param) for f in file_ids]


@router.post("")
def create_store(request: Request, raw: dict | None = Body(None)) -> dict:
    stores = services(request)
    body = _call(request, parse_body, CreateStore, raw)
    files = _files(request, stores, body.file_ids, "file_ids")
    expires = body.expires_after.model_dump() if body.expires_after else None
    store = _call(request, stores.create, owner_of(request), body.name, body.metadata, expires)
    created(request, store.id)
    for stored in files:
        stores.attach(store, stored, {}, body.chunking_strategy.model_dump(exclude_none=True))
    return store.public()


@router.get("")
def list_stores(request: Request, limit: int = LIMIT, order: str = ORDER, after: str | None = None, before: str | None = None) -> dict:
    return page([s.public() for s in services(request).owned(owner_of(request))], limit, order, after, before)


@router.get("/{store_id}")
def retrieve_store(store_id: str, request: Request) -> dict:
    return _store(request, store_id)[1].public()


@router.post("/{store_id}")
def modify_store(store_id: str, request: Request, raw: dict | None = Body(None)) -> dict:
    stores, store = _store(request, store_id)
    body = _call(request, parse_body, ModifyStore, raw)
    update = body.model_dump(exclude_unset=True)
    return stores.modify(store, update).public()


@router.delete("/{store_id}")
async def delete_store(store_id: str, request: Request) -> dict:
    stores, store = _store(request, store_id)
    await run_in_threadpool(stores.delete, store)
    return {"id": store_id, "object": "vector_store.deleted", "deleted": True}


@router.post("/{store_id}/files")
def attach_file(store_id: str, request: Request, raw: dict | None = Body(None)) -> dict:
    stores, store = _store(request, store_id)
    body = _call(request, parse_body, AttachFile, raw)
    (stored,) = _files(request, stores, [body.file_id], "file_id")
    return stores.attach(store, stored, body.attributes, body.chunking_strategy.model_dump(exclude_none=True)).public(store.id)


@router.get("/{store_id}/files")
def list_store_files(
    store_id: str,
    request: Request,
    limit: int = LIMIT,
    order: str = ORDER,
    after: str | None = None,
    before: str | None = None,
    filter: str | None = None,  # noqa: A002 - OpenAI's name
) -> dict:
    store = _store(request, store_id)[1]
    entries = sorted(store.files.values(), key=lambda f: (f.created_at, f.id))
    return page([f.public(store.id) for f in entries if filter in (None, f.status)], limit, order, after, before)


@router.get("/{store_id}/files/{file_id}")
def retrieve_store_file(store_id: str, file_id: str, request: Request, response: Response) -> dict:
    response.headers[POLL_AFTER] = POLL_AFTER_MS
    store = _store(request, store_id)[1]
    entry = store.files.get(file_id)
    if entry is None:
        raise failing(
            request, KnnlmError(f"No file found with id {file_id!r} in vector store {store_id!r}.", ErrorKind.NOT_FOUND, "file_id")
        )
    return entry.public(store.id)


@router.delete("/{store_id}/files/{file_id}")
async def detach_file(store_id: str, file_id: str, request: Request) -> dict:
    stores, store = _store(request, store_id)
    await run_in_threadpool(_call, request, stores.detach, store, file_id)
    return {"id": file_id, "object": "vector_store.file.deleted", "deleted": True}


@router.post("/{store_id}/file_batches")
def create_batch(store_id: str, request: Request, raw: dict | None = Body(None)) -> dict:
    stores, store = _store(request, store_id)
    body = _call(request, parse_body, AttachBatch, raw)
    ids = [*body.file_ids, *(f.file_id for f in body.files)]
    attributes = [body.attributes] * len(body.file_ids) + [f.attributes or body.attributes for f in body.files]
    files = _files(request, stores, ids, "file_ids" if body.file_ids else "files")
    batch = stores.batch(store, list(zip(files, attributes)), body.chunking_strategy.model_dump(exclude_none=True))
    return _batch(store, batch)


@router.get("/{store_id}/file_batches/{batch_id}")
def retrieve_batch(store_id: str, batch_id: str, request: Request, response: Response) -> dict:
    response.headers[POLL_AFTER] = POLL_AFTER_MS
    store = _store(request, store_id)[1]
    if batch_id not in store.batches:
        raise failing(request, KnnlmError(f"No file batch found with id {batch_id!r}.", ErrorKind.NOT_FOUND, "batch_id"))
    return _batch(store, batch_id)


def _batch(store, batch_id: str) -> dict:
    batch = store.batches[batch_id]
    counts = store.counts(batch["file_ids"])
    return {
        "id": batch_id,
        "object": "vector_store.files_batch",
        "created_at": batch["created_at"],
        "vector_store_id": store.id,
        "status": "in_progress" if counts["in_progress"] else "completed",
        "file_counts": counts,
    }


@router.post("/{store_id}/search")
async def search(store_id: str, request: Request, raw: dict | None = Body(None)) -> dict:
    stores, store = _store(request, store_id)
    body = _call(request, parse_body, Search, raw)
    query = body.query if isinstance(body.query, str) else " ".join(body.query)
    results = await run_in_threadpool(search_store, stores, store, query, body.max_num_results)
    return {"object": "vector_store.search_results.page", "search_query": [query], "data": results, "has_more": False, "next_page": None}
