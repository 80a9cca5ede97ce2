"""The server with tenants (knn.keys_file) that tests/test_tenants.py and tests/test_vector_stores.py
share, started once for both (conftest's `tenant_server`): their datastores, their keys in one keys
file, and the union of the settings each needs (drafts, the page, uploads of at most 64 KiB).

Tenants: two datastores hold the same opening sentence, each with its own continuation, so a
completion of it says which store its neighbours came from. Vector stores: Alice and Bob, a small
`main` store both may use, and a store of Alice's built offline before the server starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml
from conftest import STRICT_KNN, TINY_SERVER

from index_builder.build import build_datastore
from knnlm_core.config import BuildConfig
from knnlm_core.keys_file import key_hash

TOKEN = "admin-s3cret"
KEYS = {name: f"sk-knn-test-{name}" for name in ("a", "b", "gen", "rpm", "tpm", "old", "new", "alice", "bob")}
PREFIX = "The vault under the old lighthouse opens only when the keeper says the words"
ENDINGS = {
    "alpha": " zebra quartz maple lantern orbit velvet cobalt thistle ember falcon nimbus quill.",
    "beta": " copper willow seven harbour drum silent orchid marble tiger frost anchor plume.",
}
MAX_FILE_BYTES = 64 * 1024
OFFLINE = "The orchard gate at Brannock farm is painted a deep plum colour every second spring."


def grant(key_id: str, secret: str, datastores: dict, **more) -> dict:
    return {"id": key_id, "sha256": key_hash(secret), "datastores": datastores, **more}


ALL = ["generate", "explain", "documents"]
KEY_FILE = [
    grant("team-a", KEYS["a"], {"alpha": ALL}, default="alpha"),
    grant("team-b", KEYS["b"], {"beta": ALL}, default="beta"),
    grant("gen-only", KEYS["gen"], {"alpha": ["generate"]}),
    grant("per-minute", KEYS["rpm"], {"alpha": ["generate"]}, default="alpha", requests_per_minute=3),
    grant("tokens", KEYS["tpm"], {"alpha": ["generate"]}, default="alpha", tokens_per_minute=20),
    grant("expired", KEYS["old"], {"alpha": ALL}, default="alpha", expires="2020-01-01T00:00:00Z"),
    grant("alice", KEYS["alice"], {"main": ["generate"]}),
    grant("bob", KEYS["bob"], {"main": ["generate"]}),
]


def write_keys(path: Path, keys: list[dict]) -> None:
    """Replaced whole, as an operator's tool would (a new inode: the server sees the change at once)."""
    part = path.with_suffix(".part")
    part.write_text(yaml.safe_dump({"keys": keys}, sort_keys=False))
    part.replace(path)


def prepare(root: Path, model: Path) -> None:
    """The datastores, the keys file and Alice's offline-built store below `root` (the server's
    datastore root)."""
    flat = BuildConfig(index="flat", context_length=128, stride=64)
    for name, ending in ENDINGS.items():
        (corpus := root / f"{name}-corpus").mkdir()
        records = [
            {"id": f"{name}-vault", "text": PREFIX + ending},
            {"id": f"{name}-tide", "text": f"The {name} tide tables were mended before the boats went out again."},
        ]
        (corpus / "docs.jsonl").write_text("\n".join(json.dumps(r) for r in records))
        build_datastore([corpus], root / name, model, flat, progress=False)
    (corpus := root / "main-corpus").mkdir()
    (corpus / "docs.txt").write_text("The tide tables were mended before the boats went out again.\n")
    build_datastore([corpus], root / "main", model, flat, progress=False)
    write_keys(root / "keys.yaml", KEY_FILE)
    (folder := root / "offline-docs").mkdir()  # one file the store cannot take
    (folder / "orchard.md").write_text(OFFLINE)
    (folder / "photo.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)))
    built = subprocess.run(
        [sys.executable, "-m", "index_builder.cli", "vector-store", str(root), str(folder), "--name", "offline", "--owner", "alice"]
        + ["--model", str(model), "--index", "flat", "--context-length", "128", "--stride", "64", "--quiet"],
        capture_output=True,
        text=True,
    )
    assert built.returncode == 0, built.stderr[-2000:]
    assert "photo.png: left out (invalid_file)" in built.stderr and json.loads(built.stdout)["file_counts"]["completed"] == 1


def config(root: Path, model: Path) -> dict:
    knn = {
        "datastores": {name: str(root / name) for name in ("alpha", "beta", "main")},
        "default_datastore": "beta",  # team-a's requests that name none must not get the server's default
        "k": 8,
        "lambda": 1.0,
        "draft_tokens": 3,
        "keys_file": str(root / "keys.yaml"),
        "audit_log": str(root / "audit.jsonl"),
        "admin_token": TOKEN,
        "datastore_root": str(root),
        "files": {"max_file_bytes": MAX_FILE_BYTES},
        "ui": True,
        **STRICT_KNN,
    }
    return {**TINY_SERVER, "model": str(model), "knn": knn}
