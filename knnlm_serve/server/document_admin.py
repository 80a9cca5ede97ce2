"""Add and forget documents of a serving datastore, then hot-swap to the new version.

    POST   /v1/knn/datastores/{name}/documents        {paths?, texts?, recalibrate?}: 202 and a job
    DELETE /v1/knn/datastores/{name}/documents/{doc}  forget one document: 200 once the new version serves
    GET    /v1/knn/jobs/{job}                         an add's state and progress

An add runs `knnlm-index add` in a child process (its own memory, at a lower priority than
serving), then loads the new version like any hot-swap: requests already running finish on the
version they started on. `paths` lie below `knn.datastore_root`; `texts` ({text, id?}) are kept
as a .jsonl file below `<knn.datastore_root>/.knnlm-added/<name>/`, the source provenance names.
One add or forget runs per datastore at a time; another is refused with a 429.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone

from fastapi import APIRouter, Depends, HTTPException, Request
from pydantic import BaseModel, ConfigDict, Field

from knnlm_core.corpus import find_files
from knnlm_core.errors import ErrorKind, KnnlmError
from knnlm_serve import metrics
from knnlm_serve.server.admin_access import admin_registry, resolve_in_root
from knnlm_serve.server.http_errors import http_error
from knnlm_serve.server.registry import DatastoreRegistry

logger = logging.getLogger("knnlm_serve")

MAX_TEXT_BYTES = 4 * 2**20  # texts sent in one add's body
ADDED_TEXTS = ".knnlm-added"


class AddedText(BaseModel):
    model_config = ConfigDict(extra="forbid")
    text: str = Field(min_length=1)
    id: str | None = Field(None, max_length=256)


class AddRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    paths: list[str] = []  # files or directories below knn.datastore_root
    texts: list[AddedText] = []
    recalibrate: bool = False


@dataclass
class Job:
    id: str
    datastore: str
    kind: str
    state: str = "running"  # running, done, failed
    progress: str = ""  # the last progress line of `knnlm-index add`
    error: str | None = None
    version: int | None = None  # the version that serves the result
    record: dict | None = None  # the manifest's audit record of it
    started: str = field(default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds"))
    seconds: float | None = None


class DocumentJobs:
    """The jobs of this server process, and which datastore each one holds."""

    def __init__(self) -> None:
        self.jobs: dict[str, Job] = {}
        self._busy: set[str] = set()
        self._lock = threading.Lock()

    def begin(self, datastore: str, kind: str) -> Job:
        with self._lock:
            if datastore in self._busy:
                running = [j.id for j in self.jobs.values() if j.datastore == datastore and j.state == "running"]
                raise KnnlmError(
                    f"datastore {datastore!r} is busy with another add or forget ({', '.join(running) or 'a forget'}); "
                    "retry when it is done",
                    ErrorKind.BUSY,
                )
            self._busy.add(datastore)
            job = Job(uuid.uuid4().hex[:16], datastore, kind)
            self.jobs[job.id] = job
            return job

    def end(self, job: Job, started: float, error: str | None = None) -> None:
        job.state, job.error, job.seconds = ("failed" if error else "done"), error, round(time.monotonic() - started, 2)
        metrics.DOCUMENT_JOBS.labels(job.datastore, job.kind, job.state).inc()
        metrics.DOCUMENT_JOB_SECONDS.labels(job.datastore, job.kind).observe(job.seconds)
        with self._lock:
            self._busy.discard(job.datastore)


router = APIRouter(prefix="/v1/knn", tags=["kNN datastore admin"])


_JOBS_LOCK = threading.Lock()


def _jobs(request: Request) -> DocumentJobs:
    state = request.app.state
    with _JOBS_LOCK:  # route handlers run in a thread pool: two first requests must share one
        if not hasattr(state, "knnlm_document_jobs"):
            state.knnlm_document_jobs = DocumentJobs()
    return state.knnlm_document_jobs


@router.post("/datastores/{name}/documents", status_code=202)
def add_documents(name: str, body: AddRequest, request: Request, registry: DatastoreRegistry = Depends(admin_registry)) -> dict:
    try:
        info = registry.serving(name)
        files = _inputs(registry, name, body)
        job = _jobs(request).begin(name, "add")
    except KnnlmError as e:
        raise http_error(e, registry) from None
    threading.Thread(target=_run_add, args=(_jobs(request), job, registry, info.path, files, body.recalibrate), daemon=True).start()
    return asdict(job)


@router.get("/jobs/{job_id}")
def get_job(job_id: str, request: Request, registry: DatastoreRegistry = Depends(admin_registry)) -> dict:
    job = _jobs(request).jobs.get(job_id)
    if job is None:
        raise HTTPException(404, f"no job {job_id!r} on this server (jobs are kept until it restarts)")
    return asdict(job)


@router.delete("/datastores/{name}/documents/{document}")
def forget_document(name: str, document: int, request: Request, registry: DatastoreRegistry = Depends(admin_registry)) -> dict:
    from index_builder.forget import forget_documents

    jobs = _jobs(request)
    try:
        info = registry.serving(name)
        job = jobs.begin(name, "forget")
    except KnnlmError as e:
        raise http_error(e, registry) from None
    started = time.monotonic()
    try:
        _, (record,) = forget_documents(info.path, documents=[document])
        loaded = registry.load(name, info.path)
    except KnnlmError as e:
        jobs.end(job, started, registry.public(str(e)))
        raise http_error(e, registry) from None
    job.version, job.record = loaded.version, record.model_dump(mode="json")
    jobs.end(job, started)
    return asdict(job)


def _inputs(registry: DatastoreRegistry, name: str, body: AddRequest) -> list[str]:
    """The add's input files: the paths, checked to exist below the root, and the texts written to one .jsonl there."""
    if not body.paths and not body.texts:
        raise KnnlmError("nothing to add: give `paths` (below knn.datastore_root) or `texts` ([{text, id?}])", ErrorKind.MALFORMED)
    files = [resolve_in_root(registry.config.datastore_root, p) for p in body.paths]
    if files:
        find_files(files)  # a missing path or one with no text files is an error now, not in the job
    if body.texts:
        size = sum(len(t.text.encode()) for t in body.texts)
        if size > MAX_TEXT_BYTES:
            raise KnnlmError(
                f"texts hold {size:,} bytes, more than {MAX_TEXT_BYTES:,} in one request: put them in files below "
                "knn.datastore_root and send their `paths`",
                ErrorKind.MALFORMED,
            )
        folder = resolve_in_root(registry.config.datastore_root, f"{ADDED_TEXTS}/{name}")
        folder.mkdir(parents=True, exist_ok=True)
        file = folder / f"{datetime.now(timezone.utc).strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}.jsonl"
        file.write_text("".join(json.dumps(t.model_dump(exclude_none=True)) + "\n" for t in body.texts))
        files.append(file)
    return [str(f) for f in files]


