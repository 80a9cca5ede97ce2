"""A vector store's search: the best passages of its datastore, as OpenAI's search results,
each naming the file it came from (the document's source is `<file id>.jsonl`)."""

from __future__ import annotations

from pathlib import Path

from knnlm_core.datastore import read_manifest
from knnlm_core.provenance import DocumentTable
from knnlm_core.vector_store_records import VectorStore
from knnlm_serve.server.context import passage_index


def search_store(stores, store: VectorStore, query: str, count: int, gated: bool = False) -> list[dict]:
    """The store's `count` passages that best match `query`; with `gated`, only those above its
    relevance gate (passages for a prompt, as `knn_context` takes them)."""
    info = stores.registry.runtime.datastores.get(store.id)  # the serving snapshot: a load in progress holds the registry's lock
    if info is None or info.passages is None:
        return []
    entry = info.passages
    found = passage_index(str(Path(info.path) / entry.file.path), entry.file.sha256).search(query, count, entry.relevance)
    table = DocumentTable.read(Path(info.path) / read_manifest(info.path).provenance.path)
    results = []
    for passage in found:
        if gated and entry.gate is not None and passage.relevance <= entry.gate:
            continue
        file_id = Path(table.sources[table.source[passage.document]]).stem
        attached, stored = store.files.get(file_id), stores.files.by_id(file_id)
        if attached is not None and stored is not None:
            results.append(
                {
                    "file_id": file_id,
                    "filename": stored.filename,
                    "score": passage.relevance,
                    "attributes": attached.attributes,
                    "content": [{"type": "text", "text": passage.text}],
                }
            )
    return results
