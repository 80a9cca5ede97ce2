"""The embedded default datastore: documentation of the Python standard library.

Every machine with Python has this text offline, so `make serve` can build a real datastore on
first run without downloads. Each module's docstrings (module, public classes and functions) form
one document.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import tempfile
from pathlib import Path

from index_builder.build import build_datastore
from knnlm_core.config import BuildConfig
from knnlm_core.manifest import MANIFEST
from knnlm_core.model_dir import cache_dir, model_fingerprint

logger = logging.getLogger("index_builder")

MODULES = (
    "json",
    "argparse",
    "collections",
    "functools",
    "itertools",
    "pathlib",
    "dataclasses",
    "heapq",
    "bisect",
    "textwrap",
    "shlex",
    "csv",
    "statistics",
    "fractions",
    "decimal",
)
RECIPE = 10  # bumped when what the build stores changes (2: the skip rule; 3: documents.npy and the pointer rule; 4: provenance; 5: k chosen for cost; 6: pointer rule replayed at the served k; 7: passages; 8: the passage gate's chance queries; 9: phrase relevance and its gate on held-out questions; 10: the held-out documents stored too)


def module_documents(modules=MODULES) -> dict[str, str]:
    """Each importable module's documentation as one text: its docstring, then `module.name` and the
    docstring of every public class and function it defines."""
    documents = {}
    for name in modules:
        module = importlib.import_module(name)
        parts = [f"Module {name}\n\n{inspect.getdoc(module) or ''}"]
        for attr, obj in sorted(vars(module).items()):
            if attr.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                continue
            if (inspect.isclass(obj) or inspect.isfunction(obj)) and inspect.getdoc(obj):
                parts.append(f"{name}.{attr}\n\n{inspect.getdoc(obj)}")
        documents[name] = "\n\n".join(parts)
    return documents


def prepare_default_datastore(model_dir: Path) -> Path:
    """Build (first run only, with progress bars) and return the default datastore for this model."""
    out = cache_dir() / "datastores" / f"pydocs-r{RECIPE}-{model_fingerprint(model_dir)}"
    if (out / MANIFEST).exists():
        return out
    from filelock import FileLock

    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(out.with_name(f".{out.name}.lock")):  # one build at a time: a second caller waits for it
        if (out / MANIFEST).exists():
            return out
        logger.info("building the default datastore (Python standard-library docs) at %s", out)
        with tempfile.TemporaryDirectory() as tmp:
            for name, text in module_documents().items():
                (Path(tmp) / f"{name}.txt").write_text(text)
            build_datastore([tmp], out, model_dir, BuildConfig(index="flat"))
    return out
