"""`knnlm-index forget`: a new version of a datastore without some of its documents.

Each forgotten document's entries become tombstones (knnlm_core/tombstones.py): no search or
pointer lookup finds them again. Their stored tokens (values, kept keys, the document's first
token) are overwritten in new files, so neither the documents route nor a snippet can show the
text, and its passages leave the passage index (written anew without them). The index files
keep their codes until `knnlm-index compact`, unless `erase` takes them out
now (index_builder/erase.py), in the same new version. Either way, the server's own copies of the
document's text (knnlm_core/added_texts.py) are erased; the user's own source files are not
touched. The manifest keeps an audit record of each: the document, its source, the sha256 of its
text, when, and what was erased.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from datetime import datetime, timezone
from pathlib import Path

import faiss
import numpy as np

from index_builder.erase import check_erasable, erase_entries
from index_builder.passages import kept_passages
from index_builder.versions import link_version, one_writer, prepare_workdir, publish, read_with_documents, replace_array, workdir
from knnlm_core.added_texts import erase_records, is_server_copy
from knnlm_core.datastore import file_entry, load_document_starts, write_manifest
from knnlm_core.errors import DatastoreError, ErrorKind
from knnlm_core.manifest import ForgetRecord, Manifest
from knnlm_core.provenance import PROVENANCE, DocumentTable, source_name
from knnlm_core.search import shard_first_ids

logger = logging.getLogger("index_builder")


def find_documents(
    table: DocumentTable, *, documents: Iterable[int] = (), sources: Iterable[str] = (), ids: Iterable[str] = ()
) -> list[int]:
    """The documents named by number, by source file (as listed, or a path to it) or by .jsonl id;
    an error naming any that matches nothing."""
    found: set[int] = set()
    for document in documents:
        if not 0 <= document < len(table):
            raise DatastoreError(
                f"document {document} does not exist: the datastore has documents 0..{len(table) - 1}", ErrorKind.NOT_FOUND
            )
        found.add(document)
    for source in sources:
        number = _source_number(table, source)
        found.update(d for d, s in enumerate(table.source) if s == number)
    for wanted in ids:
        matches = [d for d, i in enumerate(table.id) if i == wanted]
        if not matches:
            raise DatastoreError(f"no document has id {wanted!r}", ErrorKind.NOT_FOUND)
        found.update(matches)
    if not found:
        raise DatastoreError("name the documents to forget: --document N, --source PATH or --id ID", ErrorKind.MALFORMED)
    return sorted(found)


def _source_number(table: DocumentTable, source: str) -> int:
    """The table's number for `source`: a name as the table lists it, or a path to the file
    (absolute, or from the working directory)."""
    names = [] if os.path.isabs(source) else [source]
    if os.path.isabs(source) or os.path.exists(source):
        names.append(source_name(table.root, os.path.realpath(source)))
    for name in names:
        if name in table.sources:
            return table.sources.index(name)
    alike = [s for s in table.sources if os.path.basename(s) == os.path.basename(source)]
    listed = (
        f"sources with that file name: {alike}" if alike else f"the datastore's {len(table.sources)} sources include {table.sources[:10]}"
    )
    raise DatastoreError(f"no document comes from source {source!r}; {listed}", ErrorKind.NOT_FOUND)


@one_writer("path")
def forget_documents(
    path: str | Path,
    *,
    documents: Iterable[int] = (),
    sources: Iterable[str] = (),
    ids: Iterable[str] = (),
    erase: bool = False,
) -> tuple[Manifest, list[ForgetRecord]]:
    """Publish the datastore at `path` without the named documents (with `erase`, without their
    codes in the index files either; that also erases the codes of documents forgotten before);
    the new manifest and the audit records it wrote."""
    started = time.monotonic()
    root, manifest = read_with_documents(path, "forget documents")
    table = DocumentTable.read(root / manifest.provenance.path, manifest.model.vocab_size)
    starts = load_document_starts(root, manifest)
    chosen = find_documents(table, documents=documents, sources=sources, ids=ids)
    already = {r.document: r for r in manifest.forgotten}
    again = [already[d] for d in chosen if d in already]  # forgotten before: with `erase`, their codes are erased now
    if again and (not erase or again[0].erased_codes):
        done = "forgotten and erased" if again[0].erased_codes else "forgotten (its codes stay until compact, or erase them with --erase)"
        raise DatastoreError(f"document {again[0].document} was already {done} at {again[0].at}", ErrorKind.INVALID)
    chosen = [d for d in chosen if d not in already]
    if len(already) + len(chosen) >= len(table):
        raise DatastoreError(
            f"forgetting {len(chosen)} document(s) would leave datastore {root.name} none: unload or delete it instead",
            ErrorKind.INVALID,
        )
    if erase:
        check_erasable(manifest.index.factory, manifest.dim)
    at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    records = again + [
        ForgetRecord(
            document=d,
            source=table.sources[table.source[d]],
            line=table.line[d],
            id=table.id[d],
            sha256=table.sha256[d],
            entries=(int(starts[d]), int(starts[d + 1])),
            at=at,
        )
        for d in chosen
    ]
    work = workdir(root)
    prepare_workdir(work, {"job": "forget", "base": manifest.checksum, "documents": [r.document for r in records], "erase": erase})
    link_version(root, work, manifest)
    firsts = shard_first_ids(manifest)
    shards = [_scrubbed_shard(work, shard, first, records, erase) for shard, first in zip(manifest.shards, firsts)]
    for d in chosen:
        table.first_token[d] = 0
    table.write(work / PROVENANCE)
    records = [
        r.model_copy(
            update={
                "erased_codes": [s.name for s, f in zip(manifest.shards, firsts) if _overlap(r, f, s.entries)] if erase else [],
                "erased_texts": r.erased_texts or _erase_server_copy(table, r),
            }
        )
        for r in records
    ]
    erased = {r.document: r for r in records[: len(again)]}
    gone = set(already) | set(chosen)
    new = manifest.model_copy(
        update={
            "shards": shards,
            "provenance": file_entry(work, work / PROVENANCE),
            "passages": kept_passages(root, work, manifest, {d: d for d in range(len(table)) if d not in gone}),
            "forgotten": [*(erased.get(r.document, r) for r in manifest.forgotten), *records[len(again) :]],
        }
    )
    write_manifest(work, new)
    publish(work, root)
    logger.info(
        "%s: forgot %d document(s), %s entries, in %.1f s",
        root,
        len(records),
        f"{sum(r.entries[1] - r.entries[0] for r in records):,}",
        time.monotonic() - started,
    )
    return new, records


def _overlap(record: ForgetRecord, first: int, entries: int) -> tuple[int, int] | None:
    """The record's entries in the shard holding ids [first, first + entries), as local ids; None if none."""
    lo, hi = max(record.entries[0], first) - first, min(record.entries[1], first + entries) - first
    return (lo, hi) if lo < hi else None


