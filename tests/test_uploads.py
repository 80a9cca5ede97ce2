"""Uploaded files as datastore documents (knnlm_core/uploads.py): each format, each refusal and its code;
and the order they wait to be indexed in."""

from __future__ import annotations

import importlib.util
import json

import pytest

from knnlm_core.uploads import SUPPORTED, UploadError, check_upload, documents_of

HAS_PYPDF = importlib.util.find_spec("pypdf") is not None


def tiny_pdf(text: str) -> bytes:
    """A one-page PDF that shows `text`, with the cross-reference table a strict reader wants."""
    stream = b"BT /F1 12 Tf 10 50 Td (%s) Tj ET" % text.encode()
    objects = [
        b"<</Type/Catalog/Pages 2 0 R>>",
        b"<</Type/Pages/Kids[3 0 R]/Count 1>>",
        b"<</Type/Page/Parent 2 0 R/MediaBox[0 0 200 100]/Contents 4 0 R/Resources<</Font<</F1 5 0 R>>>>>>",
        b"<</Length %d>>stream\n%s\nendstream" % (len(stream), stream),
        b"<</Type/Font/Subtype/Type1/BaseFont/Helvetica>>",
    ]
    pdf, offsets = b"%PDF-1.4\n", []
    for number, body in enumerate(objects, start=1):
        offsets.append(len(pdf))
        pdf += b"%d 0 obj\n%s\nendobj\n" % (number, body)
    xref = b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1) + b"".join(b"%010d 00000 n \n" % o for o in offsets)
    return pdf + xref + b"trailer\n<</Size %d/Root 1 0 R>>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, len(pdf))


def refusal(data: bytes, filename: str, read=documents_of) -> UploadError:
    with pytest.raises(UploadError) as caught:
        read(data, filename)
    return caught.value


@pytest.mark.parametrize("filename", ["notes.txt", "README.md", "a.markdown", "guide.rst", "b.text", "SHOUT.TXT"])
def test_a_text_file_is_one_document_as_is(filename):
    assert documents_of("  Zürich\n\nsecond paragraph\n".encode(), filename) == [(None, "  Zürich\n\nsecond paragraph\n")]


def test_a_byte_order_mark_is_not_part_of_the_text():
    assert documents_of(b"\xef\xbb\xbfhello", "bom.txt") == [(None, "hello")]
    assert documents_of(b'\xef\xbb\xbf{"text": "hi"}', "bom.json") == [(None, "hi")]


def test_an_html_file_gives_its_visible_text():
    html = b"""<html><head><style>p { color: red }</style><script>var x = "<p>hidden</p>";</script></head>
    <body><h1>Title</h1><p>First
       paragraph &amp; more.</p><p>Second<br>line two<br/>line three</p>
    <ul><li>one</li><li>two</li></ul><div></div><div></div><p>after <b>bold</b> words</p>
    <table><tr><td>cell</td><td>cell</td></tr></table></body></html>"""
    text = "Title\n\nFirst paragraph & more.\n\nSecond\nline two\nline three\n\none\ntwo\n\nafter bold words\n\ncell\ncell"
    assert documents_of(html, "page.HTM") == [(None, text)]


def test_a_json_object_is_one_document_and_a_json_list_one_per_object():
    assert documents_of(b'{"id": "d1", "text": "alpha", "extra": 1}', "one.json") == [("d1", "alpha")]
    listed = json.dumps([{"id": "a", "text": "x"}, {"text": "y"}, {"id": 7, "text": "z"}]).encode()
    assert documents_of(listed, "many.json") == [("a", "x"), (None, "y"), (None, "z")]


def test_a_jsonl_file_is_one_document_per_non_blank_line():
    lines = '{"id": "a", "text": "first"}\n\n   \n{"text": "second \u2028 with a line separator"}\r\n'
    assert documents_of(lines.encode(), "docs.jsonl") == [
        ("a", "first"),
        (None, "second \u2028 with a line separator"),
    ]


def test_blank_documents_are_dropped():
    lines = b'{"text": "kept"}\n{"text": "  \\n\\t"}\n{"text": ""}\n'
    assert documents_of(lines, "some.jsonl") == [(None, "kept")]


