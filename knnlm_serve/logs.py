"""Where our log lines go in every process we run in: stderr, prefixed `knnlm-serve:`."""

from __future__ import annotations

import logging

PACKAGES = ("knnlm_serve", "knnlm_core", "index_builder")


def log_to_stderr() -> None:
    """Our loggers write INFO and above to stderr with a handler of their own, whatever the
    process's root logger is set to (in vLLM's API server an import raises it to ERROR)."""
    for name in PACKAGES:
        logger = logging.getLogger(name)
        if not logger.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("knnlm-serve: %(message)s"))
            logger.addHandler(handler)
            logger.setLevel(logging.INFO)
            logger.propagate = False
