"""knnlm-index: a corpus becomes a sharded datastore whose search returns what was stored."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from index_builder.build import build_datastore
from index_builder.calibrate import recalibrate
from index_builder.verify import verify_datastore
from knnlm_core.config import BuildConfig
from knnlm_core.datastore import load_document_starts, read_manifest
from knnlm_core.errors import DatastoreError
from knnlm_core.search import merge_topk, open_shards
from knnlm_core.windows import plan_windows
from knnlm_serve.runtime import DatastoreInfo

STDLIB_MODULES = ("json", "textwrap", "argparse", "heapq", "bisect", "shlex")


def write_corpus(directory: Path, modules=STDLIB_MODULES) -> Path:
    """Distinct real documents every machine has: Python standard-library module docstrings."""
    import importlib

    directory.mkdir(parents=True, exist_ok=True)
    for name in modules:
        (directory / f"{name}.txt").write_text(importlib.import_module(name).__doc__)
    return directory


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


SMALL = BuildConfig(context_length=64, stride=32, batch_size=4, index="flat")


def pairs_in(corpus: Path, model_dir: Path) -> int:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return sum(len(tokenizer(p.read_text()).input_ids) - 1 for p in corpus.iterdir())


def test_plan_keys_every_position_once_within_its_document():
    doc_offsets = np.array([0, 5, 105, 106, 300])
    plan = plan_windows(doc_offsets, context_length=16, stride=6)
    keyed = np.concatenate([np.arange(k0, k1) for _, k0, k1 in plan.windows])
    expected = np.concatenate([np.arange(a, b - 1) for a, b in zip(doc_offsets[:-1], doc_offsets[1:])])
    assert np.array_equal(keyed, expected)
    doc_of = np.searchsorted(doc_offsets, plan.windows[:, 0], side="right")
    assert np.array_equal(doc_of, np.searchsorted(doc_offsets, plan.windows[:, 2] - 1, side="right"))
    assert np.all(plan.windows[:, 2] - plan.windows[:, 0] <= 16)


def test_two_shard_build_stores_every_pair_and_finds_its_own_values(corpus, tiny_model_dir, tmp_path):
    out = tmp_path / "ds"
    manifest = build_datastore([corpus], out, tiny_model_dir, SMALL.model_copy(update={"shards": 2, "keep_keys": True}), progress=False)
    assert manifest.entries == pairs_in(corpus, tiny_model_dir)
    assert [s.entries for s in manifest.shards] == [manifest.entries // 2, manifest.entries - manifest.entries // 2]
    assert read_manifest(out) == manifest
    report = verify_datastore(out, samples=400)
    assert report["recall_at_1"] == 1.0
    # Searching a stored key returns its own next token.
    searchers = open_shards(out, manifest)
    keys = np.load(out / "shard-001/keys.npy").astype(np.float32)[:50]
    values = np.load(out / "shard-001/values.npy")[:50]
    _, tokens, _ = merge_topk([s.search(keys, 1) for s in searchers], 1)
    assert np.mean(tokens[:, 0] == values) > 0.95  # the rest are exact duplicate contexts
    assert not list(tmp_path.glob(".*partial"))
    # Document boundaries: each document's entries are its positions in corpus order, so within a
    # document entry i + 1's value is the token after entry i's value.
    from transformers import AutoTokenizer

    starts = load_document_starts(out, manifest)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    lengths = [len(tokenizer(p.read_text()).input_ids) for p in sorted(corpus.iterdir())]
    assert np.array_equal(np.diff(starts), np.array(lengths) - 1) and starts[-1] == manifest.entries
    all_values = np.concatenate([np.load(out / s.values.path) for s in manifest.shards])
    first = tokenizer((sorted(corpus.iterdir())[1]).read_text()).input_ids
    assert all_values[starts[1] : starts[2]].tolist() == first[1:]


def test_keys_are_the_models_final_hidden_states(corpus, tiny_model_dir, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    doc = corpus / "heapq.txt"
    config = BuildConfig(context_length=4096, stride=2048, key_type="final", index="flat", keep_keys=True)
    build_datastore([doc], tmp_path / "ds", tiny_model_dir, config, progress=False)
    keys = np.load(tmp_path / "ds/shard-000/keys.npy").astype(np.float32)
    ids = AutoTokenizer.from_pretrained(tiny_model_dir)(doc.read_text(), return_tensors="pt").input_ids
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states[-1][0, :-1].numpy()
    np.testing.assert_allclose(keys, hidden, rtol=2e-3, atol=2e-3)


def test_shards_merged_equal_one_unsharded_index(corpus, tiny_model_dir, tmp_path):
    one = build_datastore([corpus], tmp_path / "one", tiny_model_dir, SMALL, progress=False)
    three = build_datastore([corpus], tmp_path / "three", tiny_model_dir, SMALL.model_copy(update={"shards": 3}), progress=False)
    queries = np.random.default_rng(0).normal(size=(64, one.dim)).astype(np.float32)
    (single,) = open_shards(tmp_path / "one", one)
    expected_d, expected_t, expected_ids = single.search(queries, 16)
    got_d, got_t, got_ids = merge_topk([s.search(queries, 16) for s in open_shards(tmp_path / "three", three)], 16)
    np.testing.assert_allclose(got_d, expected_d, rtol=1e-5)
    assert np.array_equal(got_t, expected_t) and np.array_equal(got_ids, expected_ids)  # global entry ids
    # Scoring given entries (pointer following) gives the distances and tokens search gave them.
    for searcher in open_shards(tmp_path / "three", three):
        d, t, ids = searcher.lookup(queries, expected_ids)
        mine = (expected_ids >= searcher.first_id) & (expected_ids < searcher.first_id + searcher.ntotal)
        for row in range(len(queries)):
            n = int(mine[row].sum())
            assert sorted(ids[row, :n]) == sorted(expected_ids[row][mine[row]]) and np.all(ids[row, n:] == -1)
            np.testing.assert_allclose(d[row, :n], expected_d[row][mine[row]], rtol=1e-4)
            assert np.array_equal(t[row, :n], expected_t[row][mine[row]])


@pytest.mark.slow
def test_ivfpq_build_trains_once_and_searches(corpus, tiny_model_dir, tmp_path):
    config = SMALL.model_copy(update={"index": "ivfpq", "shards": 2})
    manifest = build_datastore([corpus], tmp_path / "ds", tiny_model_dir, config, progress=False)
    assert manifest.index.factory.startswith("IVF") and "PQ" in manifest.index.factory
    assert manifest.index.train_size == manifest.entries
    assert verify_datastore(tmp_path / "ds", samples=200)["value_at_1"] > 0.8
    # Calibration probes fewer IVF lists where the perplexity holds, and the server searches at that nprobe.
    manifest = recalibrate(tmp_path / "ds", [corpus], tiny_model_dir, config, progress=False)
    cal = manifest.calibration
    tried = [p.nprobe for p in cal.nprobe_curve.nprobes]
    assert tried[0] == manifest.index.nprobe and tried == sorted(tried, reverse=True) and cal.nprobe in tried
    best = min(p.tune_ppl for p in cal.nprobe_curve.nprobes if p.nprobe >= cal.nprobe)
    assert all(p.tune_ppl <= best * (1 + cal.nprobe_curve.tolerance) for p in cal.nprobe_curve.nprobes if p.nprobe >= cal.nprobe)
    assert DatastoreInfo.of("ds", tmp_path / "ds", manifest).nprobe == cal.nprobe


def test_one_outlier_key_does_not_collapse_a_fast_scan_stores_distances(tmp_path, monkeypatch):
    """A transformer gives a sequence's first position a massive activation, so a corpus's first
    key can be an outlier. Trained on, it took a PQ centroid of its own and fast-scan's 8-bit
    distance tables rounded every other sub-quantizer to 0: neighbours came back at one distance.
    The builder trains without such keys; the outlier is still stored and found. `knnlm-index
    verify` tells a store built the old way (trained on every key) from a sound one."""
    import index_builder.faiss_index
    from index_builder.build import build_from_keys
    from knnlm_core.manifest import ModelIdentity

    rng = np.random.default_rng(0)
    keys, values = rng.normal(size=(4000, 64)).astype(np.float32), rng.integers(0, 1000, 4000)
    keys[0, 5] = 40.0  # about what SmolLM2's first position carries against its other keys
    model = ModelIdentity(name="m", fingerprint="f", hidden_size=64, vocab_size=1000, dtype="float32")
    build_from_keys(keys, values, tmp_path / "ds", model, BuildConfig(index="IVF8,PQ16x4fs"), source="test", progress=False)
    manifest = read_manifest(tmp_path / "ds")
    assert manifest.index.train_size == len(keys) - 1  # the manifest says what the quantizers saw
    (shard,) = open_shards(tmp_path / "ds", manifest, use_gpu=False)
    distances, _, ids = shard.search(keys[1:33], 10, 4)
    assert np.median([len(np.unique(row)) for row in distances]) >= 8  # one distance for many neighbours was the collapse
    assert np.mean([i in set(row) for i, row in zip(range(1, 33), ids)]) > 0.9
    assert 0 in set(shard.search(keys[:1], 10, 8)[2][0])
    assert verify_datastore(tmp_path / "ds", samples=200)["problems"] == []
    assert knnlm_index("verify", str(tmp_path / "ds"), "--samples", "200").returncode == 0

    monkeypatch.setattr(index_builder.faiss_index, "typical_keys", lambda sample: sample)  # the builder before the fix
    build_from_keys(keys, values, tmp_path / "old", model, BuildConfig(index="IVF8,PQ16x4fs"), source="test", progress=False)
    assert read_manifest(tmp_path / "old").index.train_size == len(keys)
    result = knnlm_index("verify", str(tmp_path / "old"), "--samples", "200")
    assert result.returncode == 1 and "distinct distances" in result.stderr and "knnlm-index build --overwrite" in result.stderr
    assert json.loads(result.stdout)["distinct_distances_at_k"] < 0.5


def test_an_ivfpq_store_with_an_hnsw_coarse_quantizer_serves(corpus, tiny_model_dir, tmp_path):
    """The structure of the 10M scale store at a size a test can build: the graph's search beam
    survives the files, and a memory-mapped shard answers as a read one."""
    import faiss

    from knnlm_core.search import ShardSearcher, ivf_of, shard_first_ids

    config = SMALL.model_copy(update={"index": "IVF16_HNSW32,PQ8np", "shards": 2})
    manifest = build_datastore([corpus], tmp_path / "ds", tiny_model_dir, config, progress=False)
    assert verify_datastore(tmp_path / "ds", samples=200)["value_at_1"] > 0.8
    shard, first = manifest.shards[0], shard_first_ids(manifest)[0]
    read, mapped = (ShardSearcher(tmp_path / "ds", shard, first, use_gpu=False, mmap=m) for m in (False, True))
    assert faiss.downcast_index(ivf_of(mapped.index).quantizer).hnsw.efSearch == 128
    queries = np.random.default_rng(0).normal(size=(8, manifest.dim)).astype(np.float32)
    for a, b in zip(read.search(queries, 16, 4), mapped.search(queries, 16, 4)):
        np.testing.assert_array_equal(a, b)


def knnlm_index(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "index_builder.cli", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_killed_build_resumes_to_the_same_datastore(corpus, tiny_model_dir, tmp_path):
    big = write_corpus(tmp_path / "big", STDLIB_MODULES + ("collections", "functools", "typing", "inspect"))
    args = [
        "build",
        str(big),
        "--model",
        str(tiny_model_dir),
        "--context-length",
        "64",
        "--stride",
        "32",
        "--batch-size",
        "1",
        "--shards",
        "2",
        "--index",
        "flat",
        "--quiet",
    ]
    reference = knnlm_index(*args, "-o", str(tmp_path / "reference"))
    assert reference.returncode == 0, reference.stderr

    out = tmp_path / "resumed"
    progress_file = tmp_path / ".resumed.partial" / "encode.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "index_builder.cli", *args, "-o", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if progress_file.exists() and json.loads(progress_file.read_text())["batches_done"] >= 3:
            break
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    batches_at_kill = json.loads(progress_file.read_text())["batches_done"]
    assert not out.exists(), "a killed build must not leave a datastore-looking directory"

    resumed = knnlm_index(*args, "-o", str(out))
    assert resumed.returncode == 0, resumed.stderr
    a, b = read_manifest(tmp_path / "reference"), read_manifest(out)
    assert a.entries == b.entries and a.shards == b.shards  # same counts, sizes and checksums
    assert batches_at_kill < 200  # it really was interrupted part-way (the corpus has more batches)


@pytest.mark.parametrize(
    "setup, extra, message",
    [
        (lambda d: (d / "empty.txt").write_text("   \n"), [], "no text to index"),
        (lambda d: None, ["MISSING"], "does not exist"),
        (lambda d: (d / "bad.txt").write_bytes(b"caf\xe9 au lait"), ["--on-bad-utf8", "error"], "not UTF-8"),
        (lambda d: (d / "bad.txt").write_bytes(b"caf\xe9 au lait"), [], "bad.txt: not UTF-8, so skipped (save it as UTF-8)"),
    ],
    ids=["empty-corpus", "missing-path", "non-utf8-error", "only-non-utf8-skipped"],
)
def test_bad_corpus_fails_with_one_line_and_writes_nothing(setup, extra, message, tiny_model_dir, tmp_path):
    corpus_dir = tmp_path / "in"
    corpus_dir.mkdir()
    setup(corpus_dir)
    inputs = [str(tmp_path / "missing.txt")] if "MISSING" in extra else [str(corpus_dir)]
    flags = [x for x in extra if x != "MISSING"]
    result = knnlm_index("build", *inputs, "-o", str(tmp_path / "ds"), "--model", str(tiny_model_dir), *flags)
    assert result.returncode != 0
    assert message in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("knnlm-index: error:")
    assert not (tmp_path / "ds").exists() and not list(tmp_path.glob(".ds*"))


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--index", "bogus"], "index: FAISS cannot make 'bogus' for 64-dimensional keys (could not parse index string bogus)"),
        (["--index", "IVF4,PQ7"], "index: FAISS cannot make 'IVF4,PQ7' for 64-dimensional keys"),
        (["--pca-dim", "64"], "--pca-dim 64 must be below the key dimension 64"),
    ],
    ids=["unknown-index", "pq-not-dividing-the-dimension", "pca-not-reducing"],
)
def test_an_index_faiss_cannot_make_fails_before_any_key_is_encoded_and_writes_nothing(flags, message, tiny_model_dir, tmp_path):
    (tmp_path / "in.txt").write_text("The lighthouse keeper counted the ships that passed the northern cape. " * 20)
    result = knnlm_index("build", str(tmp_path / "in.txt"), "-o", str(tmp_path / "ds"), "--model", str(tiny_model_dir), *flags)
    assert result.returncode == 1 and message in result.stderr, result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("knnlm-index: error:")
    assert not (tmp_path / "ds").exists() and not list(tmp_path.glob(".ds*"))


def test_a_quiet_build_writes_nothing_to_the_terminal(tiny_model_dir, tmp_path):
    (tmp_path / "in.txt").write_text("The lighthouse keeper counted the ships that passed the northern cape. " * 20)
    args = ["build", str(tmp_path / "in.txt"), "-o", str(tmp_path / "ds"), "--model", str(tiny_model_dir), "--no-calibrate", "--quiet"]
    result = knnlm_index(*args)
    assert result.returncode == 0 and (result.stdout, result.stderr) == ("", ""), result.stderr[-2000:]


def test_an_output_that_cannot_be_made_is_one_line_naming_it(tiny_model_dir, tmp_path):
    (tmp_path / "in.txt").write_text("A short text.")
    result = knnlm_index("build", str(tmp_path / "in.txt"), "-o", str(tmp_path / "in.txt" / "ds"), "--model", str(tiny_model_dir))
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip().splitlines()[-1] == f"knnlm-index: error: Not a directory: {tmp_path / 'in.txt' / '.ds.partial'}"


@pytest.mark.parametrize(
    "args",
    [
        ["compact", "DS", "--shards", "0"],
        ["calibrate", "DS", "--stride", "0"],
        ["calibrate", "DS", "--context-length", "-64"],
        ["add", "DS", "new.txt", "--batch-size", "0"],
        ["verify", "DS", "--samples", "0"],
    ],
    ids=["compact-shards", "calibrate-stride", "calibrate-context", "add-batch", "verify-samples"],
)
def test_a_count_below_one_is_refused_naming_its_flag_before_anything_runs(args, tmp_path):
    """0 used to mean "the default" where a flag defaults to None (`compact --shards 0` compacted)."""
    result = knnlm_index(*[str(tmp_path / "ds") if a == "DS" else a for a in args])
    flag = next(a for a in args if a.startswith("--"))
    assert result.returncode == 2 and f"argument {flag}: must be a positive integer" in result.stderr, result.stderr


def test_non_utf8_files_are_skipped_and_counted(corpus, tiny_model_dir, tmp_path):
    mixed = write_corpus(tmp_path / "mixed", ("json",))
    (mixed / "latin1.txt").write_bytes(b"caf\xe9 au lait")
    manifest = build_datastore([mixed], tmp_path / "ds", tiny_model_dir, SMALL, progress=False)
    assert manifest.corpus.documents == 1
    assert len(manifest.corpus.skipped_files) == 1 and "latin1.txt" in manifest.corpus.skipped_files[0]


@pytest.mark.slow
def test_existing_datastore_is_kept_unless_overwrite(corpus, tiny_model_dir, tmp_path):
    out = tmp_path / "ds"
    build_datastore([corpus / "json.txt"], out, tiny_model_dir, SMALL, progress=False)
    before = (out / "manifest.json").read_text()
    args = ["build", str(corpus / "heapq.txt"), "-o", str(out), "--model", str(tiny_model_dir), "--index", "flat", "--quiet"]
    refused = knnlm_index(*args)
    assert refused.returncode != 0 and "--overwrite" in refused.stderr
    assert (out / "manifest.json").read_text() == before
    replaced = knnlm_index(*args, "--overwrite")
    assert replaced.returncode == 0, replaced.stderr
    assert read_manifest(out).corpus.sources == [str((corpus / "heapq.txt").resolve())]


def test_model_that_is_not_a_causal_lm_is_refused(corpus, tmp_path):
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert/config.json").write_text('{"architectures": ["BertModel"]}')
    result = knnlm_index("build", str(corpus), "-o", str(tmp_path / "ds"), "--model", str(tmp_path / "bert"))
    assert result.returncode != 0 and "not a causal language model" in result.stderr
    assert not (tmp_path / "ds").exists()


def test_a_manifest_edited_after_the_build_is_refused(corpus, tiny_model_dir, tmp_path):
    manifest = build_datastore([corpus], tmp_path / "ds", tiny_model_dir, SMALL, progress=False)
    file = tmp_path / "ds" / "manifest.json"
    raw = json.loads(file.read_text())
    raw["key_type"] = "final" if manifest.key_type == "ffn_input" else "ffn_input"
    file.write_text(json.dumps(raw))
    with pytest.raises(DatastoreError, match="changed after knnlm-index wrote it.*restore it, or rebuild"):
        read_manifest(tmp_path / "ds")
    raw["key_type"] = manifest.key_type  # put back as it was: accepted again
    file.write_text(json.dumps(raw, indent=4))
    assert read_manifest(tmp_path / "ds") == manifest


def test_inspect_detects_a_corrupted_shard(corpus, tiny_model_dir, tmp_path):
    out = tmp_path / "ds"
    build_datastore([corpus / "json.txt"], out, tiny_model_dir, SMALL, progress=False)
    assert knnlm_index("inspect", str(out)).returncode == 0
    values = out / "shard-000/values.npy"
    data = bytearray(values.read_bytes())
    data[-1] ^= 0xFF
    values.write_bytes(bytes(data))
    result = knnlm_index("inspect", str(out))
    assert result.returncode != 0 and "checksum mismatch" in result.stderr
    values.write_bytes(bytes(data[:-8]))
    result = knnlm_index("inspect", str(out))
    assert result.returncode != 0 and "truncated" in result.stderr


def test_provenance_gives_every_entry_its_document_and_the_documents_back(corpus, tiny_model_dir, tmp_path):
    import hashlib

    from transformers import AutoTokenizer

    from knnlm_core.provenance import Provenance

    records = [{"id": "intro", "text": "First record of the feed."}, {"text": "No id here."}, {"id": 7, "text": "Seventh."}]
    (corpus_dir := tmp_path / "corpus").mkdir()
    (corpus_dir / "heapq.txt").write_text((corpus / "heapq.txt").read_text())
    (corpus_dir / "feed.jsonl").write_text("\n".join([json.dumps(records[0]), "", json.dumps(records[1]), json.dumps(records[2])]))
    manifest = build_datastore([corpus_dir], tmp_path / "ds", tiny_model_dir, SMALL.model_copy(update={"shards": 2}), progress=False)
    provenance = Provenance.open(tmp_path / "ds", manifest)
    texts = [r["text"] for r in records] + [(corpus / "heapq.txt").read_text()]  # files in sorted order
    rows = [provenance.table.describe(d) for d in range(provenance.documents)]
    assert [(r["source"], r["line"], r["id"]) for r in rows] == [
        ("feed.jsonl", 1, "intro"),
        ("feed.jsonl", 3, None),
        ("feed.jsonl", 4, "7"),
        ("heapq.txt", None, None),
    ]
    assert [r["sha256"] for r in rows] == [hashlib.sha256(t.encode()).hexdigest() for t in texts]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    for d, text in enumerate(texts):  # the datastore gives every document's tokens back, across the shard boundary
        assert provenance.tokens(d).tolist() == tokenizer(text).input_ids
    # Entry i: its document, and the position of its value (the next token) in that document.
    values = np.concatenate([np.load(tmp_path / "ds" / s.values.path) for s in manifest.shards])
    documents, positions = provenance.locate(np.arange(manifest.entries))
    for i in range(0, manifest.entries, 37):
        assert provenance.tokens(int(documents[i]), int(positions[i]) + 1, int(positions[i]) + 2).tolist() == [values[i]]
    with pytest.raises(DatastoreError, match="document 4 does not exist"):
        provenance.tokens(4)
    assert "provenance: 4 documents from 2 source file(s)" in knnlm_index("inspect", str(tmp_path / "ds")).stderr


def test_the_held_out_slice_names_its_documents_and_their_entries():
    from index_builder.corpus_keys import document_starts
    from knnlm_core.heldout import heldout_entries, split_heldout

    rng = np.random.default_rng(0)
    lengths = rng.integers(200, 2000, 40)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    tokens = rng.integers(0, 1000, offsets[-1]).astype(np.int32)
    heldout = split_heldout(tokens, offsets)
    held = [d for d, a, b in heldout.spans]
    assert 0 < len(held) < len(lengths) and all(a == 0 and b == lengths[d] for d, a, b in heldout.spans)  # whole documents
    assert np.array_equal(heldout.tokens, np.concatenate([tokens[offsets[d] : offsets[d + 1]] for d in held]))
    # Their entries in a datastore of the whole corpus: every position of theirs, no other document's.
    starts = document_starts(offsets)
    ranges = heldout_entries(starts, heldout.spans)
    assert [(lo, hi) for lo, hi in ranges] == [(starts[d], starts[d + 1]) for d in held]
    # One document: its last tokens are held out, and only the entries whose values are among them.
    one = split_heldout(tokens[:20_000], np.array([0, 20_000]))
    ((d, a, b),) = one.spans
    assert (d, b - a) == (0, 2000) and heldout_entries(document_starts(np.array([0, 20_000])), one.spans) == [(a - 1, b - 1)]
