"""A build in parts: the corpus's windows cut into ranges, each encoded on its own (on a Ray worker
or in this process) into one file of fp16 keys in the build's work directory.

A part holds whole windows, a multiple of the batch size of them from window 0, so its forward
passes are the very batches a build in one process runs, and its keys are the same. Parts are cut
from the windows, shards from the entries: a shard reads its entries across the parts that hold
them (`PartKeys`). The training sample is whole windows chosen by the seed (`sample_windows`), so a
build that streams can encode the sample first and train before any part exists, and every kind of
build trains on the same keys.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from knnlm_core.windows import WindowPlan, plan_of

PARTS = "parts"  # the work directory's folder of part files


@dataclass(frozen=True)
class Part:
    number: int
    first_window: int
    last_window: int  # exclusive
    first_entry: int
    last_entry: int  # exclusive

    @property
    def entries(self) -> int:
        return self.last_entry - self.first_entry


def plan_parts(plan: WindowPlan, windows_per_part: int) -> list[Part]:
    """Consecutive ranges of `windows_per_part` windows (the last one shorter)."""
    offsets = plan.entry_offsets
    starts = range(0, len(plan.windows), windows_per_part)
    return [
        Part(
            n, w, min(w + windows_per_part, len(plan.windows)), int(offsets[w]), int(offsets[min(w + windows_per_part, len(plan.windows))])
        )
        for n, w in enumerate(starts)
    ]


def windows_per_part(entries_per_part: int, plan: WindowPlan, batch_size: int) -> int:
    """About `entries_per_part` entries of whole windows, a multiple of `batch_size` windows."""
    mean = max(plan.entries / max(len(plan.windows), 1), 1.0)
    return max(1, round(entries_per_part / mean / batch_size)) * batch_size


def shard_bounds(entries: int, count: int) -> np.ndarray:
    """Entry bounds of `count` contiguous shards of (nearly) equal size."""
    return np.linspace(0, entries, count + 1).astype(np.int64)


def sample_windows(entry_offsets: np.ndarray, size: int, seed: int) -> np.ndarray:
    """Windows (sorted) chosen by `seed`, whole, until they hold `size` entries; every window
    when the corpus has no more than that."""
    lengths = np.diff(entry_offsets)
    if size >= entry_offsets[-1]:
        return np.arange(len(lengths))
    order = np.random.default_rng(seed).permutation(len(lengths))
    covered = np.cumsum(lengths[order])
    return np.sort(order[: int(np.searchsorted(covered, size)) + 1])


def sample_entries(entry_offsets: np.ndarray, size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The training sample: its windows (`sample_windows`) and `size` of their entries, chosen by
    `seed` (sorted, global ids). With one entry per window (`entry_offsets` = 0..N), a plain
    random choice of entries."""
    windows = sample_windows(entry_offsets, size, seed)
    held = np.concatenate([np.arange(entry_offsets[w], entry_offsets[w + 1]) for w in windows]) if len(windows) else np.zeros(0, np.int64)
    if len(held) > size:
        held = np.sort(np.random.default_rng(seed + 1).choice(held, size, replace=False))
    return windows, held.astype(np.int64)


@dataclass(frozen=True)
class Job:
    """One worker's unit: the keys of these windows' entries, in order, into `file`."""

    file: Path
    windows: np.ndarray  # int64 window ids

    def fed_tokens(self, plan: WindowPlan) -> int:
        w = plan.windows[self.windows]
        return int((w[:, 2] - w[:, 0]).sum())


def part_path(work: Path, part: Part) -> Path:
    return work / PARTS / f"part-{part.number:06d}.npy"


def part_job(work: Path, part: Part) -> Job:
    return Job(part_path(work, part), np.arange(part.first_window, part.last_window, dtype=np.int64))


def encode_job(encoder, tokens: np.ndarray, plan: WindowPlan, job: Job, batch_size: int) -> np.ndarray:
    """The keys [entries of the job's windows, dim] (fp16), by `encoder` (a `KeyEncoder`), in
    batches of `batch_size` windows from the job's first."""
    from knnlm_core.keys import encode_windows

    sub = plan_of(plan.windows[job.windows])
    out = np.empty((sub.entries, encoder.dim), dtype=np.float16)
    encode_windows(encoder, tokens, sub, out, batch_size, progress=False)
    return out


def write_job(job: Job, keys: np.ndarray) -> None:
    """A job's keys, whole or not at all (renamed into place)."""
    tmp = job.file.with_name(f".{job.file.name}.tmp-{os.getpid()}")
    job.file.parent.mkdir(exist_ok=True)
    with open(tmp, "wb") as f:
        np.save(f, np.asarray(keys, dtype=np.float16))
    os.replace(tmp, job.file)


class PartKeys:
    """The keys of entries [first, last) read from the part files that hold them: an array to the
    trainer (sorted entry ids) and to the shard adder (slices), and picklable, for a Ray task."""

    def __init__(self, work: Path, parts: list[Part], dim: int, first: int = 0, last: int | None = None):
        self.work, self.dim = work, dim
        self.first, self.last = first, parts[-1].last_entry if last is None else last
        self.parts = [p for p in parts if p.last_entry > self.first and p.first_entry < self.last]
        self.starts = np.array([p.first_entry for p in self.parts], dtype=np.int64)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.last - self.first, self.dim)

    def __len__(self) -> int:
        return self.last - self.first

    def __getitem__(self, index) -> PartKeys | np.ndarray:
        """A slice: a view of those rows (read when it is made an array); entry ids (relative to
        the view's first row): their keys."""
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                raise IndexError("PartKeys takes a slice with step 1")
            return PartKeys(self.work, self.parts, self.dim, self.first + start, self.first + max(start, stop))
        ids = np.asarray(index, dtype=np.int64) + self.first
        out = np.empty((len(ids), self.dim), dtype=np.float16)
        which = np.searchsorted(self.starts, ids, side="right") - 1
        for i in np.unique(which):
            rows = which == i
            out[rows] = np.load(part_path(self.work, self.parts[i]), mmap_mode="r")[ids[rows] - self.starts[i]]
        return out

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        keys = self[np.arange(len(self))]
        return keys if dtype is None else keys.astype(dtype)
