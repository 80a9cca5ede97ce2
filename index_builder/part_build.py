"""The index half of a build in parts (index_builder/parts.py): on a Ray cluster (`--ray`), or
streaming (`--stream`), or both.

Without streaming every part is encoded first, then the quantizer is trained on the sample read
from the parts and the shards are added (in parallel Ray tasks on a cluster). Streaming, no file
of the whole corpus's keys ever exists: the sample's windows are encoded and trained on first
(and deleted), then the parts of as many shards as the disk budget holds (one, with --stream
alone) are encoded, those shards are added, and the parts no later shard reads are deleted, so
the disk holds the index, the values and that many shards' keys. Every step
leaves its result in the work directory (parts, the trained index, finished shards), so a rerun of
the same command resumes.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from index_builder.parts import (
    PARTS,
    Job,
    Part,
    PartKeys,
    encode_job,
    part_job,
    plan_parts,
    sample_entries,
    shard_bounds,
    windows_per_part,
    write_job,
)
from index_builder.shards import add_shard, train_once
from knnlm_core.config import BuildCluster, BuildConfig
from knnlm_core.files import write_json_atomic
from knnlm_core.manifest import QUANTIZER, ShardEntry
from knnlm_core.windows import WindowPlan, window_values

logger = logging.getLogger("index_builder")

SAMPLE = "sample"  # the work directory's folder of the training sample's keys, while streaming


def key_budget(cluster: BuildCluster, work: Path) -> float:
    """Bytes of keys the build may hold on disk: `disk_budget_gib`, else half the free space."""
    return cluster.disk_budget_gib * 2**30 if cluster.disk_budget_gib else shutil.disk_usage(work).free / 2


def streams(cluster: BuildCluster, entries: int, dim: int, work: Path) -> bool:
    """Whether this build streams: as asked, else when its fp16 keys would pass the disk budget."""
    if cluster.stream is not None:
        return cluster.stream
    need, budget = entries * dim * 2, key_budget(cluster, work)
    if need > budget:
        logger.info(
            "build: the keys would take %.1f GiB, more than the disk budget of %.1f GiB: streaming them", need / 2**30, budget / 2**30
        )
    return need > budget


def shards_at_once(cluster: BuildCluster, shard_bytes: int, work: Path) -> int:
    """How many shards' keys a streamed build encodes before it adds them: as many as the disk
    budget holds (one, with --stream and no budget given), each encode one start of the workers."""
    if cluster.stream and not cluster.disk_budget_gib:
        return 1
    budget = key_budget(cluster, work)
    if shard_bytes > budget:
        logger.warning(
            "build: one shard's keys (%.1f GiB) pass the disk budget (%.1f GiB): give --shards more shards",
            shard_bytes / 2**30,
            budget / 2**30,
        )
    return max(1, int(budget // max(shard_bytes, 1)))


class LocalEncoder:
    """Encodes jobs in this process, one after the other."""

    def __init__(self, model_dir: Path, config: BuildConfig, plan: WindowPlan, tokens: np.ndarray):
        from knnlm_core.keys import KeyEncoder

        self.encoder = KeyEncoder(model_dir, config.key_type, config.dtype)
        self.config, self.plan, self.tokens, self.workers = config, plan, tokens, 1

    def run(self, jobs: list[Job], bar: tqdm) -> None:
        for job in jobs:
            write_job(job, encode_job(self.encoder, self.tokens, self.plan, job, self.config.batch_size))
            bar.update(job.fed_tokens(self.plan))


def index_in_parts(
    work: Path,
    tokens: np.ndarray,
    plan: WindowPlan,
    model_dir: Path,
    config: BuildConfig,
    cluster: BuildCluster,
    factory: str,
    dim: int,
    stream: bool,
    progress: bool,
) -> tuple[int, list[ShardEntry], float]:
    """Train and add the shards in `work`; the number of keys trained on, the shards and the
    encode's tokens/s."""
    if cluster.ray_address is not None:
        from index_builder.cluster import RayEncoder, add_shards_on_ray

        encoder = RayEncoder(work, model_dir, config, cluster, plan, tokens)
    else:
        encoder = LocalEncoder(model_dir, config, plan, tokens)
    per = _windows_per_part(work, cluster, plan, config.batch_size, encoder.workers)
    parts = plan_parts(plan, per)
    sample_windows, sample = sample_entries(plan.entry_offsets, config.train_sample, config.seed)
    bounds = shard_bounds(plan.entries, config.shards)
    names = [f"shard-{s:03d}" for s in range(config.shards)]
    trained = work / "trained.faiss"
    pieces = []
    if stream and not trained.exists():
        pieces = [Job(work / SAMPLE / f"piece-{i // per:06d}.npy", sample_windows[i : i + per]) for i in range(0, len(sample_windows), per)]

    def added_already(part: Part) -> bool:  # every shard that reads it is added
        return all((work / names[s]).exists() for s in _shards_of(part, bounds))

    to_encode = [j for j in pieces if not j.file.exists()] + [
        part_job(work, p) for p in parts if not part_job(work, p).file.exists() and not added_already(p)
    ]
    bar = tqdm(total=sum(j.fed_tokens(plan) for j in to_encode), unit="tok", unit_scale=True, desc="encode", disable=not progress)
    encoding = _Timed(encoder, bar, plan)
    keys = PartKeys(work, parts, dim)
    values = window_values(tokens, plan)

    def add(first: int, last: int, bar: tqdm) -> list[ShardEntry]:
        """Shards [first, last): in Ray tasks on a cluster, else here."""
        if cluster.ray_address is not None:
            return add_shards_on_ray(work, keys, values, bounds[first : last + 1], trained, config.keep_keys, bar, first_number=first)
        return [
            add_shard(
                work, names[s], keys[bounds[s] : bounds[s + 1]], values[bounds[s] : bounds[s + 1]], trained, config.keep_keys, bar.update
            )
            for s in range(first, last)
        ]

    if not stream:
        encoding.run(to_encode)
        train_size = train_once(work, factory, dim, lambda: keys[sample], config.seed)
        bar.close()
        with tqdm(total=plan.entries, unit="key", unit_scale=True, desc="add", disable=not progress) as added:
            shards = add(0, config.shards, added)
        return train_size, shards, encoding.rate()
    encoding.run([j for j in to_encode if j.file.parent.name == SAMPLE])
    train_size = train_once(work, factory, dim, lambda: _sample_keys(pieces, plan, sample_windows, sample), config.seed)
    shutil.rmtree(work / SAMPLE, ignore_errors=True)
    shards = []
    group = shards_at_once(cluster, int(max(np.diff(bounds))) * dim * 2, work)
    with tqdm(total=plan.entries, unit="key", unit_scale=True, desc="add", disable=not progress, position=1) as added:
        for first in range(0, config.shards, group):
            last = min(first + group, config.shards)
            needed = [p for p in parts if set(_shards_of(p, bounds)) & set(range(first, last))]
            encoding.run([part_job(work, p) for p in needed if not part_job(work, p).file.exists() and not added_already(p)])
            shards += add(first, last, added)
            for p in needed:
                if p.last_entry <= bounds[last]:  # no later shard reads it
                    part_job(work, p).file.unlink(missing_ok=True)
    bar.close()
    shutil.rmtree(work / PARTS, ignore_errors=True)
    return train_size, shards, encoding.rate()


