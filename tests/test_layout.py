"""The architecture the folder tree shows: the shared core imports neither side, nothing imports
upward or in a circle, no module outgrows one job, and vLLM's internals are read in exactly one
module."""

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


def test_vllm_internals_are_read_in_one_module_per_model_runner():
    """Attributes of vLLM's runners, workers and model tables appear in the adapters alone."""
    internal = re.compile(
        r"(?<!knn)\.(model_runner|input_batch|query_start_loc|logitsprocs|get_model|req_states|prompt_logprobs_worker)\b"
        r"|_TEXT_GENERATION_MODELS|HAS_TRITON"
    )
    readers = sorted(str(f.relative_to(ROOT)) for p in PACKAGES for f in (ROOT / p).rglob("*.py") if internal.search(f.read_text()))
    assert readers == ["knnlm_serve/engine/vllm_adapter.py", "knnlm_serve/engine/vllm_adapter_v2.py"]


def test_no_stack_walking():
    sources = [f.read_text() for p in PACKAGES for f in (ROOT / p).rglob("*.py")]
    assert not any("_getframe" in s or "inspect.stack" in s for s in sources)


MAX_MODULE_LINES = 300  # a module past this is doing more than one job: split it
# knnlm_serve's layers, bottom up: a module imports only from its own layer and those below.
LAYERS = {
    "knnlm_serve.engine": 1,
    "knnlm_serve.eval": 2,
    "knnlm_serve.server": 2,
}


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for file in (ROOT / package).rglob("*.py"):
            parts = file.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = file
    return found


def module_imports(file: Path, known: dict[str, Path]) -> set[str]:
    """Our modules that `file` imports, at any depth of it."""
    imported = set()
    for node in ast.walk(ast.parse(file.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        imported |= {n for n in names if n in known}
    return imported


def layer(module: str) -> tuple[str, int]:
    for prefix, rank in LAYERS.items():
        if module == prefix or module.startswith(prefix + "."):
            return prefix, rank
    return "knnlm_serve", 0


def test_no_module_imports_upward_or_sideways_across_layers():
    known = modules()
    wrong = []
    for module, file in known.items():
        if not module.startswith("knnlm_serve."):
            continue
        own, rank = layer(module)
        for imported in module_imports(file, known):
            if imported.startswith("knnlm_serve"):
                other, other_rank = layer(imported)
                if other_rank > rank or (other_rank == rank and other != own):
                    wrong.append(f"{module} -> {imported}")
    assert wrong == []


def test_no_import_cycle_between_modules():
    known = modules()
    graph = {m: module_imports(f, known) - {m} for m, f in known.items()}
    # A package's __init__ re-exporting its own modules is not a cycle of the design.
    graph = {m: {i for i in deps if not (m.startswith(i + ".") and known[i].name == "__init__.py")} for m, deps in graph.items()}
    visiting, done, cycles = set(), set(), []

    def visit(m, path):
        visiting.add(m)
        for n in graph[m]:
            if n in visiting:
                cycles.append(path[path.index(n) :] + [n] if n in path else [m, n])
            elif n not in done:
                visit(n, path + [n])
        visiting.discard(m)
        done.add(m)

    for m in sorted(graph):
        if m not in done:
            visit(m, [m])
    assert cycles == []


def test_no_module_outside_tests_and_benchmarks_outgrows_one_job():
    files = [f for p in (*PACKAGES, "loadtest", "scripts") for f in (ROOT / p).rglob("*.py")]
    long = {str(f.relative_to(ROOT)): n for f in files if (n := len(f.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}
