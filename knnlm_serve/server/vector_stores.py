"""Vector stores (OpenAI's Vector Stores API), each a kNN datastore owned by the key that made it.

A store lives in `<knn.datastore_root>/.knnlm-vector-stores/<id>/`: its record (`store.json`)
and, once a file is in it, its datastore (`datastore/`), served under the store's id as its
name, so `knn_datastore: "vs_..."` works wherever a datastore is named. Attaching a file queues
it for the one worker thread, which indexes files one at a time, each key's in turn
(knnlm_serve/server/store_indexing.py); the file's status is `in_progress` until its version
serves. Detaching forgets its documents with erase (the server's copy goes with them); the last
file's detach, or the store's deletion, removes the datastore. A store that `knnlm-index
vector-store` builds below the root while the server runs is taken in when a request names or
lists stores, or at the next sweep. Another key is answered as for an id that does not exist.
"""

from __future__ import annotations

import json
import logging
import secrets
import shutil
import threading
import time
from pathlib import Path

from knnlm_core.config.serve import FilesConfig
from knnlm_core.datastore import read_manifest
from knnlm_core.errors import ErrorKind, KnnlmError
from knnlm_core.manifest import MANIFEST
from knnlm_core.provenance import DocumentTable
from knnlm_core.vector_store_records import (
    VECTOR_STORES,
    StoreFile,
    VectorStore,
    expired,
    new_store_id,
    save_store,
    store_texts,
)
from knnlm_serve.server.document_jobs import DocumentJobs
from knnlm_serve.server.file_store import FileStore, StoredFile
from knnlm_serve.server.registry import DatastoreRegistry
from knnlm_serve.server.store_indexing import KeyTurns, index_file

logger = logging.getLogger(__name__)

SWEEP_S = 60.0  # how often stores built offline are taken in, and expired stores and files deleted


def unknown_store(store_id: str) -> KnnlmError:
    """The answer for a vector store id that does not exist, or is another key's."""
    return KnnlmError(f"No vector store found with id {store_id!r}.", ErrorKind.NOT_FOUND, "vector_store_id")


