"""The admin API's document jobs (add, forget, compact): one at a time per datastore, with their
state for `GET /v1/knn/jobs/{job}`, and the child process an add or a compact runs in.

A child (`knnlm-index add` or `compact`) has its own memory and a lower priority than serving;
its progress lines become the job's, and its result is loaded like any hot-swap. The job's thread
holds the datastore's writer lock from before the request is answered until the new version is
loaded, and the child works under it: no other writer, and no start-up sweep of another server,
comes in between. The child dies with that thread, so the lock never outlives the server while its
child still writes. A job whose child fails (exits with an error, or is killed) before it
publishes runs its `on_failure`, which removes what it wrote (an add's texts file and work
directory), so it leaves nothing behind. Once a new version is the datastore's directory, every
file it names is kept and it is loaded, even where the child failed after publishing; a load that
fails then leaves it there, and the job's error says how to serve it.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import shutil
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from knnlm_core.datastore import manifest_sha256, read_manifest
from knnlm_core.errors import ErrorKind, KnnlmError
from knnlm_core.manifest import job_record
from knnlm_serve import metrics
from knnlm_serve.server.registry import DatastoreRegistry

logger = logging.getLogger("knnlm_serve")

PR_SET_PDEATHSIG = 1  # prctl(2)
# Looked up here: a forked child should not load libraries. Linux only (elsewhere a child outlives
# a killed server, holding no lock).
_prctl = getattr(ctypes.CDLL(None, use_errno=True), "prctl", None)


KEPT_JOBS = 1000  # ended jobs `GET /v1/knn/jobs/{job}` still answers; running ones are always kept


@dataclass
class Job:
    id: str
    datastore: str
    kind: str  # add, forget, compact, build (a vector store's first documents)
    state: str = "running"  # running, done, failed
    progress: str = ""  # the last progress line of the child process
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
                    f"datastore {datastore!r} is busy with another add, forget or compact ({', '.join(running)}); retry when it is done",
                    ErrorKind.BUSY,
                )
            self._busy.add(datastore)
            job = Job(uuid.uuid4().hex[:16], datastore, kind)
            self.jobs[job.id] = job
            return job

    def holds(self, datastore: str) -> bool:
        """Whether an add, forget or compact of this datastore is running (it loads its own version)."""
        with self._lock:
            return datastore in self._busy

    def end(self, job: Job, started: float, error: str | None = None) -> None:
        job.state, job.error, job.seconds = ("failed" if error else "done"), error, round(time.monotonic() - started, 2)
        label = metrics.datastore_label(job.datastore)
        metrics.DOCUMENT_JOBS.labels(label, job.kind, job.state).inc()
        metrics.DOCUMENT_JOB_SECONDS.labels(label, job.kind).observe(job.seconds)
        with self._lock:
            self._busy.discard(job.datastore)
            ended = [i for i, j in self.jobs.items() if j.state != "running"]
            for job_id in ended[: max(0, len(ended) - KEPT_JOBS)]:  # oldest first: a server up for months keeps a bounded list
                del self.jobs[job_id]


def start_child_job(
    jobs: DocumentJobs,
    job: Job,
    registry: DatastoreRegistry,
    path: str,
    prepare: Callable[[], list[str]],
    on_failure: Callable[[], None],
) -> None:
    """Start the job's thread and return once it holds the datastore's writer lock and `prepare`
    (which writes the job's inputs) has given the command; raises, with the job ended, where the
    lock is another process's (busy) or `prepare` fails."""
    ready: Future = Future()
    threading.Thread(target=run_child_job, args=(jobs, job, registry, path, prepare, on_failure, ready), daemon=True).start()
    ready.result()


def run_child_job(jobs, job, registry, path, prepare, on_failure, ready: Future | None = None) -> None:
    """The job, in this thread, to its end (`ready` is set once it holds the lock and `prepare`
    has given the command; without it, a failure to start ends the job and is not raised)."""
    from index_builder.versions import busy_error, taken_writer_lock

    ready = ready or Future()

    started, lock = time.monotonic(), None
    try:
        lock = taken_writer_lock(Path(path))
        if lock is None:
            raise busy_error(job.datastore)
        command = prepare()
    except Exception as e:  # noqa: BLE001 - the request's answer
        if lock is not None:
            lock.release()
        jobs.end(job, started, registry.public(str(e)))
        ready.set_exception(e)
        return
    ready.set_result(None)
    try:
        _run_child(jobs, job, registry, path, command, on_failure)
    finally:
        lock.release()


def _child_of_this_thread(parent: int) -> None:
    """In the child before it runs: a lower priority than serving, and killed when the thread that
    started it ends (the server's death included), so it never writes without the lock."""
    os.nice(10)
    if _prctl is not None:
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the server died before the line above
        os._exit(1)


def _run_child(
    jobs: DocumentJobs,
    job: Job,
    registry: DatastoreRegistry,
    path: str,
    command: list[str],
    on_failure: Callable[[], None],
) -> None:
    """Run `command` (a knnlm-index job on the datastore at `path`) under this process's writer
    lock, then serve the new version. Whether the child published one is read from the directory,
    not from its exit: a child that fails after publishing (killed while it tidies up, or an add
    whose recalibration fails) leaves a whole version, whose files are kept and which is served.
    `on_failure` runs only if the child failed before publishing."""
    from index_builder.versions import lock_held_for_child, workdir

    started, published, parent, before = time.monotonic(), False, os.getpid(), manifest_sha256(path)
    try:
        child = subprocess.Popen(
            command,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env={**os.environ, **lock_held_for_child(Path(path))},
            preexec_fn=lambda: _child_of_this_thread(parent),
        )
        errors = _follow(child, job)
        status = child.wait()
        failure = None if status == 0 else errors or f"knnlm-index {job.kind} exited with status {status}"
        after = manifest_sha256(path)  # the writer lock is this job's: only the child writes there
        published = after is not None and after != before
        if not published:
            raise KnnlmError(failure or f"knnlm-index {job.kind} exited without writing a new version")
        shutil.rmtree(workdir(Path(path)), ignore_errors=True)  # a child killed in publish leaves the old version there
        job.progress = "loading the new version"
        if job.kind == "build":  # a vector store's first documents: a datastore that serves from now on
            job.version = registry.load(job.datastore, path).version
        else:
            job.record = json.loads(registry.public(json.dumps(job_record(read_manifest(path), job.kind))))  # sources as clients see them
            if registry.serving(job.datastore).path != path:
                raise KnnlmError(f"datastore {job.datastore!r} was swapped to another directory meanwhile: the new version is not loaded")
            job.version = registry.load(job.datastore, path, keep_actors=True).version
        job.progress = "serving"
    except Exception as e:  # noqa: BLE001 - a job reports its failure; the serving version is untouched
        logger.warning("%s on datastore %r failed: %s", job.kind, job.datastore, e)
        if not published:
            on_failure()
        error = f"{e}; the new version is in {path}, not serving: POST /v1/knn/datastores serves it" if published else str(e)
        jobs.end(job, started, registry.public(error))
        return
    if failure:
        logger.warning(
            "%s on datastore %r failed after publishing version %d, which serves: %s", job.kind, job.datastore, job.version, failure
        )
        failure = f"{failure}; its new version {job.version} was written before that and serves"
    jobs.end(job, started, registry.public(failure) if failure else None)


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
