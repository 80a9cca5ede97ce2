"""The index half of a build: one quantizer trained on a sample of the keys, then the entries
added in contiguous shards, each to a clone of it. Each step leaves its result in the build's
work directory, so a rerun resumes."""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path

import faiss
import numpy as np
from tqdm import tqdm

from index_builder.faiss_index import DEFAULT_NPROBE, needs_training, train_index
from knnlm_core.config import BuildConfig
from knnlm_core.datastore import file_entry
from knnlm_core.files import write_json_atomic
from knnlm_core.manifest import ShardEntry
from knnlm_core.search import set_nprobe

logger = logging.getLogger("index_builder")

ADD_BATCH = 65_536


def train_once(work: Path, keys: np.ndarray, factory: str, config: BuildConfig, progress: bool) -> int:
    """The trained (empty) index in `work`, trained once on a sample of the keys; the keys it was trained on."""
    trained = work / "trained.faiss"
    if trained.exists():
        return json.loads((work / "trained.json").read_text())["train_size"]
    if not needs_training(factory, keys.shape[1]):
        faiss.write_index(faiss.index_factory(keys.shape[1], factory, faiss.METRIC_L2), str(trained))
        write_json_atomic(work / "trained.json", {"train_size": 0})
        return 0
    rng = np.random.default_rng(config.seed)
    n = min(len(keys), config.train_sample)
    sample = np.asarray(keys[np.sort(rng.choice(len(keys), n, replace=False))], dtype=np.float32)
    logger.info("train: %s on %s keys ...", factory, f"{n:,}")
    t0 = time.monotonic()
    index, trained_on = train_index(factory, sample, seed=config.seed)
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
    bounds = np.linspace(0, len(keys), count + 1).astype(np.int64)
    bar = tqdm(total=len(keys), unit="key", unit_scale=True, desc="add", disable=not progress)
    shards = []
    for s in range(count):
        lo, hi = int(bounds[s]), int(bounds[s + 1])
        name = f"shard-{first_number + s:03d}"
        final = work / name
        if not final.exists():
            tmp = work / f".{name}.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            index = faiss.read_index(str(trained))
            set_nprobe(index, DEFAULT_NPROBE)
            for start in range(lo, hi, ADD_BATCH):
                end = min(start + ADD_BATCH, hi)
                index.add(np.asarray(keys[start:end], dtype=np.float32))
                bar.update(end - start)
            faiss.write_index(index, str(tmp / "index.faiss"))
            np.save(tmp / "values.npy", np.asarray(values[lo:hi], dtype=np.int32))
            if keep_keys:
                np.save(tmp / "keys.npy", np.asarray(keys[lo:hi], dtype=np.float16))
            os.replace(tmp, final)
        else:
            bar.update(hi - lo)
        shards.append(
            ShardEntry(
                name=name,
                entries=hi - lo,
                index=file_entry(work, final / "index.faiss"),
                values=file_entry(work, final / "values.npy"),
                keys=file_entry(work, final / "keys.npy") if keep_keys else None,
            )
        )
    bar.close()
    return shards
