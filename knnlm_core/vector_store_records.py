"""Uploaded files and vector stores as they are kept below `knn.datastore_root`, and shown as
OpenAI's objects: written by the server (knnlm_serve/server/vector_stores.py) and by
`knnlm-index vector-store` (index_builder/vector_store.py), read by the server at its start.

    .knnlm-files/<file id>.data, .json          an upload's bytes and its record (StoredFile)
    .knnlm-vector-stores/<store id>/store.json  a store's record (VectorStore)
    .knnlm-vector-stores/<store id>/datastore/  its datastore
    .knnlm-added/<store id>/<file id>.jsonl     the file's documents, as its datastore's provenance names them
"""

from __future__ import annotations

import json
import os
import secrets
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from knnlm_core.added_texts import ADDED_TEXTS
from knnlm_core.files import write_json_atomic, write_text_atomic
from knnlm_core.passages import MIN_TAIL_TOKENS, PASSAGE_TOKENS

DAY = 86400
FILES = ".knnlm-files"
VECTOR_STORES = ".knnlm-vector-stores"
STORE_ID_PREFIX = "vs_"  # a vector store's id, and the name its datastore is served under

# How a store cuts every file into passages, as OpenAI's `static` strategy says it: PASSAGE_TOKENS
# tokens of the served model's, without overlap, a document's last passage up to MIN_TAIL_TOKENS - 1 longer.
PASSAGE_CHUNKING = {
    "type": "static",
    "static": {"max_chunk_size_tokens": PASSAGE_TOKENS + MIN_TAIL_TOKENS - 1, "chunk_overlap_tokens": 0},
}


def new_store_id() -> str:
    return f"{STORE_ID_PREFIX}{secrets.token_hex(12)}"


def is_vector_store(name: str) -> bool:
    return name.startswith(STORE_ID_PREFIX)


@dataclass(frozen=True)
class StoredFile:
    id: str
    owner: str | None
    filename: str
    purpose: str
    bytes: int
    created_at: int
    expires_at: int | None = None

    def public(self) -> dict:
        """OpenAI's file object."""
        fields = {k: v for k, v in asdict(self).items() if k != "owner"}
        return {**fields, "object": "file", "status": "processed", "status_details": None}


@dataclass
class StoreFile:
    id: str  # the file's own id, as OpenAI's client expects
    created_at: int
    attributes: dict = field(default_factory=dict)
    chunking_strategy: dict = field(default_factory=lambda: {"type": "auto"})  # as asked; `public` says what is done
    status: str = "in_progress"  # in_progress, completed, failed, cancelled
    last_error: dict | None = None  # {code: unsupported_file | invalid_file | server_error, message}
    usage_bytes: int = 0

    def public(self, store_id: str) -> dict:
        """OpenAI's vector store file object. Its `chunking_strategy` is how the store cuts every
        file, whatever was asked: OpenAI's answer is always static sizes (or `other`), never `auto`."""
        return {**asdict(self), "chunking_strategy": PASSAGE_CHUNKING, "object": "vector_store.file", "vector_store_id": store_id}


@dataclass
class VectorStore:
    id: str
    owner: str | None
    name: str | None
    created_at: int
    last_active_at: int
    metadata: dict = field(default_factory=dict)
    expires_after: dict | None = None  # {anchor: last_active_at, days}
    files: dict[str, StoreFile] = field(default_factory=dict)
    batches: dict[str, dict] = field(default_factory=dict)  # batch id -> {file_ids, created_at}

    @property
    def expires_at(self) -> int | None:
        return None if self.expires_after is None else self.last_active_at + DAY * self.expires_after["days"]

    def counts(self, ids=None) -> dict:
        chosen = [self.files[i] for i in (self.files if ids is None else ids) if i in self.files]
        counts = {s: sum(f.status == s for f in chosen) for s in ("in_progress", "completed", "failed", "cancelled")}
        return {**counts, "total": len(chosen)}

    def public(self) -> dict:
        counts = self.counts()
        return {
            "id": self.id,
            "object": "vector_store",
            "created_at": self.created_at,
            "name": self.name,
            "usage_bytes": sum(f.usage_bytes for f in self.files.values()),
            "file_counts": counts,
            "status": "expired" if expired(self.expires_at) else "in_progress" if counts["in_progress"] else "completed",
            "expires_after": self.expires_after,
            "expires_at": self.expires_at,
            "last_active_at": self.last_active_at,
            "metadata": self.metadata,
        }


def expired(at: int | None) -> bool:
    return at is not None and time.time() >= at


def write_file(folder: Path, stored: StoredFile, data: bytes) -> None:
    """An upload's bytes, then its record (a record is only ever beside its data)."""
    data_path = folder / f"{stored.id}.data"
    tmp = data_path.with_name(f".{data_path.name}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, data_path)
        write_json_atomic(folder / f"{stored.id}.json", asdict(stored))
    except OSError:
        for path in (data_path, tmp):
            path.unlink(missing_ok=True)
        raise


def save_store(folder: Path, store: VectorStore) -> None:
    """The store's record, `folder` being `<root>/.knnlm-vector-stores`."""
    (folder / store.id).mkdir(parents=True, exist_ok=True)
    write_json_atomic(folder / store.id / "store.json", asdict(store))


def store_texts(root: Path, store_id: str) -> Path:
    """Where a store's documents are kept, one .jsonl a file."""
    return root / ADDED_TEXTS / store_id


def write_documents(root: Path, store_id: str, file_id: str, documents: list[tuple[str | None, str]]) -> Path:
    """A file's documents (id or None, text) as the store's .jsonl for it, each named by its own id or the file's."""
    texts = store_texts(root, store_id) / f"{file_id}.jsonl"
    texts.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(texts, "".join(json.dumps({"id": doc_id or file_id, "text": text}) + "\n" for doc_id, text in documents))
    return texts


def is_store_datastore(path: Path, root: str | None) -> bool:
    """Whether `path` is a vector store's datastore below the datastore root `root`."""
    return root is not None and Path(path).resolve().is_relative_to(Path(root).resolve() / VECTOR_STORES)
