"""The server's own copies of texts sent to an add: `<knn.datastore_root>/.knnlm-added/<name>/*.jsonl`.

An add through the admin API keeps the texts it was sent as one .jsonl file (a record a line), the
source the new documents' provenance names, so the datastore can be rebuilt from its sources.
These files are the server's, not the user's: a forget erases its documents' records from them
(`erase_records`: the line is blanked, so the other records keep the line numbers provenance names
them by; a file with no record left is removed), and `orphaned_records` finds what no serving
version names (a refused, failed or killed add; a forget interrupted before it erased).
Documents added from the user's own files are never touched.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from knnlm_core.files import write_text_atomic
from knnlm_core.provenance import DocumentTable

logger = logging.getLogger(__name__)

ADDED_TEXTS = ".knnlm-added"


def is_server_copy(path: str | Path) -> bool:
    """Whether `path` is a texts file the server wrote (below a `.knnlm-added` folder)."""
    return ADDED_TEXTS in Path(path).parts


def erase_records(path: Path, lines: set[int]) -> bool:
    """Blank the 1-based `lines` of the .jsonl file at `path`, atomically; remove the file when no
    record is left. False when there was nothing to erase (no such file, the lines already blank)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return False
    rows = text.splitlines()
    erased = [n for n in lines if 0 < n <= len(rows) and rows[n - 1].strip()]
    for n in erased:
        rows[n - 1] = ""
    if not erased:
        return False
    if any(row.strip() for row in rows):
        write_text_atomic(path, "".join(row + "\n" for row in rows))
    else:
        os.unlink(path)
    return True


def served_records(table: DocumentTable, forgotten: set[int]) -> dict[str, set[int]]:
    """Each source file of the table (resolved path) -> the .jsonl lines of its documents that serve."""
    served: dict[str, set[int]] = {}
    for d in range(len(table)):
        lines = served.setdefault(str(Path(table.root, table.sources[table.source[d]]).resolve()), set())
        if d not in forgotten and table.line[d] is not None:
            lines.add(table.line[d])
    return served


def orphaned_records(folder: Path, named: dict[str, set[int]]) -> tuple[list[Path], dict[Path, set[int]]]:
    """What of `folder`'s texts files no serving version needs, given `named`: each file the serving
    version's provenance names (its path) -> the lines of its documents that are served. Returns the
    files it does not name, and per named file the non-blank lines it does not serve (forgotten)."""
    unnamed, stale = [], {}
    for path in sorted(folder.glob("*.jsonl")) if folder.is_dir() else []:
        served = named.get(str(path.resolve()))
        if served is None:
            unnamed.append(path)
            continue
        rows = path.read_text().splitlines()
        extra = {n for n, row in enumerate(rows, 1) if row.strip() and n not in served}
        if extra:
            stale[path] = extra
    return unnamed, stale
