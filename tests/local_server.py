"""The server that tests/test_eval_tasks.py, tests/test_explain.py, tests/test_ui.py and
tests/test_tensor_parallel.py (its one-rank reference) share, started once for the four
(conftest's `local_server`): the local backend (no Ray), the page, and the admin API over one
datastore root.

Each module builds its datastores below the shared root and loads them through the admin API for
its own tests (`serving`), its own the default meanwhile, and unloads them after: what one module
loads, the next never sees. A server needs a datastore to start with kNN on: `base`, one sentence,
the default between modules."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import requests
from conftest import STRICT_KNN, TINY_SERVER

from index_builder.build import build_datastore
from knnlm_core.config import BuildConfig

TOKEN = "local-admin"
BASE = "The harbour master rings the bell twice when the fog comes in from the west."
# λ 1 unless a module's datastore is named here: test_explain's `docs`, test_eval_tasks' `facts`.
LAMBDAS = {"docs": 0.75, "facts": 0.25}


def config(root: Path, model: Path) -> dict:
    """The server's settings, its `base` datastore built below `root` first."""
    (root / "base.txt").write_text(BASE)
    build_datastore([root / "base.txt"], root / "base", model, BuildConfig(index="flat"), progress=False)
    knn = {
        "datastores": {"base": str(root / "base")},
        "backend": "local",
        "k": 8,
        "lambda": 1.0,
        "overrides": {name: {"lambda": value} for name, value in LAMBDAS.items()},
        "ui": True,
        "admin_token": TOKEN,
        "datastore_root": str(root),
        **STRICT_KNN,
    }
    return {**TINY_SERVER, "model": str(model), "knn": knn}


def folder_below_root(server, name: str) -> Path:
    """A new folder for one module's corpora and datastores, below the server's datastore root
    (where the admin API loads from)."""
    folder = Path(server.config["knn"]["datastore_root"]) / name
    folder.mkdir()
    return folder


def admin(server, method: str, route: str, **body) -> requests.Response:
    return requests.request(method, f"{server.base_url}/v1/knn{route}", json=body or None, headers={"X-Admin-Token": TOKEN}, timeout=120)


@contextlib.contextmanager
def serving(server, datastores: dict[str, Path], default: str) -> Iterator[None]:
    """`datastores` (name -> a folder below the server's root) loaded for a module's tests, `default`
    the default meanwhile; unloaded after, `base` the default again."""
    root = Path(server.config["knn"]["datastore_root"])
    try:
        for name, path in datastores.items():
            loaded = admin(server, "POST", "/datastores", name=name, path=str(path.relative_to(root)), default=name == default)
            assert loaded.status_code == 200, loaded.text
        yield
    finally:
        assert admin(server, "PUT", "/default", name="base").status_code == 200
        for name in datastores:
            unloaded = admin(server, "DELETE", f"/datastores/{name}")
            assert unloaded.status_code == 200, unloaded.text
