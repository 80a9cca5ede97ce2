"""The tenants' audit log (`knn.audit_log`): one JSON line per request that read a datastore or
was refused one, with the real reason of a refusal even where the client saw "unknown".

Fields: time (UTC, ISO 8601), request_id (the client's X-Request-Id, else a new one), key_id
(null: no usable key), method, route, datastore, documents (each {document, id, as}: `whole`,
`snippet` or `passage`), decision (`allowed` / `denied`), reason (a denial's), status, created
(the id of a file or vector store the request made). Every request to the Files and Vector
Stores API is written (its route names the ids it touched).
"""

from __future__ import annotations

import json
import logging
import threading
import uuid
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone

logger = logging.getLogger("knnlm_serve")

SCOPE_KEY = "knnlm.audit"
OBJECT_ROUTES = ("/v1/files", "/v1/vector_stores")


@dataclass
class AuditRecord:
    request_id: str
    method: str
    route: str
    key_id: str | None = None
    datastore: str | None = None
    documents: list[dict] = field(default_factory=list)
    decision: str = "allowed"
    reason: str | None = None
    status: int | None = None
    created: str | None = None

    @classmethod
    def of(cls, scope) -> AuditRecord:
        given = next((v.decode("latin-1") for k, v in scope["headers"] if k.lower() == b"x-request-id"), None)
        return cls(request_id=(given or uuid.uuid4().hex)[:128], method=scope["method"], route=scope["path"])

    def reading(self, datastore: str) -> None:
        self.datastore = datastore

    def returned(self, documents: list[dict], shown_as: str) -> None:
        """`documents`: {document, id} of what the response shows, `shown_as` whole, snippet or passage."""
        seen = {(d["document"], d["as"]) for d in self.documents}
        for d in documents:
            if (d["document"], shown_as) not in seen:
                seen.add((d["document"], shown_as))
                self.documents.append({"document": d["document"], "id": d.get("id"), "as": shown_as})

    def denied(self, reason: str, datastore: str | None = None) -> None:
        self.decision, self.reason = "denied", reason
        self.datastore = datastore if datastore is not None else self.datastore

    @property
    def worth_writing(self) -> bool:
        return self.datastore is not None or self.decision == "denied" or self.route.startswith(OBJECT_ROUTES)


def record_of(scope) -> AuditRecord | None:
    """The request's audit record, where the server has tenants."""
    return scope.get(SCOPE_KEY)


class AuditLog:
    """Appends lines to the file; a write that fails is logged, and the request is served."""

    def __init__(self, path: str | None):
        self.path = path
        self._lock = threading.Lock()

    def write(self, record: AuditRecord) -> None:
        if self.path is None or not record.worth_writing:
            return
        line = json.dumps({"time": datetime.now(timezone.utc).isoformat(timespec="milliseconds"), **asdict(record)})
        try:
            with self._lock, open(self.path, "a") as f:
                f.write(line + "\n")
        except OSError as e:
            logger.error("could not write knn.audit_log %s: %s", self.path, e)
