"""The tenants' keys as the server holds them: read again whenever the keys file changes, matched
in constant time, and each key's requests and tokens per minute.

A keys file that no longer parses (a half-edited file, an unknown datastore) is logged and the
keys read before it stay in force: a typo never opens the server, and never locks every tenant out.
"""

from __future__ import annotations

import hmac
import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass

from knnlm_core.errors import KnnlmError
from knnlm_core.keys_file import KeysFile, TenantKey, key_hash, load_keys_file

logger = logging.getLogger("knnlm_serve")

WINDOW_S = 60.0


class AuthError(Exception):
    """A request without a usable key: a 401 whose message never shows the key or its hash.
    `reason` is for the audit log and metrics."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


class Keyring:
    def __init__(self, path: str, known_datastores: Callable[[], Collection[str]]):
        self.path, self._known = path, known_datastores
        self._lock = threading.Lock()
        self._signature = self._stat()
        self._keys = load_keys_file(path, known_datastores())  # at startup a bad file stops the server

    def _stat(self) -> tuple | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def keys(self) -> KeysFile:
        """The keys in force, read again if the file changed since."""
        signature = self._stat()
        if signature == self._signature:
            return self._keys
        with self._lock:
            if signature != self._signature:
                self._signature = signature
                try:
                    self._keys = load_keys_file(self.path, self._known())
                    logger.info("knn.keys_file %s read again: %d key(s)", self.path, len(self._keys.keys))
                except KnnlmError as e:
                    logger.error("%s; the %d key(s) read before stay in force until the file is fixed", e, len(self._keys.keys))
        return self._keys

    def authenticate(self, headers: list[tuple[bytes, bytes]]) -> TenantKey:
        """The key the request's one `Authorization: Bearer <key>` header names."""
        values = [v for k, v in headers if k.lower() == b"authorization"]
        if not values:
            form = " (it sent X-Api-Key; this server reads Authorization)" if any(k.lower() == b"x-api-key" for k, _ in headers) else ""
            raise AuthError(f"no API key given{form}: send it as the header `Authorization: Bearer <key>`", "missing")
        if len(values) > 1:
            raise AuthError(
                "the Authorization header was sent more than once: send the key once, as `Authorization: Bearer <key>`", "twice"
            )
        scheme, _, secret = values[0].decode("latin-1").strip().partition(" ")
        if scheme.lower() != "bearer" or not secret.strip():
            raise AuthError("the Authorization header is not of the form `Bearer <key>`", "form")
        digest = key_hash(secret.strip()).encode()
        found = None
        for key in self.keys().keys:  # every key compared, in constant time each: no early exit
            if hmac.compare_digest(digest, key.sha256.encode()):
                found = key
        if found is None:
            raise AuthError("Incorrect API key provided: it is not one of this server's keys", "unknown")
        if found.expired():
            raise AuthError("the API key has expired: ask for a new one", "expired")
        return found


@dataclass
class _Window:
    requests: deque  # times
    tokens: deque  # (time, tokens)


class RateLimits:
    """Each key's requests and tokens over the last 60 s (a sliding window)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()
        self._windows: dict[str, _Window] = {}

    def admit(self, key: TenantKey) -> tuple[str, float] | None:
        """None, and the request counted; or the limit it is past and the seconds until it is not."""
        if key.requests_per_minute is None and key.tokens_per_minute is None:
            return None
        now = self._clock()
        with self._lock:
            window = self._windows.setdefault(key.id, _Window(deque(), deque()))
            while window.requests and window.requests[0] <= now - WINDOW_S:
                window.requests.popleft()
            while window.tokens and window.tokens[0][0] <= now - WINDOW_S:
                window.tokens.popleft()
            if key.requests_per_minute is not None and len(window.requests) >= key.requests_per_minute:
                return "requests_per_minute", window.requests[len(window.requests) - key.requests_per_minute] + WINDOW_S - now
            used = sum(n for _, n in window.tokens)
            if key.tokens_per_minute is not None and used >= key.tokens_per_minute:
                over, wait = used - key.tokens_per_minute, 0.0
                for at, n in window.tokens:  # until enough of them have left the window
                    over -= n
                    wait = at + WINDOW_S - now
                    if over < 0:
                        break
                return "tokens_per_minute", wait
            window.requests.append(now)
            return None

    def charge(self, key: TenantKey, tokens: int) -> None:
        if key.tokens_per_minute is None or tokens <= 0:
            return
        with self._lock:
            self._windows.setdefault(key.id, _Window(deque(), deque())).tokens.append((self._clock(), tokens))


def retry_after(seconds: float) -> str:
    """The Retry-After header's whole seconds, at least 1."""
    return str(max(1, math.ceil(seconds)))