@pytest.mark.parametrize(
    ("data", "filename"),
    [(b"", "empty.txt"), (b" \n\t\n", "blank.md"), (b"<script>x()</script>", "blank.html"), (b"[]", "none.json")],
)
def test_an_upload_without_text_is_invalid(data, filename):
    error = refusal(data, filename)
    assert (error.code, str(error)) == ("invalid_file", f"{filename}: no text")


@pytest.mark.parametrize(
    ("line", "wrong"), [("{not json", "not valid JSON"), ('["a list"]', "got an array"), ('{"id": "x"}', '"text" is missing')]
)
def test_a_bad_jsonl_line_is_named_with_what_is_wrong(line, wrong):
    error = refusal(f'{{"text": "fine"}}\n\n{line}\n'.encode(), "docs.jsonl")
    assert error.code == "invalid_file"
    assert str(error).startswith("docs.jsonl line 3: ") and wrong in str(error)


def test_bad_json_is_invalid_with_what_is_wrong():
    assert str(refusal(b'{"text": 3}', "a.json")) == 'a.json: "text" is a number; it must be a string'
    assert str(refusal(b'[{"text": "ok"}, "s"]', "b.json")) == 'b.json item 2: expected a JSON object with a "text" string, got a string'
    error = refusal(b'{"text": "unterminated', "c.json")
    assert error.code == "invalid_file" and str(error).startswith("c.json: not valid JSON")


@pytest.mark.parametrize("filename", ["image.png", "archive.tar.gz", "Makefile"])
def test_an_unsupported_extension_lists_the_supported_ones(filename):
    error = refusal(b"plain text", filename)
    assert error.code == "unsupported_file"
    assert str(error).startswith(f"{filename}: ") and all(extension in str(error) for extension in SUPPORTED)


@pytest.mark.parametrize("read", [check_upload, documents_of])
@pytest.mark.parametrize(("data", "why"), [(b"ab\xff\xfe", "not UTF-8 text (at byte 2)"), (b"a\x00b", "holds NUL bytes")])
def test_binary_bytes_are_invalid(read, data, why):
    error = refusal(data, "data.txt", read)
    assert error.code == "invalid_file"
    assert str(error).startswith("data.txt: binary") and why in str(error)


def test_an_error_offset_counts_the_byte_order_mark():
    assert "at byte 5" in str(refusal(b"\xef\xbb\xbfab\xff", "bom.txt"))


def test_an_empty_upload_is_refused_at_upload():
    error = refusal(b"", "empty.txt", check_upload)
    assert (error.code, str(error)) == ("invalid_file", "empty.txt: the file is empty")


def test_text_passes_the_upload_check_whatever_its_extension():
    assert check_upload("héllo".encode(), "notes.unknown") is None


@pytest.mark.skipif(not HAS_PYPDF, reason="the branch without pypdf is tested below")
def test_a_pdf_is_the_text_of_its_pages():
    check_upload(tiny_pdf("Hello PDF"), "paper.pdf")
    assert [(doc_id, text.strip()) for doc_id, text in documents_of(tiny_pdf("Hello PDF"), "paper.pdf")] == [(None, "Hello PDF")]
    assert refusal(b"%PDF-1.4 truncated", "broken.pdf").code == "invalid_file"


@pytest.mark.skipif(HAS_PYPDF, reason="the branch with pypdf is tested above")
@pytest.mark.parametrize("read", [check_upload, documents_of])
def test_a_pdf_without_pypdf_is_unsupported_with_what_to_do(read):
    error = refusal(tiny_pdf("Hello PDF"), "paper.pdf", read)
    assert error.code == "unsupported_file"
    assert str(error).startswith("paper.pdf: ") and "pypdf" in str(error) and "upload the text instead" in str(error)


def test_files_waiting_to_be_indexed_are_taken_one_key_at_a_time_in_turn():
    from knnlm_serve.server.store_indexing import KeyTurns

    turns = KeyTurns()
    for item in ("a1", "a2", "a3"):
        turns.put("alice", item)
    turns.put("bob", "b1")
    turns.put(None, "n1")
    taken = [turns.get(timeout=0)]
    turns.put("bob", "b2")  # attached after Alice's three: taken after her second, before her third
    taken += [turns.get(timeout=0) for _ in range(6)]
    assert taken == ["a1", "b1", "n1", "a2", "b2", "a3", None]
