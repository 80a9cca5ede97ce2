"""The `vllm.general_plugins` entry point, run by vLLM in each of its processes.

Inert unless a kNN configuration is given, so plain vLLM use on the same environment is
unaffected.
"""

from __future__ import annotations

import os

CONFIG_ENV = "KNNLM_SERVE_CONFIG"


def register() -> None:
    if not os.environ.get(CONFIG_ENV):
        return
