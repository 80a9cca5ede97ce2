"""Fail open: an error in kNN's per-step path costs the affected rows their kNN, never the engine.

vLLM calls our code inside its step (the mix in `compute_logits`, `key_ready` mid-forward, the
datastore drafter's `propose`) and through worker RPCs; an exception that escapes any of them
stops vLLM's engine core, and every request after it fails. Each of those boundaries hands the
error to `Faults.failed`, and the rows it concerned are served from the LM alone, exactly as with
kNN off. Each cause is logged once with its traceback and every affected row is counted
(`knnlm_fallbacks_total{reason="error"}`). A datastore version that fails `UNHEALTHY_AFTER`
steps in a row is stopped: its requests are served LM-only, without trying it again, until it is
reloaded (a new version), and the registry reports it unhealthy.

With `knn.fail_open: false` (the test suite's setting) the error propagates instead, so that a
bug shows as a failed test rather than as quietly LM-only answers.
"""

from __future__ import annotations

import logging
import traceback

from knnlm_serve import metrics

logger = logging.getLogger("knnlm_serve")

UNHEALTHY_AFTER = 3  # consecutive failed steps that stop a datastore version
Version = tuple[str, int]


class Faults:
    def __init__(self) -> None:
        self.fail_open = True  # set from the runtime when the worker is attached
        self.unhealthy: dict[Version, str] = {}  # stopped versions -> the error that stopped them
        self._streak: dict[Version, int] = {}
        self._logged: set[tuple[str, str, str]] = set()

    def failed(self, where: str, error: Exception, rows: int, version: Version | None = None) -> None:
        """Serve the `rows` LM-only for `error`, raised in `where` (for `version`, when one
        datastore version's work failed); re-raise it when fail-open is off."""
        if not self.fail_open:
            raise error
        frame = traceback.extract_tb(error.__traceback__)[-1] if error.__traceback__ else None
        cause = (where, type(error).__name__, f"{frame.filename}:{frame.lineno}" if frame else "")
        if cause not in self._logged:
            self._logged.add(cause)
            logger.error("kNN failed in %s; serving the affected rows LM-only (logged once per cause)", where, exc_info=error)
        metrics.child(metrics.FALLBACKS, metrics.datastore_label(version[0]) if version else "", "error").inc(rows)
        if version is None:
            return
        self._streak[version] = self._streak.get(version, 0) + 1
        if self._streak[version] >= UNHEALTHY_AFTER and version not in self.unhealthy:
            self.unhealthy[version] = f"{type(error).__name__}: {error}"
            logger.error(
                "datastore %s version %d failed %d steps in a row: its requests are served LM-only until it is reloaded",
                *version,
                UNHEALTHY_AFTER,
            )

    def succeeded(self, version: Version) -> None:
        self._streak.pop(version, None)

    def release(self, keep: set[Version]) -> None:
        """Forget versions that no longer serve."""
        self.unhealthy = {v: e for v, e in self.unhealthy.items() if v in keep}
        self._streak = {v: n for v, n in self._streak.items() if v in keep}