def _run_add(jobs: DocumentJobs, job: Job, registry: DatastoreRegistry, path: str, files: list[str], recalibrate: bool) -> None:
    started = time.monotonic()
    command = [sys.executable, "-m", "index_builder.cli", "add", path, *files, "--model", str(registry.model.path)]
    try:
        child = subprocess.Popen(
            [*command, *(["--recalibrate"] if recalibrate else [])],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            preexec_fn=lambda: os.nice(10),  # serving first
        )
        errors = _follow(child, job)
        if child.wait() != 0:
            raise KnnlmError(errors or f"knnlm-index add exited with status {child.returncode}")
        job.record = json.loads(child.stdout.read())
        job.progress = "loading the new version"
        if registry.serving(job.datastore).path != path:
            raise KnnlmError(f"datastore {job.datastore!r} was swapped to another directory meanwhile: the new version is not loaded")
        job.version = registry.load(job.datastore, path).version
        job.progress = "serving"
    except Exception as e:  # noqa: BLE001 - a job reports its failure; the serving version is untouched
        logger.warning("adding documents to datastore %r failed: %s", job.datastore, e)
        jobs.end(job, started, registry.public(str(e)))
        return
    jobs.end(job, started)


def _follow(child: subprocess.Popen, job: Job) -> str | None:
    """Keep the child's latest progress line (tqdm redraws with carriage returns) in the job; its error line."""
    error, line = None, b""
    while chunk := child.stderr.read1(4096):
        line += chunk
        *done, line = line.replace(b"\r", b"\n").split(b"\n")
        for text in (d.decode(errors="replace").strip() for d in done):
            if text.startswith("knnlm-index: error: "):
                error = text.removeprefix("knnlm-index: error: ")
            elif text:
                job.progress = text
    return error
