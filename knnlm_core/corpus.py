"""Reading a corpus: files and directories of .txt/.md/.rst/.jsonl, optionally gzipped, and tokenizing it.

A text file is one document; each line of a .jsonl file is one document (its `text_field`). The
builder, the evaluator and the benchmarks tokenize with `token_ids`, so their positions agree.
Each document keeps where it came from (`Document`): the builder records it for provenance.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from knnlm_core.errors import CorpusError, ErrorKind

logger = logging.getLogger("knnlm_core")

TEXT_SUFFIXES = (".txt", ".md", ".rst")
JSONL_SUFFIXES = (".jsonl",)


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
            raise CorpusError(f"corpus path {item} does not exist", ErrorKind.NOT_FOUND)
        if item.is_dir():
            found.extend(p for p in sorted(item.rglob("*")) if p.is_file() and _supported(p))
        elif _supported(item):
            found.append(item)
        else:
            raise CorpusError(f"{item}: unsupported file type; use .txt, .md, .rst or .jsonl (optionally .gz)")
    files = list(dict.fromkeys(p.resolve() for p in found))
    if not files:
        raise CorpusError(f"no .txt/.md/.rst/.jsonl files found in {', '.join(map(str, inputs))}")
    return files


def skipped_reason(skipped: list[str]) -> str:
    """The files `iter_documents` skipped (not UTF-8), for an error about a corpus left empty."""
    return f"{'; '.join(skipped)}, so skipped (save it as UTF-8)"


def no_text_error(inputs: list, documents: int, skipped: list[str]) -> CorpusError:
    """Why a corpus gave no entries: its only files were skipped, or its documents are too short to
    hold a context and a next token."""
    why = skipped_reason(skipped) if documents == 0 and skipped else "every document is empty or one token long"
    return CorpusError(f"there is no text to index in {', '.join(map(str, inputs))}: {why}")


def _read_text(path: Path) -> str:
    data = gzip.decompress(path.read_bytes()) if path.name.lower().endswith(".gz") else path.read_bytes()
    return data.decode("utf-8")


@dataclass(frozen=True)
class Document:
    text: str
    source: Path
    line: int | None = None  # .jsonl: the 1-based line
    id: str | None = None  # .jsonl: the record's `id` field, when it has one

    @property
    def sha256(self) -> str:
        """Of the text as UTF-8: finds the document again in its source, and checks it."""
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()


def iter_documents(
    files: list[Path], *, text_field: str = "text", on_bad_utf8: str = "skip", skipped: list[str] | None = None
) -> Iterator[Document]:
    """Yield documents in file order. Non-UTF-8 files are skipped (recorded) or raise."""
    for path in files:
        try:
            text = _read_text(path)
        except UnicodeDecodeError as e:
            if on_bad_utf8 == "error":
                raise CorpusError(f"{path} is not UTF-8 ({e.reason} at byte {e.start}); fix it or pass --on-bad-utf8 skip") from None
            logger.warning("skipping %s: not UTF-8 (%s at byte %d)", path, e.reason, e.start)
            if skipped is not None:
                skipped.append(f"{path}: not UTF-8")
            continue
        except (OSError, EOFError) as e:
            raise CorpusError(f"cannot read {path}: {e}") from None
        if _suffix(path) in JSONL_SUFFIXES:
            yield from _jsonl_documents(path, text, text_field)
        elif text.strip():
            yield Document(text, path)


def _jsonl_documents(path: Path, text: str, text_field: str) -> Iterator[Document]:
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
            record_id = record.get("id")
            yield Document(value, path, lineno, None if record_id is None or isinstance(record_id, (dict, list)) else str(record_id))


def token_ids(tokenizer, text: str) -> np.ndarray:
    """One document's token ids: the single tokenizer call every path uses."""
    return np.asarray(tokenizer(text).input_ids, dtype=np.int32)


def doc_offsets(lengths: list[int]) -> np.ndarray:
    """[D + 1] start of each document in the concatenated tokens, and the total at the end."""
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return offsets


def tokenize_files(
    files: list[Path], model_dir: Path, *, text_field: str = "text", on_bad_utf8: str = "skip", skipped: list[str] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """All documents' tokens concatenated, and their offsets (in memory: for held-out texts)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    documents = iter_documents(files, text_field=text_field, on_bad_utf8=on_bad_utf8, skipped=skipped)
    docs = [token_ids(tokenizer, d.text) for d in documents]
    tokens = np.concatenate(docs) if docs else np.zeros(0, dtype=np.int32)
    return tokens, doc_offsets([len(d) for d in docs])
