"""`knnlm-index inspect` and `verify`: is the datastore intact, and does search find what it stored?"""

from __future__ import annotations

from pathlib import Path

import faiss
import numpy as np

from knnlm_core.datastore import read_manifest, verify_checksums
from knnlm_core.manifest import Manifest
from knnlm_core.provenance import Provenance
from knnlm_core.search import ShardSearcher, merge_topk, open_shards
from knnlm_core.tombstones import forgotten_share


def inspect_datastore(path: str | Path, checksums: bool = True) -> Manifest:
    manifest = read_manifest(path)
    if checksums:
        verify_checksums(path, manifest)
    return manifest


def provenance_summary(root: Path, manifest: Manifest) -> str:
    """One line on what the datastore can explain; raises when its document table is inconsistent."""
    if manifest.provenance is None:
        return "no provenance: serves, but cannot explain its neighbours (rebuild with knnlm-index build)"
    table = Provenance.open(root, manifest).table  # checks documents.npy, values and the table against each other
    forgotten = f" ({len(manifest.forgotten):,} forgotten, {forgotten_share(manifest):.2%} of the entries)" if manifest.forgotten else ""
    return f"provenance: {len(table):,} documents{forgotten} from {len(table.sources):,} source file(s) under {table.root}"


def stored_keys(root: Path, manifest: Manifest, shard_number: int, searcher: ShardSearcher, ids: np.ndarray) -> np.ndarray:
    """The keys of entries `ids`: the kept fp16 keys, else reconstructed from the index."""
    shard = manifest.shards[shard_number]
    if shard.keys is not None:
        return np.load(root / shard.keys.path, mmap_mode="r", allow_pickle=False)[ids].astype(np.float32)
    return searcher.reconstruct(ids)


TIED_DISTANCES_LIMIT = 0.5  # see verify_datastore


def verify_datastore(path: str | Path, samples: int = 1000, k: int = 8, nprobe: int | None = None, seed: int = 0) -> dict:
    """Search sampled stored keys. recall@1: the entry itself is (tied for) the nearest in its
    shard; value@1: the merged global top-1 carries the entry's own next token; distinct
    distances: the median share of distinct values among a sample's k neighbours' distances. A
    sound store's neighbours lie at distinct distances; an index whose quantizers were trained on
    an outlier key (`typical_keys`) returned one distance for all of them, which recall@1's "tied
    for" cannot see. `problems` lists what is wrong, empty when nothing is."""
    root = Path(path)
    manifest = read_manifest(root)
    searchers = open_shards(root, manifest, use_gpu=False)
    nprobe = nprobe or manifest.index.nprobe
    rng = np.random.default_rng(seed)
    hits, value_hits, top1_distances, distinct, total = 0, 0, [], [], 0
    per_shard = max(1, samples // len(searchers))
    for s, searcher in enumerate(searchers):
        live = np.flatnonzero(searcher.keep) if searcher.keep is not None else np.arange(searcher.ntotal)  # not forgotten
        if len(live) == 0:
            continue
        ids = np.sort(rng.choice(live, min(per_shard, len(live)), replace=False))
        queries = stored_keys(root, manifest, s, searcher, ids)
        params = faiss.SearchParametersIVF(nprobe=nprobe) if nprobe else None
        distances, found = searcher.index.search(queries, k, params=params)
        own = np.sum((queries - searcher.reconstruct(ids)) ** 2, axis=1)
        hits += int(np.sum((found[:, 0] == ids) | (distances[:, 0] >= own - 1e-4 * (1 + own))))
        _, tokens, _ = merge_topk([other.search(queries, k, nprobe) for other in searchers], k)
        value_hits += int(np.sum(tokens[:, 0] == searcher.values[ids]))
        top1_distances.append(distances[:, 0])
        distinct += [len(np.unique(row[hit >= 0])) / max(int(np.sum(hit >= 0)), 1) for row, hit in zip(distances, found)]
        total += len(ids)
    distinct_share = float(np.median(distinct))
    problems = []
    if distinct_share < TIED_DISTANCES_LIMIT:
        problems.append(
            f"a sampled key's {k} nearest neighbours come back at {distinct_share:.0%} distinct distances (median): "
            "the index's quantizers were trained on an outlier key (a build before knnlm-index left them out); "
            "rebuild it with `knnlm-index build --overwrite`"
        )
    return {
        "datastore": str(root),
        "provenance": provenance_summary(root, manifest),
        "samples": total,
        "recall_at_1": hits / total,
        "value_at_1": value_hits / total,
        "distinct_distances_at_k": distinct_share,
        "mean_top1_distance": float(np.mean(np.concatenate(top1_distances))),
        "index": manifest.index.factory,
        "nprobe": nprobe,
        "k": k,
        "problems": problems,
    }
