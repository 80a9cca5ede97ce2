"""`knnlm-index vector-store`: a vector store built offline from a folder, as the server keeps one.

A large upload is better built here (on a Ray cluster too: `--ray`) than file by file through
the API. Each input file becomes an uploaded file of the store (its bytes and record below
`<root>/.knnlm-files/`) and its documents the store's texts; one `knnlm-index build` makes the
store's datastore, and the store's record is written last. A server on that root takes the store
in at the first Vector Stores or `file_search` request naming it or listing stores (otherwise
within a minute), owned by `--owner` (a key id of its keys file; none: the server's one tenant).
A file that cannot become documents is left out and reported, as the API reports it
(`unsupported_file`, `invalid_file`).
"""

from __future__ import annotations

import logging
import secrets
import shutil
import time
from pathlib import Path

from index_builder.build import build_datastore
from knnlm_core.config import BuildCluster, BuildConfig
from knnlm_core.errors import CorpusError
from knnlm_core.uploads import UploadError, check_upload, documents_of
from knnlm_core.vector_store_records import (
    FILES,
    VECTOR_STORES,
    StoredFile,
    StoreFile,
    VectorStore,
    new_store_id,
    save_store,
    store_texts,
    write_documents,
    write_file,
)

logger = logging.getLogger("index_builder")


def build_vector_store(
    root: Path,
    inputs: list[Path],
    model_dir: Path,
    name: str | None,
    owner: str | None,
    config: BuildConfig = BuildConfig(),
    cluster: BuildCluster = BuildCluster(),
    progress: bool = True,
) -> VectorStore:
    """A new vector store below `root` (a server's `knn.datastore_root`) holding the files of `inputs`."""
    root = Path(root).resolve()
    files = sorted(f for i in inputs for f in ([Path(i)] if Path(i).is_file() else Path(i).rglob("*")) if f.is_file())
    if not files:
        raise CorpusError(f"no files in {', '.join(map(str, inputs))}: give text files or folders of them")
    now = int(time.time())
    store = VectorStore(new_store_id(), owner, name, now, now)
    (root / FILES).mkdir(parents=True, exist_ok=True)
    written = []
    try:
        for path in files:
            data = path.read_bytes()
            try:
                check_upload(data, path.name)
                documents = documents_of(data, path.name)
            except UploadError as e:
                logger.warning("%s: left out (%s): %s", path, e.code, e)
                continue
            stored = StoredFile(f"file-{secrets.token_hex(12)}", owner, path.name, "assistants", len(data), now)
            write_file(root / FILES, stored, data)
            written.append(stored)
            write_documents(root, store.id, stored.id, documents)
            usage = sum(len(text.encode()) for _, text in documents)
            store.files[stored.id] = StoreFile(stored.id, now, status="completed", usage_bytes=usage)
        if not written:
            raise CorpusError(f"none of the {len(files)} file(s) holds text a vector store takes; see the lines above")
        build_datastore(
            [store_texts(root, store.id)],
            root / VECTOR_STORES / store.id / "datastore",
            model_dir,
            config,
            cluster=cluster,
            progress=progress,
        )
        save_store(root / VECTOR_STORES, store)
    except BaseException:  # nothing half-written: the store, its texts and its files go
        shutil.rmtree(root / VECTOR_STORES / store.id, ignore_errors=True)
        shutil.rmtree(store_texts(root, store.id), ignore_errors=True)
        for stored in written:
            for suffix in (".data", ".json"):
                (root / FILES / f"{stored.id}{suffix}").unlink(missing_ok=True)
        raise
    logger.info("vector store %s (%s): %d file(s), ready to serve", store.id, name or "no name", len(written))
    return store
