"""Uploaded files as text documents for a kNN datastore (the OpenAI-compatible Files / Vector Stores API).

`check_upload` refuses at upload what can never be text, so a client learns it then and not from a failed
vector-store file later; `documents_of` reads the documents. Errors carry OpenAI's vector-store file error code.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
from html.parser import HTMLParser
from types import ModuleType
from typing import Literal

logger = logging.getLogger("knnlm_serve")

TEXT_EXTENSIONS = (".txt", ".md", ".markdown", ".rst", ".text")
HTML_EXTENSIONS = (".html", ".htm")
SUPPORTED = (*TEXT_EXTENSIONS, *HTML_EXTENSIONS, ".json", ".jsonl", ".pdf")

Document = tuple[str | None, str]  # (id or None, text)

_JSON_TYPES = {dict: "an object", list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean"}
_BLOCK_TAGS = {"p", "div", "h1", "h2", "h3", "h4", "h5", "h6", "ul", "ol", "dl", "table", "pre", "blockquote", "hr", "title"}
_BLOCK_TAGS |= {"section", "article", "header", "footer", "nav", "aside", "main"}  # a blank line around each
_LINE_TAGS = {"br", "li", "dt", "dd", "tr", "td", "th"}  # a line of its own, so no blank line between list items


class UploadError(ValueError):
    """Why an uploaded file cannot become documents; `code` is OpenAI's vector-store file error code."""

    def __init__(self, message: str, code: Literal["unsupported_file", "invalid_file"]):
        super().__init__(message)
        self.code = code


def check_upload(data: bytes, filename: str) -> None:
    """Refuse an empty or binary file at upload time; a PDF passes only where pypdf can read it later."""
    if not data:
        raise UploadError(f"{filename}: the file is empty", "invalid_file")
    if data.startswith(b"%PDF-"):
        _pypdf(filename)
    else:
        _decoded(data, filename)


def documents_of(data: bytes, filename: str) -> list[Document]:
    """The documents (id or None, text) of an upload, read by its extension; blank documents are dropped,
    and an upload left with none is refused, so that a datastore never gets an empty document."""
    extension = os.path.splitext(filename)[1].lower()
    if extension in TEXT_EXTENSIONS:
        documents = [(None, _decoded(data, filename))]
    elif extension in HTML_EXTENSIONS:
        documents = [(None, _visible_text(_decoded(data, filename)))]
    elif extension == ".json":
        documents = _json_documents(_decoded(data, filename), filename)
    elif extension == ".jsonl":
        documents = _jsonl_documents(_decoded(data, filename), filename)
    elif extension == ".pdf":
        documents = [(None, _pdf_text(data, filename))]
    else:
        kind = f"{extension} files" if extension else "files without an extension"
        raise UploadError(f"{filename}: {kind} are not supported; supported: {', '.join(SUPPORTED)}", "unsupported_file")
    kept = [(doc_id, text) for doc_id, text in documents if text.strip()]
    if not kept:
        raise UploadError(f"{filename}: no text", "invalid_file")
    logger.debug("upload %s: %d documents (%d blank dropped)", filename, len(kept), len(documents) - len(kept))
    return kept


def _decoded(data: bytes, filename: str) -> str:
    """UTF-8 text without its BOM; NUL bytes are valid UTF-8 but mark a binary file all the same."""
    try:
        text = data.decode("utf-8").removeprefix("\ufeff")  # not utf-8-sig: its error offsets skip the BOM
    except UnicodeDecodeError as e:
        raise UploadError(f"{filename}: binary, not UTF-8 text (at byte {e.start})", "invalid_file") from None
    if "\x00" in text:
        raise UploadError(f"{filename}: binary, not text (holds NUL bytes)", "invalid_file")
    return text


def _pypdf(filename: str) -> ModuleType:
    """pypdf, an optional dependency: without it a PDF is refused with what to do instead."""
    try:
        import pypdf
    except ImportError:
        message = f"{filename}: reading a PDF needs the pypdf package, which this server lacks; upload the text instead"
        raise UploadError(message, "unsupported_file") from None
    return pypdf


def _pdf_text(data: bytes, filename: str) -> str:
    """The text of every page, pages apart by a blank line."""
    pypdf = _pypdf(filename)
    try:
        return "\n\n".join(page.extract_text() for page in pypdf.PdfReader(io.BytesIO(data)).pages)
    except (pypdf.errors.PyPdfError, ValueError) as e:
        raise UploadError(f"{filename}: not a readable PDF ({e})", "invalid_file") from None


class _VisibleText(HTMLParser):
    """Text a browser shows: no script or style, a paragraph's lines apart from the next paragraph's."""

    def __init__(self) -> None:
        super().__init__()  # convert_charrefs: &amp; and the like arrive as text
        self.parts: list[str] = []
        self.hidden = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in ("script", "style"):
            self.hidden += 1
        elif tag in _BLOCK_TAGS or tag in _LINE_TAGS:
            self.parts.append("\n")

    def handle_endtag(self, tag: str) -> None:
        if tag in ("script", "style"):
            self.hidden = max(0, self.hidden - 1)
        elif tag in _BLOCK_TAGS:
            self.parts.append("\n")

    def handle_data(self, data: str) -> None:
        if not self.hidden:
            self.parts.append(re.sub(r"\s+", " ", data))  # source line breaks are spaces on the page


def _visible_text(html: str) -> str:
    parser = _VisibleText()
    parser.feed(html)
    parser.close()
    lines = "\n".join(line.strip() for line in "".join(parser.parts).split("\n"))
    return re.sub(r"\n{3,}", "\n\n", lines).strip()


def _document(value: object, where: str) -> Document:
    """A JSON object's document: its "text" string, and its "id" where that is a string."""
    if not isinstance(value, dict):
        got = _JSON_TYPES.get(type(value), "null")
        raise UploadError(f'{where}: expected a JSON object with a "text" string, got {got}', "invalid_file")
    if not isinstance(value.get("text"), str):
        what = _JSON_TYPES.get(type(value["text"]), "null") if "text" in value else "missing"
        raise UploadError(f'{where}: "text" is {what}; it must be a string', "invalid_file")
    doc_id = value.get("id")
    return (doc_id if isinstance(doc_id, str) else None, value["text"])


def _json_documents(text: str, filename: str) -> list[Document]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise UploadError(f"{filename}: not valid JSON ({e})", "invalid_file") from None
    if isinstance(value, list):
        return [_document(item, f"{filename} item {i}") for i, item in enumerate(value, start=1)]
    return [_document(value, filename)]


def _jsonl_documents(text: str, filename: str) -> list[Document]:
    documents = []
    for number, line in enumerate(text.split("\n"), start=1):  # not splitlines: JSON strings may hold U+2028
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as e:
            raise UploadError(f"{filename} line {number}: not valid JSON ({e.msg} at column {e.colno})", "invalid_file") from None
        documents.append(_document(value, f"{filename} line {number}"))
    return documents
