"""`knnlm-index compact`: fold added shards and tombstones into a plain datastore.

Each live entry's key is read back from its shard as the index holds it (the stored fp16 keys
where the build kept them; else exact for flat shards, the decoded codes for PQ) and added, in
corpus order, to new evenly sized shards made from the datastore's trained quantizer. Forgotten
documents leave the index files, `documents.npy` and `provenance.json`; document numbers close
up. The manifest keeps the audit records of what was forgotten (`compactions`). Resumable and
atomic like `build`.
"""

from __future__ import annotations

import logging
import math
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
from tqdm import tqdm

from index_builder.add import quantizer_of
from index_builder.passages import kept_passages
from index_builder.shards import add_shards
from index_builder.versions import one_writer, prepare_workdir, publish, replace_array, workdir
from knnlm_core.datastore import file_entry, load_document_starts, read_manifest, write_manifest
from knnlm_core.errors import DatastoreError, ErrorKind
from knnlm_core.manifest import MANIFEST, QUANTIZER, CompactRecord, Manifest
from knnlm_core.provenance import PROVENANCE, DocumentTable
from knnlm_core.search import open_shards
from knnlm_core.tombstones import forgotten_entries, forgotten_share

logger = logging.getLogger("index_builder")

READ_BATCH = 65_536


def check_compactable(manifest: Manifest, name: str, shards: int | None) -> None:
    """Refuse, before any work, a compact that could only fail or make empty shards (the admin
    route asks this before it starts the job, and answers the request with it)."""
    live = manifest.entries - forgotten_entries(manifest)
    if shards is not None and shards > live:
        raise DatastoreError(
            f"shards: {shards} is more than the {live:,} entries {name} keeps after compacting: give at most {live}",
            ErrorKind.MALFORMED,
            "shards",
        )
    if not manifest.forgotten and not manifest.additions:
        raise DatastoreError(f"datastore {name} has no added shards and no forgotten documents: it is already compact")


@one_writer("path")
def compact_datastore(path: str | Path, shards: int | None = None, progress: bool = True, ray_address: str | None = None) -> Manifest:
    """Publish the datastore at `path` without tombstones, in `shards` shards (default: as many as
    its largest build shard's size needs); the new manifest."""
    started = time.monotonic()
    root = Path(path).resolve()
    manifest = read_manifest(root)
    check_compactable(manifest, root.name, shards)
    work = workdir(root)
    prepare_workdir(work, {"job": "compact", "base": manifest.checksum, "shards": shards})
    if not (work / MANIFEST).exists():
        searchers = open_shards(root, manifest, use_gpu=False)
        live = np.concatenate([s.keep if s.keep is not None else np.ones(s.ntotal, dtype=bool) for s in searchers])
        keys, values = _live_keys(work, root, manifest, searchers, live, progress)
        quantizer = quantizer_of(root, work, manifest)
        built = [s for s in manifest.shards if s.name not in {n for a in manifest.additions for n in a.shards}]
        count = shards or max(1, math.ceil(len(values) / max(s.entries for s in built)))
        keep_keys = manifest.shards[0].keys is not None
        if ray_address is not None:  # each shard added in a Ray task (its keys sent through Ray's object store)
            from index_builder.cluster import add_shards_on_ray, connect
            from index_builder.parts import shard_bounds

            connect(ray_address)
            with tqdm(total=len(values), unit="key", unit_scale=True, desc="add", disable=not progress) as bar:
                new_shards = add_shards_on_ray(work, keys, values, shard_bounds(len(values), count), work / QUANTIZER, keep_keys, bar)
        else:
            new_shards = add_shards(work, keys, values, work / QUANTIZER, count, keep_keys, progress)
        update = {"entries": len(values), "shards": new_shards, "quantizer": quantizer, "additions": [], "forgotten": []}
        if manifest.documents is not None and manifest.provenance is not None:
            starts = load_document_starts(root, manifest)
            kept = np.setdiff1d(np.arange(len(starts) - 1), [r.document for r in manifest.forgotten])
            lengths = np.diff(starts)[kept]
            replace_array(work / "documents.npy", np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
            DocumentTable.read(root / manifest.provenance.path).select(kept).write(work / PROVENANCE)
            update |= {
                "documents": file_entry(work, work / "documents.npy"),
                "provenance": file_entry(work, work / PROVENANCE),
                "passages": kept_passages(root, work, manifest, {int(old): new for new, old in enumerate(kept)}),
            }
        record = CompactRecord(
            at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            removed_entries=manifest.entries - len(values),
            tombstone_share=round(forgotten_share(manifest), 6),
            folded_additions=len(manifest.additions),
            forgotten=manifest.forgotten,
            seconds=round(time.monotonic() - started, 2),
        )
        write_manifest(work, manifest.model_copy(update={**update, "compactions": [*manifest.compactions, record]}))
    new = publish(work, root)
    logger.info("%s: compacted to %s entries in %d shard(s)", root, f"{new.entries:,}", len(new.shards))
    return new


def _live_keys(work: Path, root: Path, manifest: Manifest, searchers, live: np.ndarray, progress: bool):
    """The live entries' keys (an fp16 memmap in `work`) and values, in corpus order."""
    keys = np.lib.format.open_memmap(work / "live_keys.npy", mode="w+", dtype=np.float16, shape=(int(live.sum()), manifest.dim))
    values, row = [], 0
    bar = tqdm(total=len(keys), unit="key", unit_scale=True, desc="read", disable=not progress)
    for entry, searcher in zip(manifest.shards, searchers):
        stored = np.load(root / entry.keys.path, mmap_mode="r") if entry.keys is not None else None
        mask = live[searcher.first_id : searcher.first_id + searcher.ntotal]
        values.append(np.asarray(searcher.values)[mask])
        local = np.flatnonzero(mask)
        for start in range(0, len(local), READ_BATCH):
            batch = local[start : start + READ_BATCH]
            keys[row : row + len(batch)] = stored[batch] if stored is not None else searcher.reconstruct(batch)
            row += len(batch)
            bar.update(len(batch))
    bar.close()
    keys.flush()
    return keys, np.concatenate(values).astype(np.int32)
