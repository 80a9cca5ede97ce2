"""Uploaded files (OpenAI's Files API), kept below `knn.datastore_root` in `.knnlm-files/`.

A file is its bytes (`<id>.data`) and a record (`<id>.json`: name, purpose, size, owner). Its
owner is the key that uploaded it (None without keys): another key is answered exactly as for
an id that does not exist. Deleting a file removes both; the vector stores it was in forget it
first (knnlm_serve/server/vector_stores.py), so no copy of its text stays below the root.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from pathlib import Path

from knnlm_core.config.serve import FilesConfig
from knnlm_core.errors import ErrorKind, KnnlmError
from knnlm_core.uploads import UploadError, check_upload
from knnlm_core.vector_store_records import FILES, StoredFile, expired, write_file

logger = logging.getLogger(__name__)

PURPOSES = ("assistants", "user_data")


def unknown_file(file_id: str, param: str = "file_id") -> KnnlmError:
    """The answer for a file id that does not exist, or is another key's."""
    return KnnlmError(f"No file found with id {file_id!r}.", ErrorKind.NOT_FOUND, param)


class FileStore:
    """The uploaded files of a server, on disk; safe to share between threads."""

    def __init__(self, root: Path, limits: FilesConfig):
        self.folder = root / FILES
        self.folder.mkdir(parents=True, exist_ok=True)
        self.limits = limits
        self._lock = threading.Lock()
        self._files: dict[str, StoredFile] = {}
        self._keep(sorted(self.folder.glob("*.json")))

    def adopt(self, file_ids: list[str]) -> None:
        """Keep the records `knnlm-index vector-store` wrote while the server ran."""
        with self._lock:
            self._keep([self.folder / f"{i}.json" for i in file_ids if i not in self._files and (self.folder / f"{i}.json").exists()])

    def _keep(self, records: list[Path]) -> None:
        for record in records:
            try:
                stored = StoredFile(**json.loads(record.read_text()))
            except (OSError, ValueError, TypeError) as e:
                logger.warning("%s: not a file record (%s); left as it is", record, e)
                continue
            if (self.folder / f"{stored.id}.data").exists():
                self._files[stored.id] = stored

    def create(self, owner: str | None, filename: str, purpose: str, data: bytes, expires_after: dict | None = None) -> StoredFile:
        """Keep an upload, checked: a purpose we take, text we can read, within the size limits."""
        if purpose not in PURPOSES:
            raise KnnlmError(
                f"purpose {purpose!r} is not one this server takes: use one of {list(PURPOSES)}", ErrorKind.MALFORMED, "purpose"
            )
        if len(data) > self.limits.max_file_bytes:
            raise KnnlmError(
                f"the file holds {len(data):,} bytes, more than the {self.limits.max_file_bytes:,} of knn.files.max_file_bytes: "
                "split it into smaller files",
                ErrorKind.TOO_LARGE,
                "file",
            )
        try:
            check_upload(data, filename)
        except UploadError as e:
            raise KnnlmError(f"{e}: upload a text file (.txt, .md, .rst, .html, .json, .jsonl)", ErrorKind.MALFORMED, "file") from None
        created = int(time.time())
        stored = StoredFile(
            id=f"file-{secrets.token_hex(12)}",
            owner=owner,
            filename=filename,
            purpose=purpose,
            bytes=len(data),
            created_at=created,
            expires_at=expiry(expires_after, created),
        )
        with self._lock:
            held = sum(f.bytes for f in self._files.values() if f.owner == owner)
            if held + len(data) > self.limits.max_bytes_per_key:
                raise KnnlmError(
                    f"this key holds {held:,} bytes of files; {len(data):,} more would pass the {self.limits.max_bytes_per_key:,} "
                    "of knn.files.max_bytes_per_key: delete files first",
                    ErrorKind.TOO_LARGE,
                    "file",
                )
            try:
                write_file(self.folder, stored, data)
            except OSError as e:
                raise KnnlmError(f"could not keep the file below knn.datastore_root: {e}", ErrorKind.UNAVAILABLE) from None
            self._files[stored.id] = stored
        return stored

    def get(self, owner: str | None, file_id: str, param: str = "file_id") -> StoredFile:
        stored = self._files.get(file_id)
        if stored is None or stored.owner != owner or expired(stored.expires_at):
            raise unknown_file(file_id, param)
        return stored

    def by_id(self, file_id: str) -> StoredFile | None:
        """The file, whoever owns it (for the server's own work on it)."""
        return self._files.get(file_id)

    def owned(self, owner: str | None) -> list[StoredFile]:
        """The owner's files, oldest first."""
        return sorted((f for f in self._files.values() if f.owner == owner and not expired(f.expires_at)), key=_age)

    def content(self, stored: StoredFile) -> bytes:
        return (self.folder / f"{stored.id}.data").read_bytes()

    def delete(self, stored: StoredFile) -> None:
        """Remove the file's bytes, then its record (a crash between leaves a record with no data, dropped at the next start)."""
        with self._lock:
            self._files.pop(stored.id, None)
            (self.folder / f"{stored.id}.data").unlink(missing_ok=True)
            (self.folder / f"{stored.id}.json").unlink(missing_ok=True)

    def expired_files(self) -> list[StoredFile]:
        return [f for f in self._files.values() if expired(f.expires_at)]


def _age(stored) -> tuple:
    return stored.created_at, stored.id


def expiry(expires_after: dict | None, since: int) -> int | None:
    """When a file with OpenAI's `expires_after` ({anchor: created_at, seconds}) expires."""
    if expires_after is None:
        return None
    seconds = expires_after.get("seconds") if isinstance(expires_after, dict) else None
    if expires_after.get("anchor", "created_at") != "created_at" or not isinstance(seconds, int) or not 3600 <= seconds <= 30 * 86400:
        raise KnnlmError(
            "expires_after must be {anchor: created_at, seconds: 3600 (1 hour) to 2592000 (30 days)}", ErrorKind.MALFORMED, "expires_after"
        )
    return since + seconds
