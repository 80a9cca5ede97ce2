"""The admin API's document jobs (add, forget, compact): one at a time per datastore, with their
state for `GET /v1/knn/jobs/{job}`, and the child process an add or a compact runs in.

A child (`knnlm-index add` or `compact`) has its own memory and a lower priority than serving;
its progress lines become the job's, and its result is loaded like any hot-swap. A job whose child
fails (exits with an error, or is killed) runs its `on_failure`, which removes what it wrote (an
add's texts file and work directory), so it leaves nothing behind. Once the child has exited
well, its version is the datastore's directory: a load that fails then keeps every file that
version names, and the job's error says how to serve it.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone

from knnlm_core.errors import ErrorKind, KnnlmError
from knnlm_serve import metrics
from knnlm_serve.server.registry import DatastoreRegistry

logger = logging.getLogger("knnlm_serve")


@dataclass
class Job:
    id: str
    datastore: str
    kind: str  # add, forget, compact
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
        metrics.DOCUMENT_JOBS.labels(job.datastore, job.kind, job.state).inc()
        metrics.DOCUMENT_JOB_SECONDS.labels(job.datastore, job.kind).observe(job.seconds)
        with self._lock:
            self._busy.discard(job.datastore)


def run_child_job(
    jobs: DocumentJobs, job: Job, registry: DatastoreRegistry, path: str, command: list[str], on_failure: Callable[[], None]
) -> None:
    """Run `command` (a knnlm-index job on the datastore at `path`, printing its audit record as
    JSON), then serve the new version; `on_failure` runs if the child fails."""
    started, published = time.monotonic(), False
    try:
        child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=lambda: os.nice(10))  # serving first
        errors = _follow(child, job)
        if child.wait() != 0:
            raise KnnlmError(errors or f"knnlm-index {job.kind} exited with status {child.returncode}")
        published = True
        job.record = json.loads(registry.public(child.stdout.read().decode()))  # its sources as clients may see them
        job.progress = "loading the new version"
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
