"""The architecture the folder tree shows: the shared core imports neither side, no package cycle,
and vLLM's internals are read in exactly one module."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("knnlm_core", "index_builder", "knnlm_serve")


def imported_packages(package: str) -> set[str]:
    """Our top-level packages that `package`'s modules import (at any depth of the module)."""
    found = set()
    for file in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(file.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            found |= {n.split(".")[0] for n in names if n.split(".")[0] in PACKAGES}
    return found - {package}


def test_import_graph_has_no_cycle_and_the_core_imports_neither_side():
    graph = {p: imported_packages(p) for p in PACKAGES}
    assert graph["knnlm_core"] == set(), graph
    assert graph["index_builder"] == {"knnlm_core"}, graph
    assert graph["knnlm_serve"] <= {"knnlm_core", "index_builder"}, graph
    assert "knnlm_serve" not in graph["index_builder"]


def test_vllm_internals_are_read_in_one_module():
    """Attributes of vLLM's runner, worker and model tables appear in the adapter alone."""
    internal = re.compile(r"\.(model_runner|input_batch|query_start_loc|logitsprocs|get_model)\b|_TEXT_GENERATION_MODELS")
    readers = sorted(str(f.relative_to(ROOT)) for p in PACKAGES for f in (ROOT / p).rglob("*.py") if internal.search(f.read_text()))
    assert readers == ["knnlm_serve/engine/vllm_adapter.py"]


def test_no_stack_walking():
    sources = [f.read_text() for p in PACKAGES for f in (ROOT / p).rglob("*.py")]
    assert not any("_getframe" in s or "inspect.stack" in s for s in sources)
