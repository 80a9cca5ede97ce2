"""`knnlm-index build`: corpus -> tokens -> keys -> trained quantizer -> shards -> manifest.

The build runs in a hidden sibling directory `.<name>.partial` and is renamed into place only
after the manifest is written, so a killed build never leaves a directory that looks complete.
Each phase leaves a durable result there (tokens, keys written batch by batch with a progress
record, the trained index, finished shards), so rerunning the same command resumes. In one
process the keys go to one fp16 file (index_builder/corpus_keys.py); on a Ray cluster, or
streaming, they go in parts (index_builder/part_build.py). Either way the same windows are
trained on and the same shards come out.

`build_from_keys` is the second half on its own, for keys computed elsewhere (the benchmarks'
synthetic stores): the same training, sharding and manifest.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

import knnlm_core
from index_builder.calibrate import calibrate_on
from index_builder.corpus_keys import document_starts, encode_keys, load_tokenizer, tokenize_corpus
from index_builder.faiss_index import DEFAULT_NPROBE, checked_factory_string
from index_builder.part_build import index_in_parts, streams
from index_builder.parts import sample_entries
from index_builder.passages import build_passages
from index_builder.shards import add_shards, train_once
from index_builder.versions import prepare_workdir, publish, workdir
from knnlm_core.config import BuildCluster, BuildConfig, KeyType
from knnlm_core.corpus import find_files, no_text_error
from knnlm_core.datastore import file_entry, write_manifest
from knnlm_core.errors import ConfigError, CorpusError, DatastoreError, ModelError
from knnlm_core.heldout import MIN_HELDOUT_TOKENS, HeldOut, heldout_entries, split_heldout
from knnlm_core.keys import KeyEncoder, model_shape
from knnlm_core.manifest import (
    MANIFEST,
    QUANTIZER,
    BuildStats,
    CorpusStats,
    HeldOutDocument,
    IndexSpec,
    Manifest,
    ModelIdentity,
    ShardEntry,
)
from knnlm_core.model_dir import check_model_dir, model_fingerprint
from knnlm_core.provenance import PROVENANCE, DocumentTable
from knnlm_core.windows import plan_windows, window_values

logger = logging.getLogger("index_builder")


def build_datastore(
    inputs: list[str | Path],
    output: str | Path,
    model_dir: str | Path,
    config: BuildConfig = BuildConfig(),
    *,
    cluster: BuildCluster = BuildCluster(),
    overwrite: bool = False,
    progress: bool = True,
) -> Manifest:
    """A datastore of `inputs` at `output`: encoded here, or on the Ray cluster `cluster` names,
    its keys streamed where `cluster` says so or they would pass its disk budget."""
    started = time.monotonic()
    output = Path(output).resolve()
    model_dir = check_model_dir(model_dir)
    _check_output(output, overwrite)
    files = find_files(inputs)
    if cluster.ray_address is not None:  # an unreachable cluster is refused before anything is written
        from index_builder.cluster import connect

        connect(cluster.ray_address)
    work = workdir(output)
    prepare_workdir(
        work,
        {
            "files": [[str(f), f.stat().st_size, f.stat().st_mtime_ns] for f in files],
            "model": model_fingerprint(model_dir),
            "config": config.model_dump(mode="json"),
        },
    )
    if not (work / MANIFEST).exists():
        try:  # input errors surface here, before any expensive work: leave nothing behind
            corpus = tokenize_corpus(work, files, model_dir, config, progress)
            tokens, offsets = np.load(work / "tokens.npy", mmap_mode="r"), np.load(work / "doc_offsets.npy")
            heldout = split_heldout(tokens, offsets) if config.calibrate else None
            table = DocumentTable.read(work / "corpus_documents.json")
            plan = plan_windows(offsets, config.context_length, config.stride)
            if plan.entries == 0:
                raise no_text_error(inputs, corpus.documents, corpus.skipped_files)
            if config.shards > plan.entries:
                raise CorpusError(f"--shards {config.shards} is more than the {plan.entries} entries of this corpus")
            dim, vocab = model_shape(model_dir, config.key_type)
            factory = checked_factory_string(config.index, plan.entries, dim, config.pca_dim)
            stream = streams(cluster, plan.entries, dim, work)
            encoder = None if cluster.ray_address is not None or stream else KeyEncoder(model_dir, config.key_type, config.dtype)
        except (ConfigError, CorpusError, ModelError):
            shutil.rmtree(work)
            raise
        if encoder is None:
            train_size, shards, encode_rate = index_in_parts(work, tokens, plan, model_dir, config, cluster, factory, dim, stream, progress)
        else:
            encode_rate = encode_keys(work, tokens, plan, encoder, config, progress)
            del encoder  # free the model's memory before training and adding
            keys = np.load(work / "keys.npy", mmap_mode="r")
            train_size, shards = _index_keys(work, keys, window_values(tokens, plan), plan.entry_offsets, factory, config, progress)
        model = ModelIdentity(
            name=model_dir.name, fingerprint=model_fingerprint(model_dir), hidden_size=dim, vocab_size=vocab, dtype=config.dtype
        )
        stats = {"context_length": config.context_length, "stride": config.stride, "encode_tokens_per_s": encode_rate}
        manifest = _manifest(work, model, factory, train_size, shards, plan.entries, dim, config.key_type, corpus, stats, started)
        starts = document_starts(offsets)
        np.save(work / "documents.npy", starts)
        table.write(work / PROVENANCE)
        manifest = manifest.model_copy(
            update={
                "documents": file_entry(work, work / "documents.npy"),
                "provenance": file_entry(work, work / PROVENANCE),
                "passages": build_passages(work, tokens, offsets, load_tokenizer(model_dir), heldout),
                "calibration_documents": heldout_documents(table, heldout) if heldout is not None else [],
            }
        )
        calibration_started = time.monotonic()
        if heldout is not None:
            logger.info("calibrating on %s, which the datastore stores but the calibration's searches leave out", heldout.description)
            calibration = calibrate_on(
                work,
                manifest,
                model_dir,
                heldout.tokens,
                heldout.offsets,
                f"build: {heldout.description}",
                config,
                progress,
                excluded=heldout_entries(starts, heldout.spans),
            )
            note = None
        else:
            calibration = None
            note = (
                "built with --no-calibrate"
                if not config.calibrate
                else (
                    f"the corpus ({corpus.tokens:,} tokens) is too small to hold out a calibration slice of {MIN_HELDOUT_TOKENS:,} tokens "
                    "(10%): calibrated on nothing, so requests get the server's config defaults; calibrate it on other text with "
                    "`knnlm-index calibrate`"
                )
            )
            if config.calibrate:
                logger.warning(note)
        build = manifest.build.model_copy(
            update={
                "calibration_seconds": round(time.monotonic() - calibration_started, 2),
                "seconds": round(time.monotonic() - started, 2),
            }
        )
        write_manifest(work, manifest.model_copy(update={"calibration": calibration, "calibration_note": note, "build": build}))
    return _publish(work, output, progress)


def heldout_documents(table: DocumentTable, heldout: HeldOut) -> list[HeldOutDocument]:
    """The manifest's record of the documents a build calibrated on (`table`: the whole corpus's)."""
    return [
        HeldOutDocument(document=d, source=table.describe(d)["source"], sha256=table.sha256[d], tokens=(a, b)) for d, a, b in heldout.spans
    ]


def build_from_keys(
    keys: np.ndarray,
    values: np.ndarray,
    output: str | Path,
    model: ModelIdentity,
    config: BuildConfig = BuildConfig(),
    *,
    source: str,
    overwrite: bool = False,
    progress: bool = True,
) -> Manifest:
    """A datastore over keys [N, dim] (array or memmap) and their values [N] computed elsewhere."""
    started = time.monotonic()
    output = Path(output).resolve()
    _check_output(output, overwrite)
    if len(keys) != len(values) or len(keys) == 0:
        raise DatastoreError(f"build_from_keys needs as many values as keys, at least one: got {len(keys)} keys, {len(values)} values")
    work = workdir(output)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    corpus = CorpusStats(sources=[source], documents=0, tokens=len(keys))
    stats = {"context_length": 0, "stride": 0, "encode_tokens_per_s": 0.0}
    factory = checked_factory_string(config.index, len(keys), keys.shape[1], config.pca_dim)
    one_per_window = np.arange(len(keys) + 1)  # every key its own window: the sample is a random choice of keys
    train_size, shards = _index_keys(work, keys, np.asarray(values, dtype=np.int32), one_per_window, factory, config, progress)
    manifest = _manifest(work, model, factory, train_size, shards, len(keys), keys.shape[1], config.key_type, corpus, stats, started)
    write_manifest(work, manifest.model_copy(update={"calibration_note": "built from keys: no text to calibrate on"}))
    return _publish(work, output, progress)


def _index_keys(
    work: Path, keys, values, entry_offsets: np.ndarray, factory: str, config: BuildConfig, progress: bool
) -> tuple[int, list[ShardEntry]]:
    """Train the quantizer on the sample of the windows at `entry_offsets` and add the shards
    (each phase resumable in `work`); the number of keys trained on and the shards."""
    _, sample = sample_entries(entry_offsets, config.train_sample, config.seed)
    train_size = train_once(work, factory, keys.shape[1], lambda: keys[sample], config.seed)
    return train_size, add_shards(work, keys, values, work / "trained.faiss", config.shards, config.keep_keys, progress)


def _manifest(
    work: Path,
    model: ModelIdentity,
    factory: str,
    train_size: int,
    shards: list[ShardEntry],
    entries: int,
    dim: int,
    key_type: KeyType,
    corpus: CorpusStats,
    stats: dict,
    started: float,
) -> Manifest:
    """The manifest of the trained, added shards in `work` (keeping the trained quantizer: `knnlm-index add`
    puts new entries in copies of it)."""
    if not (work / QUANTIZER).exists():
        os.link(work / "trained.faiss", work / QUANTIZER)
    return Manifest(
        model=model,
        key_type=key_type,
        dim=dim,
        index=IndexSpec(factory=factory, nprobe=DEFAULT_NPROBE if "IVF" in factory else None, train_size=train_size),
        quantizer=file_entry(work, work / QUANTIZER),
        entries=entries,
        shards=shards,
        corpus=corpus,
        build=BuildStats(
            context_length=stats["context_length"],
            stride=stats["stride"],
            seconds=round(time.monotonic() - started, 2),
            encode_tokens_per_s=round(stats["encode_tokens_per_s"], 1),
            created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            tool_version=knnlm_core.__version__,
        ),
    )


def _check_output(output: Path, overwrite: bool) -> None:
    if not output.exists() or overwrite:
        return
    if (output / MANIFEST).exists():
        raise DatastoreError(f"{output} already holds a datastore; pass --overwrite to replace it")
    if not output.is_dir() or any(output.iterdir()):
        raise DatastoreError(f"{output} exists and is not an empty directory; choose another output or pass --overwrite")


def _publish(work: Path, output: Path, progress: bool) -> Manifest:
    manifest = publish(work, output)
    (logger.info if progress else logger.debug)(
        "%s: %s entries in %d shard(s), %s, key %s (dim %d), %d documents, %.1f s",
        output,
        f"{manifest.entries:,}",
        len(manifest.shards),
        manifest.index.factory,
        manifest.key_type,
        manifest.dim,
        manifest.corpus.documents,
        manifest.build.seconds,
    )
    return manifest
