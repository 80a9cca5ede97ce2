"""test_living_serving's server (conftest's `living_serving_start`, started ahead from the module
before it): a flat and an IVF-PQ datastore of two shards each, on Ray shard actors with two
replicas, the admin API on, following changes other processes make on disk."""

from __future__ import annotations

from pathlib import Path

from conftest import TINY_SERVER, admin_knn
from test_index_builder import write_corpus

from index_builder.build import build_datastore
from knnlm_core.config import BuildConfig

TOKEN = "s3cret"


def build(root: Path, model: Path) -> None:
    corpus = write_corpus(root / "corpus")
    config = BuildConfig(context_length=128, stride=64, shards=2, batch_size=4)
    for index in ("flat", "ivfpq"):
        build_datastore(
            [corpus], root / {"ivfpq": "pq"}.get(index, index), model, config.model_copy(update={"index": index}), progress=False
        )


def config(root: Path, model: Path) -> dict:
    """The server's settings over the datastores `build` makes below `root`."""
    knn = admin_knn(root, TOKEN, datastores={"flat": str(root / "flat"), "pq": str(root / "pq")}, replicas=2, follow_changes_s=1.0)
    return {**TINY_SERVER, "model": str(model), "knn": knn}
