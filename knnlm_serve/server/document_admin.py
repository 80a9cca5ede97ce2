"""Add, forget and compact the documents of a serving datastore, then hot-swap to the new version.

    POST   /v1/knn/datastores/{name}/documents        {paths?, texts?, recalibrate?}: 202 and a job
    DELETE /v1/knn/datastores/{name}/documents/{doc}  forget one document (?erase=true: its codes
                                                      leave the index files too): 200 once the new version serves
    POST   /v1/knn/datastores/{name}/compact          {shards?}: 202 and a job (`knnlm-index compact`)
    GET    /v1/knn/jobs/{job}                         a job's state and progress

An add or a compact runs `knnlm-index` in a child process (server/document_jobs.py), then loads
the new version like any hot-swap: requests already running finish on the version they started
on. `paths` lie below `knn.datastore_root`; `texts` ({text, id?}) are kept as a .jsonl file below
`<knn.datastore_root>/.knnlm-added/<name>/` (knnlm_core/added_texts.py), the source provenance
names, written once the add holds the datastore (this server's job slot, and the writer lock that
keeps out every other process) and removed if its child fails before publishing. A forget
erases the document's record from that file; the user's own files (`paths`) are never touched.
At start, `sweep_added_texts` removes what no serving version needs. One job runs per datastore
at a time, across processes; another is refused with a 429.
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
import threading
import time
import uuid
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

from fastapi import APIRouter, Body, Depends, HTTPException, Request
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from knnlm_core.added_texts import ADDED_TEXTS, erase_records, is_server_copy, orphaned_records, served_records
from knnlm_core.corpus import find_files
from knnlm_core.datastore import read_manifest
from knnlm_core.errors import ErrorKind, KnnlmError
from knnlm_core.provenance import DocumentTable
from knnlm_serve.server.admin_access import admin_registry, parse_body, resolve_in_root
from knnlm_serve.server.document_jobs import KEPT_JOBS, DocumentJobs, start_child_job
from knnlm_serve.server.http_errors import KnnRoute, http_error
from knnlm_serve.server.registry import DatastoreRegistry

logger = logging.getLogger("knnlm_serve")

MAX_TEXT_BYTES = 4 * 2**20  # texts sent in one add's body


class AddedText(BaseModel):
    model_config = ConfigDict(extra="forbid")
    text: str = Field(min_length=1)
    id: str | None = Field(None, max_length=256)


class AddRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    paths: list[str] = []  # files or directories below knn.datastore_root
    texts: list[AddedText] = []
    recalibrate: StrictBool = False


class CompactRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    shards: StrictInt | None = Field(None, gt=0)  # default: as many as the build's shard size needs


router = APIRouter(prefix="/v1/knn", tags=["kNN datastore admin"], route_class=KnnRoute)


_JOBS_LOCK = threading.Lock()


def document_jobs(state) -> DocumentJobs:
    """The server's jobs, on the app's state (`state`)."""
    with _JOBS_LOCK:  # route handlers run in a thread pool: two first requests must share one
        if not hasattr(state, "knnlm_document_jobs"):
            state.knnlm_document_jobs = DocumentJobs()
    return state.knnlm_document_jobs


def _jobs(request: Request) -> DocumentJobs:
    return document_jobs(request.app.state)


@router.post("/datastores/{name}/documents", status_code=202)
def add_documents(
    name: str, request: Request, raw: dict | None = Body(None), registry: DatastoreRegistry = Depends(admin_registry)
) -> dict:
    jobs = _jobs(request)
    try:
        body = parse_body(AddRequest, raw)
        info = registry.serving(name)
        files = _input_paths(registry, body)
        job = jobs.begin(name, "add")
    except KnnlmError as e:
        raise http_error(e, registry) from None
    texts: list[Path] = []  # written once the job holds the datastore

    def prepare() -> list[str]:
        if body.texts:
            try:
                texts.append(write_added_texts(registry.config.datastore_root, name, body.texts))
            except OSError as e:
                raise KnnlmError(f"could not keep the texts below knn.datastore_root: {e}", ErrorKind.UNAVAILABLE) from None
        command = [sys.executable, "-m", "index_builder.cli", "add", info.path, *files, *map(str, texts)]
        return command + ["--model", str(registry.model.path)] + (["--recalibrate"] if body.recalibrate else [])

    try:
        start_child_job(jobs, job, registry, info.path, prepare, lambda: _discard_add(info.path, texts))
    except KnnlmError as e:
        raise http_error(e, registry) from None
    return asdict(job)


@router.post("/datastores/{name}/compact", status_code=202)
def compact(name: str, request: Request, raw: dict | None = Body(None), registry: DatastoreRegistry = Depends(admin_registry)) -> dict:
    from index_builder.compact import check_compactable

    jobs = _jobs(request)
    try:
        body = parse_body(CompactRequest, raw)
        info = registry.serving(name)
        job = jobs.begin(name, "compact")
    except KnnlmError as e:
        raise http_error(e, registry) from None

    def prepare() -> list[str]:
        check_compactable(read_manifest(Path(info.path)), name, body.shards)
        return [sys.executable, "-m", "index_builder.cli", "compact", info.path] + (["--shards", str(body.shards)] if body.shards else [])

    try:
        start_child_job(jobs, job, registry, info.path, prepare, lambda: None)
    except KnnlmError as e:
        raise http_error(e, registry) from None
    return asdict(job)


@router.get("/jobs/{job_id}")
def get_job(job_id: str, request: Request, registry: DatastoreRegistry = Depends(admin_registry)) -> dict:
    job = _jobs(request).jobs.get(job_id)
    if job is None:
        raise HTTPException(404, f"no job {job_id!r} on this server (it keeps its last {KEPT_JOBS} ended jobs, until it restarts)")
    return asdict(job)


@router.delete("/datastores/{name}/documents/{document}")
def forget_document(
    name: str, document: int, request: Request, erase: bool = False, registry: DatastoreRegistry = Depends(admin_registry)
) -> dict:
    from index_builder.forget import forget_documents

    jobs = _jobs(request)
    try:
        info = registry.serving(name)
        job = jobs.begin(name, "forget")
    except KnnlmError as e:
        raise http_error(e, registry) from None
    started = time.monotonic()
    try:
        _, (record,) = forget_documents(info.path, documents=[document], erase=erase)
    except Exception as e:  # noqa: BLE001 - the job ends either way; kNN errors answer through the error map
        jobs.end(job, started, registry.public(str(e)))
        if isinstance(e, KnnlmError):
            raise http_error(e, registry) from None
        raise
    try:
        loaded = registry.load(name, info.path, keep_actors=True)
    except Exception as e:  # noqa: BLE001 - forgotten in the files, and that version is not serving
        error = KnnlmError(
            f"document {document} is forgotten in {info.path}, but that version is not serving ({e}): a version "
            "loaded before may serve the document until POST /v1/knn/datastores serves the directory again",
            ErrorKind.UNAVAILABLE,
        )
        jobs.end(job, started, registry.public(str(error)))
        raise http_error(error, registry) from None
    job.version = loaded.version
    job.record = json.loads(registry.public(record.model_dump_json())) | {"source": registry.public_source(record.source)}
    jobs.end(job, started)
    untouched = [] if is_server_copy(record.source) else [job.record["source"]]
    return {**asdict(job), "untouched": untouched}


def _input_paths(registry: DatastoreRegistry, body: AddRequest) -> list[str]:
    """The add's input files, checked to exist below the root (the texts are written once the job starts)."""
    if not body.paths and not body.texts:
        raise KnnlmError("nothing to add: give `paths` (below knn.datastore_root) or `texts` ([{text, id?}])", ErrorKind.MALFORMED)
    size = sum(len(t.text.encode()) for t in body.texts)
    if size > MAX_TEXT_BYTES:
        raise KnnlmError(
            f"texts hold {size:,} bytes, more than {MAX_TEXT_BYTES:,} in one request: put them in files below "
            "knn.datastore_root and send their `paths`",
            ErrorKind.MALFORMED,
        )
    files = [resolve_in_root(registry.config.datastore_root, p, "paths") for p in body.paths]
    if files:
        try:
            find_files(files)  # a missing path or one with no text files is an error now, not in the job
        except KnnlmError as e:
            raise KnnlmError(f"paths: {e} (give files or directories below knn.datastore_root)", e.kind, "paths") from None
    return [str(f) for f in files]


