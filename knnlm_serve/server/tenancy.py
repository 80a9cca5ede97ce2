"""Tenants at the door (`knn.keys_file`): every request names its key, or is refused before any route sees it.

Installed only where keys are configured, outermost of our middlewares. Open without a key: the
probes (/health, /ping, /version, /load), /metrics and the kNN page's files (it holds no data). The admin routes keep their own token: a
request to them with X-Admin-Token passes here untouched. Everything else, vLLM's routes as much
as ours, needs `Authorization: Bearer <key>` (401 `invalid_api_key` otherwise) and is held to the
key's requests and tokens per minute (429 with Retry-After). The routes then ask `grants.granted`
what the key may do. Each response's `usage` is charged to its key; a stream is asked for its
usage (server/admission.py) and its usage event is dropped again where the client did not ask.
"""

from __future__ import annotations

import json
import logging

from knnlm_serve import metrics
from knnlm_serve.server.audit import SCOPE_KEY as AUDIT_KEY
from knnlm_serve.server.audit import AuditLog, AuditRecord
from knnlm_serve.server.grants import SCOPE_KEY as TENANT_KEY
from knnlm_serve.server.grants import key_label
from knnlm_serve.server.http_errors import error_response
from knnlm_serve.server.keyring import AuthError, Keyring, RateLimits, retry_after

logger = logging.getLogger("knnlm_serve")

OPEN_PATHS = frozenset({"/health", "/ping", "/version", "/load", "/metrics"})
OPEN_PREFIXES = ("/knn/ui",)  # the kNN page's static files (knn.ui): it asks for the key, and sends it with each call
USER_KNN_ROUTES = ("/v1/knn/explain", "/v1/knn/documents/")
HIDE_USAGE = "knnlm.hide_usage"  # set by admission where it asked a stream for the usage its client did not


class TenantMiddleware:
    def __init__(self, app, keyring: Keyring, audit: AuditLog):
        self.app, self.keyring, self.audit = app, keyring, audit
        self.limits = RateLimits()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or scope["path"].startswith(OPEN_PREFIXES) or _to_admin(scope):
            return await self.app(scope, receive, send)
        record = AuditRecord.of(scope)
        try:
            key = self.keyring.authenticate(scope["headers"])
        except AuthError as e:
            record.denied(e.reason)
            return await self._refuse(scope, receive, send, record, None, 401, str(e), "invalid_api_key")
        record.key_id = key.id
        if (limited := self.limits.admit(key)) is not None:
            limit, wait = limited
            record.denied(limit)
            message = f"this key is past its {limit.replace('_', ' ')} (knn.keys_file); retry after the Retry-After header's seconds"
            headers = {"Retry-After": retry_after(wait)}
            return await self._refuse(scope, receive, send, record, key.id, 429, message, "rate_limit_exceeded", headers)
        if (stores := getattr(scope["app"].state, "knnlm_vector_stores", None)) is not None:
            key = stores.granting(key)  # the vector stores it made are its datastores too
        scope[TENANT_KEY], scope[AUDIT_KEY] = key, record
        done = []
        try:
            await self.app(scope, receive, self._charging(scope, send, key, record, done))
        finally:
            if not done:  # no response started (the client left)
                self._done(key, record, done)

    def _done(self, key, record, done: list) -> None:
        """Counted and audited once, as the response starts: the line is written before the client reads a byte."""
        done.append(True)
        metrics.TENANT_REQUESTS.labels(key_label(key.id), record.decision).inc()
        self.audit.write(record)

    async def _refuse(self, scope, receive, send, record, key_id, status, message, code, headers=None):
        record.status = status
        metrics.TENANT_REQUESTS.labels(key_label(key_id), "denied").inc()
        metrics.TENANT_DENIALS.labels(key_label(key_id), record.reason).inc()
        self.audit.write(record)
        response = error_response(status, message, None, "invalid_request_error", code=code)
        response.headers.update(headers or {})
        return await response(scope, receive, send)

    def _charging(self, scope, send, key, record, done: list):
        """`send`, noting the status and charging the usage the response reports to `key`."""
        buffered: list[bytes] = []

        async def sending(message):
            if message["type"] == "http.response.start":
                record.status = message.get("status")
                self._done(key, record, done)
                return await send(message)
            if message["type"] == "http.response.body" and record.status == 200:
                body = message.get("body", b"")
                if body.startswith(b"data: "):
                    body = self._stream_usage(scope, body, key)
                    if not body and message.get("more_body", False):
                        return None  # the usage event its client did not ask for
                    message = {**message, "body": body}
                elif b'"usage"' in body or buffered:
                    buffered.append(body)
                    if not message.get("more_body", False):
                        self._charge(key, _usage(b"".join(buffered)))
            return await send(message)

        return sending

    def _stream_usage(self, scope, body: bytes, key) -> bytes:
        """The stream's events, its usage charged; without the usage event where the client did not ask for it."""
        if b'"usage"' not in body:
            return body
        kept = []
        for event in body.split(b"\n\n"):
            final = event.startswith(b"data: {") and b'"choices":[]' in event  # the totals, after the last token
            if final and (usage := _usage(event[len(b"data: ") :])):
                self._charge(key, usage)
                if scope.get(HIDE_USAGE):
                    continue
            kept.append(event)
        return b"\n\n".join(kept)

    def _charge(self, key, usage: dict | None) -> None:
        tokens = (usage or {}).get("total_tokens")
        if isinstance(tokens, int) and tokens > 0:
            self.limits.charge(key, tokens)
            metrics.TENANT_TOKENS.labels(key_label(key.id)).inc(tokens)


def _to_admin(scope) -> bool:
    """An admin route's request, with the admin token's header: the route checks the token."""
    path = scope["path"]
    if not path.startswith("/v1/knn/") or path.startswith(USER_KNN_ROUTES):
        return False
    return any(k.lower() == b"x-admin-token" for k, _ in scope["headers"])


def _usage(body: bytes) -> dict | None:
    try:
        usage = json.loads(body).get("usage")
    except (ValueError, AttributeError):
        return None
    return usage if isinstance(usage, dict) else None
