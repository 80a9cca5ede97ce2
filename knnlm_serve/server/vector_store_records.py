"""A vector store's record, as it is kept in `store.json` and shown as OpenAI's objects."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from knnlm_core.errors import ErrorKind, KnnlmError
from knnlm_serve.server.file_store import expired

DAY = 86400


@dataclass
class StoreFile:
    id: str  # the file's own id, as OpenAI's client expects
    created_at: int
    attributes: dict = field(default_factory=dict)
    chunking_strategy: dict = field(default_factory=lambda: {"type": "auto"})
    status: str = "in_progress"  # in_progress, completed, failed, cancelled
    last_error: dict | None = None  # {code: unsupported_file | invalid_file | server_error, message}
    usage_bytes: int = 0

    def public(self, store_id: str) -> dict:
        return {**asdict(self), "object": "vector_store.file", "vector_store_id": store_id}


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


def unknown_store(store_id: str) -> KnnlmError:
    """The answer for a vector store id that does not exist, or is another key's."""
    return KnnlmError(f"No vector store found with id {store_id!r}.", ErrorKind.NOT_FOUND, "vector_store_id")
