"""Reading a corpus: files and directories of .txt/.md/.rst/.jsonl, optionally gzipped.

A text file is one document; each line of a .jsonl file is one document (its `text_field`).
"""

from __future__ import annotations

import gzip
import json
import warnings
from collections.abc import Iterator
from pathlib import Path

TEXT_SUFFIXES = (".txt", ".md", ".rst")
JSONL_SUFFIXES = (".jsonl",)


class CorpusError(ValueError):
    """An input that cannot be read as asked; the message names the file and the fix."""


def _suffix(path: Path) -> str:
    name = path.name.lower()
    return Path(name[: -len(".gz")]).suffix if name.endswith(".gz") else path.suffix.lower()


def _supported(path: Path) -> bool:
    return _suffix(path) in TEXT_SUFFIXES + JSONL_SUFFIXES


def find_files(inputs: list[str | Path]) -> list[Path]:
    """Expand files and directories into a sorted, de-duplicated list of supported files."""
    found: list[Path] = []
    for item in map(Path, inputs):
        if not item.exists():
            raise CorpusError(f"corpus path {item} does not exist")
        if item.is_dir():
            found.extend(p for p in sorted(item.rglob("*")) if p.is_file() and _supported(p))
        elif _supported(item):
            found.append(item)
        else:
            raise CorpusError(
                f"{item}: unsupported file type; use .txt, .md, .rst or .jsonl (optionally .gz)"
            )
    files = list(dict.fromkeys(p.resolve() for p in found))
    if not files:
        raise CorpusError(f"no .txt/.md/.rst/.jsonl files found in {', '.join(map(str, inputs))}")
    return files


def _read_text(path: Path) -> str:
    data = gzip.decompress(path.read_bytes()) if path.name.lower().endswith(".gz") else path.read_bytes()
    return data.decode("utf-8")


def iter_documents(
    files: list[Path], *, text_field: str = "text", on_bad_utf8: str = "skip", skipped: list[str] | None = None
) -> Iterator[str]:
    """Yield documents' texts in file order. Non-UTF-8 files are skipped (recorded) or raise."""
    for path in files:
        try:
            text = _read_text(path)
        except UnicodeDecodeError as e:
            if on_bad_utf8 == "error":
                raise CorpusError(f"{path} is not UTF-8 ({e.reason} at byte {e.start}); fix it or pass --on-bad-utf8 skip") from None
            warnings.warn(f"skipping {path}: not UTF-8 ({e.reason} at byte {e.start})", stacklevel=2)
            if skipped is not None:
                skipped.append(f"{path}: not UTF-8")
            continue
        except (OSError, EOFError) as e:
            raise CorpusError(f"cannot read {path}: {e}") from None
        if _suffix(path) in JSONL_SUFFIXES:
            yield from _jsonl_documents(path, text, text_field)
        elif text.strip():
            yield text


def _jsonl_documents(path: Path, text: str, text_field: str) -> Iterator[str]:
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise CorpusError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
        value = record.get(text_field) if isinstance(record, dict) else None
        if not isinstance(value, str):
            raise CorpusError(f"{path}:{lineno}: no string field {text_field!r}; set it with --text-field")
        if value.strip():
            yield value
