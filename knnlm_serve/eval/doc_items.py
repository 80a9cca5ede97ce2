"""Task items from a documentation corpus: for each documented name, "which name does this?" asked
in four forms, so that a user can see how far kNN's gains reach beyond the stored text.

  stored-form  the document's own text up to the name (what the datastore holds, verbatim)
  question     the name's first sentence asked as a question
  sentence     the first sentence quoted inside the sentence that the name completes
  paraphrase   the first sentence, then a cross-reference to the name (near the stored form)

Items from documents kept out of the datastore are the control (kind `control/<form>`): kNN
should gain nothing there. A definition is a documented name and its description, found in
  * the docstring layout the default datastore stores: a line `module.name`, a blank line, the docstring;
  * Markdown: a heading that is a name (`## json.dumps`, `` ### `dumps()` ``), then a paragraph;
  * reStructuredText: `.. function:: name(...)` (also class, method, data, attribute; `py:` too),
    then its indented paragraph.
The answer is the name's last part (`dumps`); a qualifier (`json.`) stays in the prompt.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass
from pathlib import Path

from knnlm_serve.eval.text import EvalError

FORMS = ("stored-form", "question", "sentence", "paraphrase")
SUFFIXES = (".txt", ".md", ".rst")
CONTEXT_CHARS = 1000  # the stored form's prompt: about this much text before the name, from a line start

NAME = r"[A-Za-z_][\w.]*"
DOCSTRING = re.compile(rf"^(?P<name>{NAME}\.[A-Za-z_]\w*)\n\n(?P<body>\S.*?)(?:\n\n|\Z)", re.MULTILINE | re.DOTALL)
MARKDOWN = re.compile(
    rf"^#{{1,6}}[ \t]+`?(?P<name>{NAME})(?:\([^)\n]*\))?`?[ \t]*\n\n(?P<body>[^#\s].*?)(?:\n\n|\Z)", re.MULTILINE | re.DOTALL
)
RST = re.compile(
    rf"^\.\. (?:py:)?(?:function|class|method|data|attribute|exception)::[ \t]+(?P<name>{NAME})[^\n]*\n"
    r"(?:[ \t]+:[^\n]*\n)*\n(?P<body>(?:[ \t]+\S[^\n]*\n?)+)",
    re.MULTILINE,
)
SENTENCE = re.compile(r"^(.*?[.!?])(?:\s|$)", re.DOTALL)


@dataclass(frozen=True)
class Definition:
    document: str  # the file it came from
    name: str  # as written: "json.dumps"
    summary: str  # the description's first sentence, on one line
    prefix_text: str  # the document's text before the name's last part


def definitions(path: Path, text: str) -> list[Definition]:
    """Every documented name of one document whose first sentence does not give its own name away."""
    pattern = {".md": MARKDOWN, ".rst": RST}.get(path.suffix, DOCSTRING)
    found = []
    for match in pattern.finditer(text):
        name = match.group("name").rstrip(".")
        last = name.rsplit(".", 1)[-1]
        summary = " ".join(_first_sentence(match.group("body")).split())
        if len(summary) < 20 or re.search(rf"\b{re.escape(last)}\b", summary, re.IGNORECASE):
            continue
        found.append(Definition(str(path), name, summary, text[: match.start("name") + len(name) - len(last)]))
    return found


def _first_sentence(body: str) -> str:
    paragraph = body.split("\n\n")[0]
    sentence = SENTENCE.match(paragraph)
    return (sentence.group(1) if sentence else paragraph)[:300]


def items_for(definition: Definition, kind_prefix: str = "") -> list[dict]:
    """The four forms of one definition as task items (prompt, answer, id, kind)."""
    qualifier, _, last = definition.name.rpartition(".")
    qualifier = qualifier + "." if qualifier else ""
    # A name after a space is one token with that space (byte-level BPE): the space goes into the answer.
    answer, stored = last, definition.prefix_text
    if stored.endswith(" "):
        answer, stored = " " + last, stored[:-1]
    start = stored.find("\n", max(0, len(stored) - CONTEXT_CHARS))
    stored = stored[start + 1 :] if 0 <= start < len(stored) - 1 else stored[-CONTEXT_CHARS:]
    lead = qualifier or "`"
    forms = {
        "stored-form": (stored, answer),
        "question": (
            f"Question: Which {'name in ' + qualifier.rstrip('.') if qualifier else 'name'} does this? {definition.summary}\nAnswer: {lead}",
            last,
        ),
        "sentence": (
            f'The name {"in " + qualifier.rstrip(".") + " " if qualifier else ""}that does the following: "{definition.summary}" is {lead}',
            last,
        ),
        "paraphrase": (f"{definition.summary}\n\nSee also: {lead}", last),
    }
    base = f"{Path(definition.document).stem}:{definition.name}"
    return [{"prompt": p, "answer": a, "id": f"{base}:{form}", "kind": kind_prefix + form} for form, (p, a) in forms.items()]


def corpus_files(paths: list[Path]) -> list[Path]:
    files = []
    for path in map(Path, paths):
        if path.is_dir():
            files += sorted(f for f in path.rglob("*") if f.suffix in SUFFIXES and f.is_file())
        elif path.is_file():
            files.append(path)
        else:
            raise EvalError(f"{path}: no such file or directory")
    if not files:
        raise EvalError(f"no {', '.join(SUFFIXES)} documents under {', '.join(map(str, paths))}")
    return files


def stored_hashes(datastore: Path) -> set[str]:
    """The sha256 of every document a datastore serves (not those its build held out or it forgot)."""
    from knnlm_core.datastore import read_manifest
    from knnlm_core.provenance import PROVENANCE, DocumentTable, served_documents

    return set(served_documents(DocumentTable.read(Path(datastore) / PROVENANCE), read_manifest(datastore)))


def generate_items(
    stored: list[Path], control: list[Path] = (), limit: int = 200, control_limit: int = 60, seed: int = 0, datastore: Path | None = None
) -> list[dict]:
    """Items for up to `limit` definitions of the stored documents and `control_limit` of the
    control documents (a seeded sample, in corpus order), four forms each. With `datastore`, a
    document it does not serve (its build held it out for calibration, or it was forgotten) joins
    the control: a document is matched by the sha256 of its text, as the build recorded it."""
    stored_files, control_files = corpus_files(stored), corpus_files(control) if control else []
    if datastore is not None:
        served = stored_hashes(datastore)
        texts = {f: _read(f) for f in stored_files}
        kept = [f for f in stored_files if hashlib.sha256(texts[f].encode("utf-8")).hexdigest() in served]
        if not kept:
            raise EvalError(
                f"none of the documents under {', '.join(map(str, stored))} is served by {datastore} "
                "(matched by the sha256 of their text): pass the files the datastore was built from"
            )
        control_files += [f for f in stored_files if f not in kept]
        stored_files = kept
    items = []
    for files, most, prefix in ((stored_files, limit, ""), (control_files, control_limit, "control/")):
        if not files:
            continue
        found = [d for f in files for d in definitions(f, _read(f))]
        if not found:
            raise EvalError(
                f"no documented names found in {', '.join(sorted({str(f.parent) for f in files}))}: expected the docstring layout "
                "(a line `module.name`, a blank line, its docstring), Markdown headings or reST `.. function::` directives"
            )
        chosen = sorted(random.Random(seed).sample(range(len(found)), min(most, len(found))))
        items += [item for i in chosen for item in items_for(found[i], prefix)]
    unique = {}
    for item in items:
        unique.setdefault(item["id"], item)  # a name documented twice in one document: its first
    return list(unique.values())


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")
