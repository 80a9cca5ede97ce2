"""`knnlm-index add`: a new version of a datastore holding its entries and those of new documents.

Only the new documents are tokenized and encoded, with the datastore's own model, key type and
window plan; their entries go, in corpus order after the old ones, into new shards that are copies
of the datastore's trained quantizer. The old shard files are hard links, never rewritten;
`documents.npy` and `provenance.json` grow by the new documents, so pointer following and
explanations cover them. The calibration is kept (`--recalibrate` fits it again on the build's
held-out slice). Resumable and atomic like `build` (index_builder/versions.py).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from datetime import datetime, timezone
from pathlib import Path

import faiss
import numpy as np

from index_builder.corpus_keys import document_starts, encode_keys, load_tokenizer, tokenize_corpus
from index_builder.part_build import add_on_ray
from index_builder.passages import grown_passages, passage_rows
from index_builder.shards import add_shards
from index_builder.versions import link_version, one_writer, prepare_workdir, publish, read_with_documents, replace_array, workdir
from knnlm_core.config import BuildCluster, BuildConfig
from knnlm_core.corpus import find_files, no_text_error
from knnlm_core.datastore import check_compatible, file_entry, load_document_starts, write_manifest
from knnlm_core.errors import CorpusError, KnnlmError
from knnlm_core.files import write_json_atomic
from knnlm_core.keys import KeyEncoder
from knnlm_core.manifest import MANIFEST, QUANTIZER, AddRecord, Manifest
from knnlm_core.model_dir import model_fingerprint
from knnlm_core.provenance import PROVENANCE, DocumentTable, served_documents
from knnlm_core.windows import plan_windows, window_values

logger = logging.getLogger("index_builder")

SCRATCH = "added"  # the new documents' tokens and keys, inside the work directory until publish


@one_writer("path")
def add_documents(
    path: str | Path,
    inputs: list[str | Path],
    model_dir: Path,
    *,
    text_field: str = "text",
    batch_size: int | None = None,
    recalibrate: bool = False,
    cluster: BuildCluster = BuildCluster(),
    progress: bool = True,
) -> tuple[Manifest, AddRecord]:
    """Publish the datastore at `path` with the documents of `inputs` added (encoded here, or on
    the Ray cluster `cluster` names); the new manifest and its record."""
    started = time.monotonic()
    root, manifest = read_with_documents(path, "take new documents")
    check_compatible(manifest, fingerprint=model_fingerprint(model_dir), where=f"datastore {root.name}")
    files = find_files(inputs)
    keep_keys = manifest.shards[0].keys is not None
    config = BuildConfig(
        key_type=manifest.key_type,
        context_length=manifest.build.context_length,
        stride=manifest.build.stride,
        dtype=manifest.model.dtype,
        text_field=text_field,
        keep_keys=keep_keys,
        **({"batch_size": batch_size} if batch_size else {}),
    )
    work = workdir(root)
    identity = {"job": "add", "base": manifest.checksum, "files": [[str(f), f.stat().st_size, f.stat().st_mtime_ns] for f in files]}
    prepare_workdir(work, identity)
    scratch = work / SCRATCH
    scratch.mkdir(exist_ok=True)
    if not (work / MANIFEST).exists():
        corpus = tokenize_corpus(scratch, files, model_dir, config, progress)
        tokens, offsets = np.load(scratch / "tokens.npy", mmap_mode="r"), np.load(scratch / "doc_offsets.npy")
        plan = plan_windows(offsets, config.context_length, config.stride)
        if corpus.documents == 0 or plan.entries == 0:
            raise no_text_error(inputs, corpus.documents, corpus.skipped_files)
        refuse_duplicates(
            DocumentTable.read(root / manifest.provenance.path), manifest, DocumentTable.read(scratch / "corpus_documents.json")
        )
        link_version(root, work, manifest)
        quantizer = quantizer_of(root, work, manifest)
        count = math.ceil(plan.entries / max(s.entries for s in manifest.shards))
        first_number = max(int(s.name.rsplit("-", 1)[1]) for s in manifest.shards) + 1
        encode_started = time.monotonic()
        if cluster.ray_address is not None:
            new_shards = add_on_ray(scratch, work, tokens, plan, model_dir, config, cluster, manifest.dim, count, first_number, progress)
            encode_seconds = _recorded_seconds(scratch / "encode_seconds.json", time.monotonic() - encode_started)
        else:
            encode_keys(scratch, tokens, plan, KeyEncoder(model_dir, config.key_type, config.dtype), config, progress)
            encode_seconds = _recorded_seconds(scratch / "encode_seconds.json", time.monotonic() - encode_started)
            keys = np.load(scratch / "keys.npy", mmap_mode="r")
            new_shards = add_shards(
                work, keys, window_values(tokens, plan), work / QUANTIZER, count, keep_keys, progress, first_number=first_number
            )
        starts = load_document_starts(root, manifest)
        replace_array(work / "documents.npy", np.concatenate([starts, document_starts(offsets, manifest.entries)[1:]]))
        table = DocumentTable.read(root / manifest.provenance.path).extended(DocumentTable.read(scratch / "corpus_documents.json"))
        table.write(work / PROVENANCE)
        record = AddRecord(
            first_document=len(starts) - 1,
            documents=corpus.documents,
            entries=plan.entries,
            shards=[s.name for s in new_shards],
            sources=corpus.sources,
            seconds=round(time.monotonic() - started, 2),
            encode_seconds=round(encode_seconds, 2),
            at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        )
        rows = passage_rows(tokens, offsets, load_tokenizer(model_dir), first_document=len(starts) - 1)
        update = {
            "passages": grown_passages(root, work, manifest, rows),
            "entries": manifest.entries + plan.entries,
            "shards": [*manifest.shards, *new_shards],
            "quantizer": quantizer,
            "documents": file_entry(work, work / "documents.npy"),
            "provenance": file_entry(work, work / PROVENANCE),
            "additions": [*manifest.additions, record],
        }
        write_manifest(work, manifest.model_copy(update=update))
    new = publish(work, root)
    logger.info(
        "%s: added %d document(s), %s entries, in %d new shard(s)",
        root,
        new.additions[-1].documents,
        f"{new.additions[-1].entries:,}",
        len(new.additions[-1].shards),
    )
    if recalibrate:
        from index_builder.calibrate import recalibrate as fit_again

        try:
            new = fit_again(root, [], model_dir, config, progress)
        except KnnlmError as e:  # the add stands: say so, or a user would add the documents again
            raise KnnlmError(
                f"{root}: the documents were added, but recalibrating failed ({e}); "
                f"knnlm-index calibrate {root} TEXT... calibrates it on held-out text",
                e.kind,
            ) from None
    return new, new.additions[-1]


def refuse_duplicates(table: DocumentTable, manifest: Manifest, new: DocumentTable) -> None:
    """A document the datastore already serves (same text, by sha256) is not added twice: its
    entries would double its weight in p_kNN."""
    served = served_documents(table, manifest)
    for n, sha in enumerate(new.sha256):
        if sha in served:
            where = new.describe(n)
            line = f" line {where['line']}" if where["line"] else ""
            raise CorpusError(
                f"{Path(new.root) / where['source']}{line} is already in the datastore "
                f"as document {served[sha]} ({table.describe(served[sha])['source']}, same text): nothing was added; "
                "leave it out, or forget that document first to replace it"
            )


def quantizer_of(root: Path, work: Path, manifest: Manifest):
    """The trained, empty index new shards copy, in `work`: the datastore's own (linked), or, for
    a datastore built before it was kept, its first shard emptied (and kept from now on)."""
    if manifest.quantizer is not None:
        if not (work / QUANTIZER).exists():
            os.link(root / manifest.quantizer.path, work / QUANTIZER)
        return manifest.quantizer
    index = faiss.read_index(str(root / manifest.shards[0].index.path))
    index.reset()
    faiss.write_index(index, str(work / f".{QUANTIZER}.tmp"))
    (work / f".{QUANTIZER}.tmp").rename(work / QUANTIZER)
    return file_entry(work, work / QUANTIZER)


def _recorded_seconds(path: Path, seconds: float) -> float:
    """The encode's time, kept across a resumed run (a rerun finds the keys done in no time)."""
    if path.exists():
        return json.loads(path.read_text())["seconds"]
    write_json_atomic(path, {"seconds": seconds})
    return seconds
