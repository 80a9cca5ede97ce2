"""The index half of a build: one quantizer trained on a sample of the keys, then the entries
added in contiguous shards, each to a clone of it. Each step leaves its result in the build's
work directory, so a rerun resumes."""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import faiss
import numpy as np
from tqdm import tqdm

from index_builder.faiss_index import DEFAULT_NPROBE, needs_training, train_index
from index_builder.parts import shard_bounds
from knnlm_core.datastore import file_entry
from knnlm_core.files import write_json_atomic
from knnlm_core.manifest import ShardEntry
from knnlm_core.search import set_nprobe

logger = logging.getLogger("index_builder")

ADD_BATCH = 65_536


def train_once(work: Path, factory: str, dim: int, sample: Callable[[], np.ndarray], seed: int) -> int:
    """The trained (empty) index in `work`, trained once on the keys `sample()` reads (called only
    when it is not trained yet); the number of keys it was trained on."""
    trained = work / "trained.faiss"
    if trained.exists():
        return json.loads((work / "trained.json").read_text())["train_size"]
    if not needs_training(factory, dim):
        faiss.write_index(faiss.index_factory(dim, factory, faiss.METRIC_L2), str(trained))
        write_json_atomic(work / "trained.json", {"train_size": 0})
        return 0
    keys = np.asarray(sample(), dtype=np.float32)
    logger.info("train: %s on %s keys ...", factory, f"{len(keys):,}")
    t0 = time.monotonic()
    index, trained_on = train_index(factory, keys, seed=seed)
    faiss.write_index(index, str(work / ".trained.faiss.tmp"))
    os.replace(work / ".trained.faiss.tmp", trained)
    write_json_atomic(work / "trained.json", {"train_size": trained_on})
    logger.info("train: done in %.1f s", time.monotonic() - t0)
    return trained_on


def add_shards(
    work: Path, keys: np.ndarray, values: np.ndarray, trained: Path, count: int, keep_keys: bool, progress: bool, first_number: int = 0
) -> list[ShardEntry]:
    """Split the entries evenly into `count` contiguous shards, numbered from `first_number`; each
    is added to a copy of the `trained` (empty) index."""
    bounds = shard_bounds(len(keys), count)
    bar = tqdm(total=len(keys), unit="key", unit_scale=True, desc="add", disable=not progress)
    shards = []
    for s in range(count):
        lo, hi = int(bounds[s]), int(bounds[s + 1])
        shards.append(add_shard(work, f"shard-{first_number + s:03d}", keys[lo:hi], values[lo:hi], trained, keep_keys, bar.update))
    bar.close()
    return shards


def add_shard(
    work: Path, name: str, keys, values: np.ndarray, trained: Path, keep_keys: bool, added: Callable[[int], object] | None = None
) -> ShardEntry:
    """`keys` (an array, memmap or `PartKeys`) and their `values` as the shard `name` in `work`,
    added to a copy of the `trained` index; kept if it is there already. `added(n)` is told of
    each batch added."""
    added = added or (lambda n: None)
    final = work / name
    if not final.exists():
        tmp = work / f".{name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        index = faiss.read_index(str(trained))
        set_nprobe(index, DEFAULT_NPROBE)
        for start in range(0, len(keys), ADD_BATCH):
            end = min(start + ADD_BATCH, len(keys))
            index.add(np.asarray(keys[start:end], dtype=np.float32))
            added(end - start)
        faiss.write_index(index, str(tmp / "index.faiss"))
        np.save(tmp / "values.npy", np.asarray(values, dtype=np.int32))
        if keep_keys:
            np.save(tmp / "keys.npy", np.asarray(keys, dtype=np.float16))
        os.replace(tmp, final)
    else:
        added(len(keys))
    return ShardEntry(
        name=name,
        entries=len(keys),
        index=file_entry(work, final / "index.faiss"),
        values=file_entry(work, final / "values.npy"),
        keys=file_entry(work, final / "keys.npy") if keep_keys else None,
    )
