"""The first half of a build in one process: the corpus's documents as token ids (once per
build, resumable), and every entry's key into an fp16 memmap, batch by batch (resumable)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from tqdm import tqdm

from knnlm_core.config import BuildConfig
from knnlm_core.corpus import doc_offsets, iter_documents, token_ids
from knnlm_core.files import write_json_atomic
from knnlm_core.keys import KeyEncoder, encode_windows
from knnlm_core.manifest import CorpusStats
from knnlm_core.provenance import DocumentTable


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def document_starts(offsets: np.ndarray, first_entry: int = 0) -> np.ndarray:
    """documents.npy for documents at token `offsets`: each document of n tokens gives n - 1
    entries (every position but its last), in corpus order, from entry `first_entry`."""
    return (first_entry + np.concatenate([[0], np.cumsum(np.maximum(np.diff(offsets), 1) - 1)])).astype(np.int64)


def tokenize_corpus(work: Path, files: list[Path], model_dir: Path, config: BuildConfig, progress: bool) -> CorpusStats:
    """All documents' token ids, concatenated, with document offsets and where each came from
    (`corpus_documents.json`, the document table before the held-out slice); done once per build."""
    stats_file = work / "corpus.json"
    if stats_file.exists():
        return CorpusStats.model_validate_json(stats_file.read_text())
    tokenizer = load_tokenizer(model_dir)
    skipped: list[str] = []
    lengths, origins, first_tokens = [], [], []
    raw = work / "tokens.bin"
    bar = tqdm(total=sum(f.stat().st_size for f in files), unit="B", unit_scale=True, desc="tokenize", disable=not progress)
    with open(raw, "wb") as out:
        for document in iter_documents(files, text_field=config.text_field, on_bad_utf8=config.on_bad_utf8, skipped=skipped):
            ids = token_ids(tokenizer, document.text)
            if len(ids) == 0:
                continue
            out.write(ids.tobytes())
            lengths.append(len(ids))
            origins.append((str(document.source), document.line, document.id, document.sha256))
            first_tokens.append(int(ids[0]))
            bar.update(len(document.text.encode()))
    bar.close()
    np.save(work / "tokens.npy", np.fromfile(raw, dtype=np.int32))
    raw.unlink()
    offsets = doc_offsets(lengths)
    np.save(work / "doc_offsets.npy", offsets)
    DocumentTable.of(origins, first_tokens).write(work / "corpus_documents.json")
    stats = CorpusStats(sources=[str(f) for f in files], documents=len(lengths), tokens=int(offsets[-1]), skipped_files=skipped)
    write_json_atomic(stats_file, stats.model_dump(mode="json"))
    return stats


def encode_keys(work: Path, tokens: np.ndarray, plan, encoder: KeyEncoder, config: BuildConfig, progress: bool) -> float:
    """Keys into an fp16 memmap, batch by batch; `encode.json` records the batches on disk."""
    keys_file, progress_file = work / "keys.npy", work / "encode.json"
    done = json.loads(progress_file.read_text())["batches_done"] if progress_file.exists() else 0
    if keys_file.exists() and done:
        keys = np.load(keys_file, mmap_mode="r+")
    else:
        keys = np.lib.format.open_memmap(keys_file, mode="w+", dtype=np.float16, shape=(plan.entries, encoder.dim))
        done = 0

    def durable(batch: int) -> None:
        keys.flush()
        write_json_atomic(progress_file, {"batches_done": batch + 1})

    return encode_windows(encoder, tokens, plan, keys, config.batch_size, first_batch=done, after_batch=durable, progress=progress)