def add_on_ray(
    scratch: Path,
    work: Path,
    tokens: np.ndarray,
    plan: WindowPlan,
    model_dir: Path,
    config: BuildConfig,
    cluster: BuildCluster,
    dim: int,
    count: int,
    first_number: int,
    progress: bool,
) -> list[ShardEntry]:
    """`knnlm-index add --ray`: the new documents' parts encoded on the cluster (in `scratch`),
    then `count` new shards, numbered from `first_number`, added in Ray tasks to copies of the
    datastore's quantizer in `work`."""
    from index_builder.cluster import RayEncoder, add_shards_on_ray

    encoder = RayEncoder(scratch, model_dir, config, cluster, plan, tokens)
    parts = plan_parts(plan, _windows_per_part(scratch, cluster, plan, config.batch_size, encoder.workers))
    jobs = [part_job(scratch, p) for p in parts if not part_job(scratch, p).file.exists()]
    with tqdm(total=sum(j.fed_tokens(plan) for j in jobs), unit="tok", unit_scale=True, desc="encode", disable=not progress) as bar:
        encoder.run(jobs, bar)
    with tqdm(total=plan.entries, unit="key", unit_scale=True, desc="add", disable=not progress) as bar:
        keys, bounds = PartKeys(scratch, parts, dim), shard_bounds(plan.entries, count)
        return add_shards_on_ray(work, keys, window_values(tokens, plan), bounds, work / QUANTIZER, config.keep_keys, bar, first_number)


def _windows_per_part(work: Path, cluster: BuildCluster, plan: WindowPlan, batch_size: int, workers: int) -> int:
    """Windows per part: about `part_entries` entries, or fewer so that each worker gets four parts
    at least; chosen once per build (recorded in the work directory), so a rerun with other
    workers reads the parts it finds as what they are."""
    record = work / "parts.json"
    if record.exists():
        return json.loads(record.read_text())["windows_per_part"]
    entries = min(cluster.part_entries, max(1, math.ceil(plan.entries / (4 * workers))))
    per = windows_per_part(entries, plan, batch_size)
    write_json_atomic(record, {"windows_per_part": per})
    return per


def _shards_of(part: Part, bounds: np.ndarray) -> range:
    """The shards whose entries the part holds some of."""
    first = int(np.searchsorted(bounds, part.first_entry, side="right")) - 1
    last = int(np.searchsorted(bounds, part.last_entry, side="left"))
    return range(max(first, 0), min(last, len(bounds) - 1))


def _sample_keys(pieces: list[Job], plan: WindowPlan, windows: np.ndarray, sample: np.ndarray) -> np.ndarray:
    """The sample's keys, from the pieces that hold every entry of its windows in order."""
    offsets = plan.entry_offsets
    held = np.concatenate([np.arange(offsets[w], offsets[w + 1]) for w in windows])
    return np.concatenate([np.load(j.file) for j in pieces])[np.searchsorted(held, sample)]


class _Timed:
    """An encoder's runs, with the tokens and seconds they took."""

    def __init__(self, encoder, bar: tqdm, plan: WindowPlan):
        self.encoder, self.bar, self.plan, self.seconds, self.tokens = encoder, bar, plan, 0.0, 0

    def run(self, jobs: list[Job]) -> None:
        began = time.monotonic()
        self.encoder.run(jobs, self.bar)
        self.seconds += time.monotonic() - began
        self.tokens += sum(j.fed_tokens(self.plan) for j in jobs)

    def rate(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)
