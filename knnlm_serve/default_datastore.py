"""The embedded default datastore: documentation of the Python standard library.

Every machine with Python has this text offline, so `make serve` can build a real datastore on
first run without downloads. Each module's docstrings (module, public classes and functions) form
one document.
"""

from __future__ import annotations

import importlib
import inspect
import tempfile
from pathlib import Path

from knnlm_serve.config import BuildConfig
from knnlm_serve.datastore import MANIFEST
from knnlm_serve.model import cache_dir, model_fingerprint

MODULES = (
    "json", "argparse", "collections", "functools", "itertools", "pathlib", "dataclasses",
    "heapq", "bisect", "textwrap", "shlex", "csv", "statistics", "fractions", "decimal",
)


def stdlib_documents(modules=MODULES) -> dict[str, str]:
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
    out = cache_dir() / "datastores" / f"pydocs-{model_fingerprint(model_dir)}"
    if (out / MANIFEST).exists():
        return out
    from index_builder.build import build_datastore

    print(f"knnlm-serve: building the default datastore (Python standard-library docs) at {out}")
    with tempfile.TemporaryDirectory() as tmp:
        for name, text in stdlib_documents().items():
            (Path(tmp) / f"{name}.txt").write_text(text)
        build_datastore([tmp], out, model_dir, BuildConfig(index="flat"))
    return out
