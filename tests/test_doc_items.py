"""knnlm-eval items: "which name does this?" items from a documentation corpus, in four forms,
with the control documents apart; every generated item splits cleanly at SmolLM2's token boundary."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from index_builder.build import build_datastore
from index_builder.default_datastore import module_documents
from index_builder.forget import forget_documents
from knnlm_core.config import BuildConfig
from knnlm_serve.eval.doc_items import FORMS, definitions, generate_items
from knnlm_serve.eval.task_items import read_items, tokenize_item
from knnlm_serve.eval.text import EvalError

DOCSTRINGS = """Module shapes

Shapes and their areas.

shapes.area

Compute the surface enclosed by a polygon given its corners.

shapes.perimeter

Sum the lengths of every edge of a polygon.

shapes.rotate

rotate(points, angle) turns the points about the origin.
"""

MARKDOWN = """# Shapes

## `shapes.area()`

Compute the surface enclosed by a polygon given its corners. Corners go clockwise.

## perimeter

Sum the lengths of every edge of a polygon.
"""

RST = """Shapes
======

.. function:: area(corners)
   :noindex:

   Compute the surface enclosed by a polygon given its corners.

.. py:class:: shapes.Polygon(corners)

   A closed chain of straight edges.
"""


def write(tmp_path, name: str, text: str):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_each_documented_name_gives_three_forms_whose_stored_form_is_the_documents_own_text(tmp_path):
    doc = write(tmp_path, "shapes.txt", DOCSTRINGS)
    items = generate_items([doc])
    assert [(i["id"].split(":")[1], i["kind"]) for i in items] == [(f"shapes.{n}", f) for n in ("area", "perimeter") for f in FORMS]
    stored = {i["id"]: i for i in items if i["kind"] == "stored-form"}["shapes:shapes.area:stored-form"]
    assert stored["answer"] == "area" and stored["prompt"].endswith("shapes.") and stored["prompt"] + "area" in DOCSTRINGS
    question = next(i for i in items if i["kind"] == "question")
    assert "Compute the surface enclosed by a polygon given its corners." in question["prompt"] and "area" not in question["prompt"]


def test_a_description_that_names_its_own_function_is_not_made_an_item(tmp_path):
    names = [d.name for d in definitions(tmp_path / "shapes.txt", DOCSTRINGS)]
    assert "shapes.rotate" not in names  # "rotate(points, angle) turns ..." gives the answer away


@pytest.mark.parametrize(
    "name, text, expected",
    [("shapes.md", MARKDOWN, ["shapes.area", "perimeter"]), ("shapes.rst", RST, ["area", "shapes.Polygon"])],
    ids=["markdown", "restructuredtext"],
)
def test_markdown_headings_and_rst_directives_are_definitions_too(tmp_path, name, text, expected):
    found = definitions(tmp_path / name, text)
    assert [d.name for d in found] == expected
    assert found[0].summary == "Compute the surface enclosed by a polygon given its corners."


def test_a_name_after_a_space_carries_the_space_into_the_stored_forms_answer(tmp_path):
    items = generate_items([write(tmp_path, "shapes.md", MARKDOWN)])
    stored = next(i for i in items if i["id"] == "shapes:perimeter:stored-form")
    assert stored["answer"] == " perimeter" and stored["prompt"].endswith("##")


def test_control_documents_give_items_of_their_own_kind(tmp_path):
    items = generate_items([write(tmp_path, "shapes.txt", DOCSTRINGS)], [write(tmp_path, "more.md", MARKDOWN)])
    assert {i["kind"] for i in items} == set(FORMS) | {f"control/{f}" for f in FORMS}


def test_documents_without_definitions_are_an_error_naming_the_layouts(tmp_path):
    with pytest.raises(EvalError, match="no documented names found .*docstring layout"):
        generate_items([write(tmp_path, "notes.txt", "Just prose.\n\nMore prose.\n")])
    with pytest.raises(EvalError, match="no such file"):
        generate_items([tmp_path / "missing"])


def test_the_cli_writes_items_that_tasks_reads_and_that_split_cleanly_at_the_token_boundary(tmp_path, smollm2_dir):
    docs, control = tmp_path / "docs", tmp_path / "control"
    for directory, modules in ((docs, ("json", "heapq", "bisect")), (control, ("fnmatch", "glob"))):
        directory.mkdir()
        for name, text in module_documents(modules).items():
            (directory / f"{name}.txt").write_text(text)
    out = tmp_path / "items.jsonl"
    result = subprocess.run(
        [sys.executable, "-m", "knnlm_serve.eval.cli", "items", str(docs), "--control", str(control), "--limit", "8", "-o", str(out)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    items = read_items(out)
    assert len(items) == len({i.id for i in items}) == (min(8, len(definitions_in(docs))) + len(definitions_in(control))) * len(FORMS)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    assert all(tokenize_item(tokenizer, item) is not None for item in items)
    assert json.loads(out.read_text().splitlines()[0])["kind"] == "stored-form"


@pytest.mark.parametrize(
    "args",
    [["items", "docs", "--limit", "0"], ["items", "docs", "--control-limit", "-1"], ["tasks", "items.jsonl", "--concurrency", "0"]],
    ids=["items-limit", "items-control-limit", "tasks-concurrency"],
)
def test_a_count_below_one_is_refused_naming_its_flag(tmp_path, args):
    """`--limit 0` wrote an empty items file, and `--concurrency 0` failed only once a server answered."""
    result = subprocess.run([sys.executable, "-m", "knnlm_serve.eval.cli", *args], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 2 and f"argument {args[2]}: must be a positive integer" in result.stderr, result.stderr


def definitions_in(directory) -> list:
    return [d for f in sorted(directory.glob("*.txt")) for d in definitions(f, f.read_text())]


def test_documents_the_datastore_does_not_serve_join_the_control(tmp_path, tiny_model_dir):
    docs = tmp_path / "docs"
    docs.mkdir()
    for name in ("area", "perimeter"):
        write(docs, f"{name}.txt", DOCSTRINGS.replace("shapes.", f"{name}s."))
    build_datastore([docs], tmp_path / "store", tiny_model_dir, BuildConfig(index="flat", calibrate=False), progress=False)
    write(docs, "later.txt", DOCSTRINGS.replace("shapes.", "later."))  # written after the build
    assert served_or_control(generate_items([docs], datastore=tmp_path / "store")) == {
        "area": "stored",
        "perimeter": "stored",
        "later": "control",
    }
    forget_documents(tmp_path / "store", documents=[0])
    assert served_or_control(generate_items([docs], datastore=tmp_path / "store")) == {
        "area": "control",
        "perimeter": "stored",
        "later": "control",
    }
    with pytest.raises(EvalError, match="none of the documents .* is served by"):
        generate_items([docs / "later.txt"], datastore=tmp_path / "store")


def served_or_control(items: list[dict]) -> dict[str, str]:
    """Per document (file stem): whether its items are of the stored kinds or the control's."""
    return {i["id"].split(":")[0]: "control" if i["kind"].startswith("control/") else "stored" for i in items}