class VectorStores:
    """A server's vector stores; safe to share between threads."""

    def __init__(self, registry: DatastoreRegistry, jobs: DocumentJobs, limits: FilesConfig):
        self.root = Path(registry.config.datastore_root).expanduser().resolve()
        self.folder = self.root / VECTOR_STORES
        self.folder.mkdir(parents=True, exist_ok=True)
        self.registry, self.jobs, self.files, self.limits = registry, jobs, FileStore(self.root, limits), limits
        self._lock = threading.RLock()  # the records
        self._writing: dict[str, threading.Lock] = {}  # per store: its datastore's versions
        self._queue = KeyTurns()  # (store id, file id)
        self.stores: dict[str, VectorStore] = {}
        self._unreadable: set[Path] = set()  # records warned of once
        self._read_new()

    def load(self) -> None:
        """Serve the stores' datastores (before the added texts are swept: theirs are named by them)."""
        for store in self.stores.values():
            self._serve(store)

    def adopt(self) -> None:
        """Serve the stores `knnlm-index vector-store` built below the root while the server ran
        (it writes a store's record last, once its files and datastore are in place)."""
        for store in self._read_new():
            self._serve(store)
            logger.info("vector store %s (%s): built offline, now served", store.id, store.name or "no name")

    def _read_new(self) -> list[VectorStore]:
        with self._lock:
            new = []
            for record in sorted(self.folder.glob("*/store.json")):
                if record.parent.name in self.stores or record in self._unreadable:
                    continue
                try:
                    store = VectorStore(**json.loads(record.read_text()))
                    store.files = {i: StoreFile(**f) for i, f in store.files.items()}
                except (OSError, ValueError, TypeError) as e:
                    logger.warning("%s: not a vector store record (%s); left as it is", record, e)
                    self._unreadable.add(record)
                    continue
                self.files.adopt(list(store.files))
                self.stores[store.id] = store
                new.append(store)
            return new

    def _serve(self, store: VectorStore) -> None:
        if (self.datastore(store.id) / MANIFEST).exists():
            try:
                self.registry.load(store.id, self.datastore(store.id))
            except KnnlmError as e:
                logger.warning("vector store %s: its datastore does not load: %s", store.id, e)

    def start(self) -> None:
        """Attach what a stop left in progress, and start the worker."""
        for store in self.stores.values():
            for entry in store.files.values():
                if entry.status == "in_progress":
                    self._queue.put(store.owner, (store.id, entry.id))
        threading.Thread(target=self._work, name="knnlm-vector-stores", daemon=True).start()

    def datastore(self, store_id: str) -> Path:
        return self.folder / store_id / "datastore"

    def texts(self, store_id: str) -> Path:
        return store_texts(self.root, store_id)

    # --- records -------------------------------------------------------------------------------

    def create(self, owner: str | None, name: str | None, metadata: dict, expires_after: dict | None) -> VectorStore:
        with self._lock:
            if sum(s.owner == owner for s in self.stores.values()) >= self.limits.max_vector_stores_per_key:
                raise KnnlmError(
                    f"this key holds {self.limits.max_vector_stores_per_key} vector stores, the most knn.files.max_vector_stores_per_key "
                    "allows: delete one first",
                    ErrorKind.TOO_LARGE,
                )
            now = int(time.time())
            store = VectorStore(new_store_id(), owner, name, now, now, metadata, expires_after)
            self.stores[store.id] = store
            self._save(store)
            return store

    def granting(self, key):
        """The tenant's key with its own serving vector stores granted, every right on each."""
        mine = {s.id: ["generate", "explain", "documents"] for s in self.stores.values() if s.owner == key.id}
        served = self.registry.runtime.datastores
        return key.model_copy(update={"datastores": {**key.datastores, **{n: r for n, r in mine.items() if n in served}}})

    def get(self, owner: str | None, store_id: str) -> VectorStore:
        if store_id not in self.stores:
            self.adopt()
        store = self.stores.get(store_id)
        if store is None or store.owner != owner:
            raise unknown_store(store_id)
        return store

    def owned(self, owner: str | None) -> list[VectorStore]:
        self.adopt()
        return sorted((s for s in self.stores.values() if s.owner == owner), key=lambda s: (s.created_at, s.id))

    def modify(self, store: VectorStore, update: dict) -> VectorStore:
        with self._lock:
            for key, value in update.items():
                setattr(store, key, value)
            store.last_active_at = int(time.time())
            self._save(store)
        return store

    def attach(self, store: VectorStore, stored: StoredFile, attributes: dict, chunking: dict) -> StoreFile:
        """The file, queued to become the store's documents (as it is where it is in the store already)."""
        with self._lock:
            if stored.id in store.files:
                return store.files[stored.id]
            entry = StoreFile(stored.id, int(time.time()), attributes, chunking)
            store.files[entry.id] = entry
            store.last_active_at = entry.created_at
            self._save(store)
        self._queue.put(store.owner, (store.id, entry.id))
        return entry

    def batch(self, store: VectorStore, files: list[tuple[StoredFile, dict]], chunking: dict) -> str:
        """A batch of (file, its attributes), each attached."""
        batch = f"vsfb_{secrets.token_hex(12)}"
        with self._lock:
            store.batches[batch] = {"file_ids": [f.id for f, _ in files], "created_at": int(time.time())}
            self._save(store)
        for stored, attributes in files:
            self.attach(store, stored, attributes, chunking)
        return batch

    def detach(self, store: VectorStore, file_id: str) -> None:
        """Forget the file's documents with erase (the datastore itself where nothing else is in it).
        Waits for the store's running build or add, if any."""
        with self._writing_lock(store.id):
            with self._lock:
                entry = store.files.pop(file_id, None)
                if entry is None:
                    raise KnnlmError(f"No file found with id {file_id!r} in vector store {store.id!r}.", ErrorKind.NOT_FOUND, "file_id")
                self._save(store)
            if entry.status == "completed":
                self._forget(store, f"{file_id}.jsonl")
            (self.texts(store.id) / f"{file_id}.jsonl").unlink(missing_ok=True)

    def delete(self, store: VectorStore) -> None:
        with self._writing_lock(store.id):
            self._drop_datastore(store.id)
            with self._lock:  # its record goes with it, or adopt() would take it for a new one
                shutil.rmtree(self.folder / store.id, ignore_errors=True)
                self.stores.pop(store.id, None)
        with self._lock:
            self._writing.pop(store.id, None)  # a store's lock lives as long as the store

    def delete_file(self, owner: str | None, stored: StoredFile) -> None:
        """Detach the file from every store of its owner, then delete it."""
        for store in self.owned(owner):
            if stored.id in store.files:
                self.detach(store, stored.id)
        self.files.delete(stored)

    def expire(self) -> None:
        """Delete the stores and files whose `expires_after` has passed."""
        for store in [s for s in list(self.stores.values()) if expired(s.expires_at)]:
            self.delete(store)
        for stored in self.files.expired_files():
            self.delete_file(stored.owner, stored)

    # --- the worker ----------------------------------------------------------------------------

    def _work(self) -> None:
        next_sweep = 0.0
        while True:
            item = self._queue.get(timeout=SWEEP_S)
            if time.monotonic() >= next_sweep:
                self._safely(self.adopt)
                self._safely(self.expire)
                next_sweep = time.monotonic() + SWEEP_S
            if item is not None:
                self._safely(self._index, *item)

    def _safely(self, step, *args) -> None:
        try:
            step(*args)
        except Exception:  # noqa: BLE001 - the worker outlives one file's failure
            logger.exception("vector stores: a step failed")

    def _index(self, store_id: str, file_id: str) -> None:
        with self._writing_lock(store_id):
            store = self.stores.get(store_id)
            entry = store.files.get(file_id) if store is not None else None
            stored = self.files.by_id(file_id)
            if entry is None or entry.status != "in_progress":  # detached, or its store deleted, meanwhile
                return
            if stored is None:
                return self._finish(store, entry, "server_error", f"file {file_id} was deleted before it was indexed")
            data = self.files.content(stored)
            self._finish(store, entry, *index_file(self.root, store_id, self.datastore(store_id), stored, data, self.registry, self.jobs))

    def _finish(self, store: VectorStore, entry: StoreFile, code: str | None, message: str | None, usage: int = 0) -> None:
        with self._lock:
            entry.status = "failed" if code else "completed"
            entry.last_error = {"code": code, "message": self.registry.public(message)} if code else None
            entry.usage_bytes = usage
            if code:
                logger.info("vector store %s: file %s failed (%s): %s", store.id, entry.id, code, message)
            if store.id in self.stores:
                self._save(store)

    # --- datastore versions --------------------------------------------------------------------

    def _forget(self, store: VectorStore, source: str) -> None:
        from index_builder.forget import forget_documents

        path = self.datastore(store.id)
        manifest = read_manifest(path)
        table = DocumentTable.read(path / manifest.provenance.path)
        forgotten = {r.document for r in manifest.forgotten}
        if all(table.sources[table.source[d]] == source for d in range(len(table)) if d not in forgotten):
            return self._drop_datastore(store.id)
        forget_documents(path, sources=[source], erase=True)
        self.registry.load(store.id, path, keep_actors=True)

    def _drop_datastore(self, store_id: str) -> None:
        if store_id in self.registry.runtime.datastores:
            self.registry.unload(store_id)
        shutil.rmtree(self.datastore(store_id), ignore_errors=True)
        shutil.rmtree(self.texts(store_id), ignore_errors=True)

    def _writing_lock(self, store_id: str) -> threading.Lock:
        with self._lock:
            return self._writing.setdefault(store_id, threading.Lock())

    def _save(self, store: VectorStore) -> None:
        save_store(self.folder, store)