def _scrubbed_shard(work: Path, shard, first: int, records: list[ForgetRecord], erase: bool):
    """The shard's entry, with new values (and kept keys) files where a forgotten document's entries
    lie, and with `erase` a new index file without them."""
    ranges = [r for r in (_overlap(record, first, shard.entries) for record in records) if r is not None]
    if not ranges:
        return shard
    update = {}
    for field in ("values", "keys"):
        entry = getattr(shard, field)
        if entry is None:
            continue
        array = np.load(work / entry.path)  # a copy: the link's inode is the serving version's
        for lo, hi in ranges:
            array[lo:hi] = 0
        replace_array(work / entry.path, array)
        update[field] = file_entry(work, work / entry.path)
    if erase:
        path = work / shard.index.path
        index = faiss.read_index(str(path))
        update["removed"] = shard.removed + erase_entries(index, ranges)
        tmp = path.with_name(f".{path.name}.tmp")
        faiss.write_index(index, str(tmp))
        os.replace(tmp, path)  # a new inode: the serving version's file is untouched
        update["index"] = file_entry(work, path)
    return shard.model_copy(update=update)


def _erase_server_copy(table: DocumentTable, record: ForgetRecord) -> list[str]:
    """Erase the document's record from the texts file the server kept for it, if its source is one."""
    source = os.path.join(table.root, record.source)
    if record.line is None or not is_server_copy(source) or not erase_records(Path(source), {record.line}):
        return []
    return [f"{record.source}:{record.line}"]