def write_added_texts(datastore_root: str, name: str, texts: list[AddedText]) -> Path:
    """The texts of an add to datastore `name`, kept below `datastore_root` for `knnlm-index add`
    to read (and provenance to name): a new file, or none where writing fails."""
    folder = resolve_in_root(datastore_root, f"{ADDED_TEXTS}/{name}")
    folder.mkdir(parents=True, exist_ok=True)
    file = folder / f"{datetime.now(timezone.utc).strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}.jsonl"
    try:
        file.write_text("".join(json.dumps(t.model_dump(exclude_none=True)) + "\n" for t in texts))
    except OSError:
        file.unlink(missing_ok=True)  # no part of the texts stays behind a refused add
        raise
    return file


def _discard_add(path: str, texts: list[Path]) -> None:
    """What a failed add wrote (its job still holds the datastore): its texts file, and the work
    directory it would have resumed from."""
    from index_builder.versions import workdir

    for file in texts:
        file.unlink(missing_ok=True)
    work = workdir(Path(path))
    marker = work / "build.json"
    if marker.exists() and json.loads(marker.read_text()).get("job") == "add":
        shutil.rmtree(work, ignore_errors=True)


def sweep_added_texts(registry: DatastoreRegistry) -> None:
    """At start: for each serving datastore, remove its texts files that its provenance does not
    name (an add that never served) and erase the records of its forgotten documents (a forget
    interrupted before it erased them). Files of a name that is not serving are only reported, and
    those of a datastore another process is changing (another server's add) are left to the next start."""
    from index_builder.versions import taken_writer_lock

    root = registry.config.datastore_root
    if not root:
        return
    base = Path(root).expanduser().resolve() / ADDED_TEXTS
    for folder in sorted(p for p in base.iterdir() if p.is_dir()) if base.is_dir() else []:
        if folder.name not in registry.runtime.datastores:
            logger.warning(
                "%s: texts of a datastore not serving under that name are kept (%d file(s))", folder, len(list(folder.glob("*")))
            )
            continue
        path = Path(registry.serving(folder.name).path)
        lock = taken_writer_lock(path)  # held through the sweep: no add of another process starts meanwhile
        if lock is None:
            logger.info("%s: datastore %r is being changed by another process; its texts are swept at the next start", folder, folder.name)
            continue
        try:
            _sweep_folder(folder, path)
        finally:
            lock.release()


def _sweep_folder(folder: Path, datastore: Path) -> None:
    manifest = read_manifest(datastore)
    if manifest.provenance is None:
        return
    served = served_records(DocumentTable.read(datastore / manifest.provenance.path), {r.document for r in manifest.forgotten})
    unnamed, stale = orphaned_records(folder, served)
    for path in unnamed:
        path.unlink()
        logger.info("removed %s: no document of datastore %r comes from it (an add that never served)", path, folder.name)
    for path, lines in stale.items():
        erase_records(path, lines)
        logger.info("erased %d forgotten record(s) of datastore %r from %s", len(lines), folder.name, path)
