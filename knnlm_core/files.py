"""Atomic file writes and content hashes: a reader never sees half a file."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path


def write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_json_atomic(path: Path, data, indent: int | None = 2) -> None:
    write_text_atomic(path, json.dumps(data, indent=indent))


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()
