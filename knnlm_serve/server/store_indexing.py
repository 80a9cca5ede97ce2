"""Indexing one file of a vector store: its documents written as the store's texts, then
`knnlm-index build` (the store's first file) or `add` run in a child process as a document job,
whose new version the registry serves when it is done (knnlm_serve/server/document_jobs.py);
and the order waiting files are indexed in, one at a time, each key's in turn."""

from __future__ import annotations

import shutil
import sys
import threading
from collections import deque
from pathlib import Path

from knnlm_core.errors import KnnlmError
from knnlm_core.manifest import MANIFEST
from knnlm_core.uploads import UploadError, documents_of
from knnlm_core.vector_store_records import StoredFile, write_documents
from knnlm_serve.server.document_jobs import DocumentJobs, run_child_job
from knnlm_serve.server.registry import DatastoreRegistry


class KeyTurns:
    """Files waiting to be indexed, taken one key at a time in turn, each key's in the order they
    came: a key that attaches a hundred files holds another key's one back by one file at most."""

    def __init__(self):
        self._waiting: dict[str | None, deque] = {}  # per key; the dict's order is whose turn is next
        self._changed = threading.Condition()

    def put(self, owner: str | None, item) -> None:
        with self._changed:
            self._waiting.setdefault(owner, deque()).append(item)
            self._changed.notify()

    def get(self, timeout: float):
        """The next key's oldest item, or None if none came within `timeout` seconds."""
        with self._changed:
            if not self._changed.wait_for(lambda: self._waiting, timeout):
                return None
            owner, items = next(iter(self._waiting.items()))
            item = items.popleft()
            del self._waiting[owner]
            if items:
                self._waiting[owner] = items  # to the back of the turn
            return item


def index_file(
    root: Path, store_id: str, datastore: Path, stored: StoredFile, data: bytes, registry: DatastoreRegistry, jobs: DocumentJobs
) -> tuple[str | None, str | None, int]:
    """(error code, message, 0) where the file could not be indexed; else (None, None, the bytes
    of its text), once the store's new version serves."""
    try:
        documents = documents_of(data, stored.filename)
    except UploadError as e:
        return e.code, str(e), 0
    texts = write_documents(root, store_id, stored.id, documents)
    kind = "add" if (datastore / MANIFEST).exists() else "build"
    paths = [str(datastore), str(texts)] if kind == "add" else [str(texts), "-o", str(datastore)]
    command = [sys.executable, "-m", "index_builder.cli", kind, *paths, "--model", str(registry.model.path), "--quiet"]
    try:
        job = jobs.begin(store_id, kind)
    except KnnlmError as e:
        texts.unlink(missing_ok=True)
        return "server_error", str(e), 0
    run_child_job(jobs, job, registry, str(datastore), lambda: command, lambda: _discard(texts, datastore))
    if job.state == "failed":
        return "server_error", job.error, 0
    return None, None, sum(len(text.encode()) for _, text in documents)


def _discard(texts: Path, datastore: Path) -> None:
    """What a failed build or add of a store's file left: its texts, and the work directory."""
    from index_builder.versions import workdir

    texts.unlink(missing_ok=True)
    shutil.rmtree(workdir(datastore), ignore_errors=True)
