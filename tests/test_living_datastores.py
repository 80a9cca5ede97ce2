"""knnlm-index add and forget: a datastore grows and forgets documents without a rebuild, and a
forgotten document is never found, followed, shown or counted again (real FAISS, tiny model)."""

from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import faiss
import numpy as np
import pytest
from conftest import make_tiny_llama
from test_index_builder import SMALL, knnlm_index, write_corpus

from index_builder.add import add_documents
from index_builder.build import build_datastore
from index_builder.erase import stored_vectors
from index_builder.forget import forget_documents
from index_builder.verify import verify_datastore
from index_builder.versions import writer_lock
from knnlm_core.config import KnnConfig
from knnlm_core.datastore import load_document_starts, read_manifest, verify_checksums
from knnlm_core.errors import DatastoreError, ErrorKind
from knnlm_core.keys import KeyEncoder
from knnlm_core.provenance import Provenance
from knnlm_core.search import merge_topk, open_shards
from knnlm_core.shard_keys import shard_keys
from knnlm_serve.runtime import ServedModel
from knnlm_serve.server.document_admin import AddedText, sweep_added_texts, write_added_texts
from knnlm_serve.server.registry import DatastoreRegistry

FACT = "The vault of the lighthouse opens with the words: zebra quartz maple lantern orbit velvet."


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture
def fact(tmp_path) -> Path:
    (tmp_path / "new").mkdir()
    (tmp_path / "new/fact.txt").write_text(FACT)
    return tmp_path / "new/fact.txt"


def build(corpus: Path, model: Path, out: Path, **settings) -> Path:
    build_datastore([corpus], out, model, SMALL.model_copy(update={"shards": 2, **settings}), progress=False)
    return out


def digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


def nearest(root: Path, queries: np.ndarray, k: int):
    manifest = read_manifest(root)
    return merge_topk([s.search(queries, k) for s in open_shards(root, manifest)], k)


def stored_keys(root: Path, lo: int, hi: int) -> np.ndarray:
    """The keys of entries [lo, hi) as their shards hold them: the queries nearest to them."""
    out = []
    for s in open_shards(root, read_manifest(root)):
        a, b = max(lo, s.first_id), min(hi, s.first_id + s.ntotal)
        if a < b:
            out.append(s.reconstruct(np.arange(a, b) - s.first_id))
    return np.concatenate(out)


def test_an_added_document_gets_new_shards_old_files_are_reused_and_it_is_found(corpus, fact, tiny_model_dir, tmp_path, monkeypatch):
    root = build(corpus, tiny_model_dir, tmp_path / "ds")
    before = read_manifest(root)
    names = [Provenance.open(root, before).table.describe(d)["source"] for d in range(before.corpus.documents)]
    inodes = {f.path: (root / f.path).stat().st_ino for s in before.shards for f in (s.index, s.values)}

    manifest, record = add_documents(root, [fact], tiny_model_dir, progress=False)

    assert [s.name for s in manifest.shards] == ["shard-000", "shard-001", "shard-002"] and record.shards == ["shard-002"]
    assert {path: (root / path).stat().st_ino for path in inodes} == inodes  # the old shard files, not rewritten
    assert shard_keys(manifest)[:2] == shard_keys(before)  # so a server keeps their actors
    assert manifest.entries == before.entries + record.entries and manifest.calibration == before.calibration
    verify_checksums(root, manifest)
    provenance = Provenance.open(root, manifest)
    assert record.first_document == provenance.documents - 1 == before.corpus.documents
    # the names the build gave stay (explanations, passages and `forget --source` keep naming a document
    # alike); the new file, outside the build's directory, is named by its path
    assert [provenance.table.describe(d)["source"] for d in range(len(names))] == names and "heapq.txt" in names
    assert provenance.table.describe(record.first_document)["source"] == str(fact.resolve())
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(tiny_model_dir).decode(provenance.tokens(record.first_document)) == FACT
    starts = load_document_starts(root, manifest)
    lo, hi = int(starts[-2]), int(starts[-1])
    assert (lo, hi) == (before.entries, manifest.entries)  # its entries follow the old ones: pointers stay inside it
    _, _, ids = nearest(root, stored_keys(root, lo, hi), 1)
    assert (ids[:, 0] == np.arange(lo, hi)).mean() > 0.9

    with pytest.raises(DatastoreError, match=r"sources with that file name: \['" + str(fact.resolve())):
        forget_documents(root, sources=["fact.txt"])  # not a listed name, and no such file here
    monkeypatch.chdir(tmp_path)  # a path from the working directory names the file too
    _, records = forget_documents(root, sources=["heapq.txt", "new/fact.txt"])
    assert {(r.source, r.document) for r in records} == {
        ("heapq.txt", names.index("heapq.txt")),
        (str(fact.resolve()), record.first_document),
    }


@pytest.mark.parametrize("index", ["flat", "ivfpq"])
def test_a_forgotten_document_is_never_found_followed_or_shown_and_rows_keep_k_neighbours(index, corpus, fact, tiny_model_dir, tmp_path):
    root = build(corpus, tiny_model_dir, tmp_path / "ds", index=index)
    _, record = add_documents(root, [fact], tiny_model_dir, progress=False)
    lo, hi = record_entries = load_document_starts(root, read_manifest(root))[-2:]
    queries = stored_keys(root, int(lo), int(hi))
    k = 64
    keys = shard_keys(read_manifest(root))

    manifest, (forgotten,) = forget_documents(root, documents=[record.first_document])

    assert [a == b for a, b in zip(shard_keys(manifest), keys)] == [True, True, False]  # a server keeps the others' actors

    assert forgotten.entries == tuple(int(x) for x in record_entries) and forgotten.sha256 == hashlib.sha256(FACT.encode()).hexdigest()
    assert FACT not in (root / "manifest.json").read_text()  # the audit record keeps which text, not the text
    distances, tokens, ids = nearest(root, queries, k)
    assert not ((ids >= lo) & (ids < hi)).any()
    assert (ids >= 0).all() and np.isfinite(distances).all()  # every row still has its k neighbours
    for searcher in open_shards(root, manifest):  # pointer lookups of its entries find nothing
        _, found, _ = searcher.lookup(queries[:2], np.tile(np.arange(lo, hi), (2, 1)))
        assert (found == -1).all()
    provenance = Provenance.open(root, manifest)
    with pytest.raises(DatastoreError) as gone:
        provenance.tokens(record.first_document)
    assert gone.value.kind == ErrorKind.GONE and "forgotten" in str(gone.value)
    assert not np.concatenate([np.asarray(s.values) for s in open_shards(root, manifest)])[lo:hi].any()  # its tokens are overwritten
    report = verify_datastore(root, samples=100)
    assert report["problems"] == [] and report["value_at_1"] > 0.5


@pytest.mark.slow
def test_a_killed_add_leaves_the_datastore_byte_identical_and_a_rerun_completes(corpus, tiny_model_dir, tmp_path):
    root = build(corpus, tiny_model_dir, tmp_path / "ds")
    more = write_corpus(tmp_path / "more", ("collections", "typing", "inspect", "subprocess", "unittest", "doctest"))
    before = digest(root)
    args = ["add", str(root), str(more), "--model", str(tiny_model_dir), "--batch-size", "1", "--quiet"]
    progress_file = tmp_path / ".ds.partial/added/encode.json"
    child = subprocess.Popen([sys.executable, "-m", "index_builder.cli", *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (progress_file.exists() and json.loads(progress_file.read_text())["batches_done"] >= 3):
        time.sleep(0.005)
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    assert json.loads(progress_file.read_text())["batches_done"] < 100  # killed part-way
    assert digest(root) == before  # the serving version, byte for byte

    rerun = knnlm_index(*args)
    assert rerun.returncode == 0, rerun.stderr
    manifest = read_manifest(root)
    assert len(manifest.additions) == 1 and manifest.additions[0].documents == 6
    assert {p: h for p, h in digest(root).items() if p.startswith(("shard-000", "shard-001"))} == {
        p: h for p, h in before.items() if p.startswith(("shard-000", "shard-001"))
    }


@pytest.mark.slow
def test_a_second_writer_is_refused_while_an_add_runs_and_the_add_lands_whole(corpus, tiny_model_dir, tmp_path):
    """Two processes changing one datastore (servers sharing its directory, or knnlm-index beside a
    server): the second is refused at once, naming why, instead of deleting the first one's work or
    publishing a version made from the one the first replaces (a forget undone by an add)."""
    root = build(corpus, tiny_model_dir, tmp_path / "ds")
    more = write_corpus(tmp_path / "more", ("collections", "typing"))
    args = ["add", str(root), str(more), "--model", str(tiny_model_dir), "--batch-size", "1", "--quiet"]
    progress_file = tmp_path / ".ds.partial/added/encode.json"
    child = subprocess.Popen([sys.executable, "-m", "index_builder.cli", *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and child.poll() is None and not progress_file.exists():
        time.sleep(0.005)
    assert child.poll() is None, "the add finished before a second writer could try"
    os.kill(child.pid, signal.SIGSTOP)  # still holding the datastore while the forget starts up
    try:
        refused = knnlm_index("forget", str(root), "--document", "1")
    finally:
        os.kill(child.pid, signal.SIGCONT)
    assert refused.returncode == 1 and "being changed by another process" in refused.stderr, refused.stderr
    assert child.wait(timeout=600) == 0, child.stderr.read().decode()
    manifest = read_manifest(root)
    assert len(manifest.additions) == 1 and manifest.forgotten == []
    again = knnlm_index("forget", str(root), "--document", "1")  # once the add is done, made from its version
    assert again.returncode == 0, again.stderr
    manifest = read_manifest(root)
    assert len(manifest.additions) == 1 and [r.document for r in manifest.forgotten] == [1]


def test_the_start_sweep_keeps_the_texts_of_a_datastore_another_process_is_changing(corpus, tiny_model_dir, tmp_path):
    """Servers sharing knn.datastore_root: one starting while another's add runs keeps that add's
    texts file (no version names it yet), and removes it at a start when no add runs."""
    root = build(corpus, tiny_model_dir, tmp_path / "ds")
    texts = tmp_path / ".knnlm-added" / "ds" / "20261128T000000-pending.jsonl"
    texts.parent.mkdir(parents=True)
    texts.write_text(json.dumps({"text": "the text of an add another server is running"}) + "\n")
    registry = DatastoreRegistry(KnnConfig(backend="local", datastore_root=str(tmp_path)), ServedModel.inspect(tiny_model_dir), None)
    held, done = threading.Event(), threading.Event()

    def other_writer() -> None:  # the lock held apart from this thread, as another process holds it
        with writer_lock(root):
            held.set()
            done.wait(60)

    try:
        registry.load("ds", root)
        writer = threading.Thread(target=other_writer)
        writer.start()
        assert held.wait(60)
        sweep_added_texts(registry)
        assert texts.exists()
        done.set()
        writer.join()
        sweep_added_texts(registry)
        assert not texts.exists()
    finally:
        done.set()
        registry.close()


def test_texts_that_cannot_all_be_written_leave_no_part_of_them_on_disk(tmp_path):
    """An add's texts hit a full disk part-way (here a file-size limit: the write fails with EFBIG
    after its first megabyte): the add is refused and no partial texts file stays behind."""
    secret = "a record the disk had no room for " * 100_000
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    ignored = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of the signal's default exit
    resource.setrlimit(resource.RLIMIT_FSIZE, (2**20, limit[1]))
    try:
        with pytest.raises(OSError):
            write_added_texts(str(tmp_path), "ds", [AddedText(text=secret)])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, ignored)
    assert (tmp_path / ".knnlm-added" / "ds").is_dir()
    assert list((tmp_path / ".knnlm-added" / "ds").iterdir()) == []


def test_a_killed_forget_leaves_the_datastore_byte_identical_and_a_rerun_completes(corpus, tiny_model_dir, tmp_path):
    """SIGKILL as soon as the next version's work directory appears (retried on a fresh copy if
    the forget finished first): the serving version is untouched, and the same command completes."""
    base = build(corpus, tiny_model_dir, tmp_path / "base", keep_keys=True)
    for attempt in range(10):
        root = tmp_path / f"ds{attempt}"
        shutil.copytree(base, root)
        before = digest(root)
        args = ["forget", str(root), "--document", "1"]
        child = subprocess.Popen([sys.executable, "-m", "index_builder.cli", *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        while child.poll() is None and not (tmp_path / f".ds{attempt}.partial").exists():
            time.sleep(0.001)
        killed = child.poll() is None
        child.kill()
        child.wait()
        if killed:
            break
    assert killed, "every forget finished before it could be killed"
    assert digest(root) == before
    rerun = knnlm_index(*args)
    assert rerun.returncode == 0, rerun.stderr
    assert [r.document for r in read_manifest(root).forgotten] == [1]


@pytest.mark.parametrize(
    "args, message",
    [
        (["forget", "{root}", "--document", "99"], "document 99 does not exist"),
        (["forget", "{root}", "--id", "nope"], "no document has id 'nope'"),
        (["forget", "{root}"], "name the documents to forget"),
        (["forget", "{root}", *[a for d in range(6) for a in ("--document", str(d))]], "would leave datastore ds none"),
        (["add", "{root}", "{empty}", "--model", "{model}"], "no text"),
        (["add", "{root}", "{corpus}", "--model", "{other}"], "was built for model"),
        (["add", "{root}", "{corpus}", "--model", "{model}"], "is already in the datastore as document 0"),
    ],
    ids=["unknown-document", "unknown-id", "nothing-named", "every-document", "empty-add", "other-model", "duplicate-document"],
)
def test_bad_adds_and_forgets_name_the_problem_and_change_nothing(args, message, corpus, tiny_model_dir, smollm2_dir, tmp_path):
    root = build(corpus, tiny_model_dir, tmp_path / "ds")
    (tmp_path / "empty.txt").write_text("  \n")
    other = make_tiny_llama(tmp_path / "other", smollm2_dir, seed=1) if "{other}" in args else None
    names = {"root": root, "empty": tmp_path / "empty.txt", "model": tiny_model_dir, "corpus": corpus, "other": other}
    before = digest(root)
    result = knnlm_index(*(a.format(**names) for a in args))
    assert result.returncode == 1 and message in result.stderr, result.stderr
    assert digest(root) == before


def test_forgetting_a_document_twice_says_when_and_a_forgotten_document_can_still_be_erased(corpus, fact, tiny_model_dir, tmp_path):
    """A tombstone forget, then the same document with --erase: its codes leave the index files
    then, its audit record keeps the first forget's time and says so; a third time is refused."""
    root = build(corpus, tiny_model_dir, tmp_path / "ds")
    _, added = add_documents(root, [fact], tiny_model_dir, progress=False)
    _, (first,) = forget_documents(root, documents=[added.first_document])
    with pytest.raises(DatastoreError, match=f"document {added.first_document} was already forgotten .*--erase.* at 20"):
        forget_documents(root, documents=[added.first_document])
    keys = document_keys(tiny_model_dir, FACT)
    assert held_near(root, keys).all()  # a tombstone: the codes are still in the files

    manifest, (erased,) = forget_documents(root, documents=[added.first_document], erase=True)

    assert not held_near(root, keys).any()
    assert erased.at == first.at and erased.erased_codes == added.shards
    assert [r.document for r in manifest.forgotten] == [added.first_document] and manifest.forgotten[0] == erased
    with pytest.raises(DatastoreError, match="already forgotten and erased"):
        forget_documents(root, documents=[added.first_document], erase=True)
    assert verify_datastore(root, samples=100)["problems"] == []


def test_a_compact_into_more_shards_than_entries_left_is_refused_naming_shards_and_changes_nothing(corpus, tiny_model_dir, tmp_path):
    root = build(corpus, tiny_model_dir, tmp_path / "ds")
    forget_documents(root, documents=[0])
    manifest = read_manifest(root)
    live = manifest.entries - (manifest.forgotten[0].entries[1] - manifest.forgotten[0].entries[0])
    before, siblings = digest(root), sorted(tmp_path.iterdir())

    result = knnlm_index("compact", str(root), "--shards", str(live + 1), "--quiet")

    assert result.returncode == 1 and f"shards: {live + 1} is more than the {live:,} entries" in result.stderr, result.stderr
    assert f"give at most {live}" in result.stderr
    assert digest(root) == before and sorted(tmp_path.iterdir()) == siblings


@pytest.mark.parametrize("index", ["flat", "ivfpq"])
def test_compact_folds_added_shards_and_tombstones_into_a_plain_store_that_answers_the_same(index, corpus, fact, tiny_model_dir, tmp_path):
    root = build(corpus, tiny_model_dir, tmp_path / "ds", index=index)
    _, record = add_documents(root, [fact], tiny_model_dir, progress=False)
    forget_documents(root, documents=[2])
    manifest = read_manifest(root)
    starts = load_document_starts(root, manifest)
    live = np.concatenate([np.arange(starts[d], starts[d + 1]) for d in range(len(starts) - 1) if d != 2])
    queries = stored_keys(root, 0, manifest.entries)[live[:: max(1, len(live) // 200)]]
    before = nearest(root, queries, 16)

    compacted = knnlm_index("compact", str(root), "--quiet")

    assert compacted.returncode == 0, compacted.stderr
    manifest = read_manifest(root)
    assert (manifest.additions, manifest.forgotten) == ([], []) and manifest.entries == len(live)
    assert len(manifest.shards) == 2 and all(s.keep is None for s in open_shards(root, manifest))
    audit = manifest.compactions[-1]
    assert audit.folded_additions == 1 and [r.document for r in audit.forgotten] == [2]
    distances, tokens, ids = nearest(root, queries, 16)
    if index == "flat":  # the same entries, numbered without the gap, at the same distances
        assert np.array_equal(live[ids], before[2]) and np.allclose(distances, before[0], rtol=1e-4, atol=1e-4)
    else:  # PQ codes are decoded and encoded again: an entry may land in a neighbouring IVF list
        same = np.mean([len(set(live[a]) & set(b)) / 16 for a, b in zip(ids, before[2])])
        assert same > 0.9, same
    provenance = Provenance.open(root, manifest)
    assert provenance.documents == record.first_document  # one document fewer, the fact now the last
    assert provenance.table.describe(provenance.documents - 1)["source"].endswith("fact.txt")
    assert verify_datastore(root, samples=100)["problems"] == []


def document_keys(model_dir: Path, text: str) -> np.ndarray:
    """The document's keys recomputed with the datastore's model: entry p's key follows tokens 0..p."""
    from transformers import AutoTokenizer

    tokens = np.array(AutoTokenizer.from_pretrained(model_dir)(text).input_ids)
    return KeyEncoder(model_dir, "ffn_input", "float32").encode([tokens[:-1]])[0]


def held_near(root: Path, keys: np.ndarray) -> np.ndarray:
    """For each key, whether some index file of the datastore stores a vector within fp16 rounding of it."""
    found = np.zeros(len(keys), dtype=bool)
    for shard in read_manifest(root).shards:
        index = faiss.read_index(str(root / shard.index.path))  # alive while its vectors' view is read
        vectors = stored_vectors(index)
        distances = ((keys[:, None, :] - vectors[None, :, :]) ** 2).sum(axis=2).min(axis=1)
        found |= distances < 1e-4 * (keys**2).sum(axis=1)
    return found


@pytest.mark.parametrize("index", ["flat", "ivfpq"])
def test_an_erasing_forget_takes_its_entries_out_of_the_index_files_and_every_other_entry_answers_as_before(
    index, corpus, fact, tiny_model_dir, tmp_path
):
    root = build(corpus, tiny_model_dir, tmp_path / "ds", index=index)
    _, record = add_documents(root, [fact], tiny_model_dir, progress=False)
    erased, tombstoned = root, tmp_path / "tombstoned"
    shutil.copytree(root, tombstoned)
    starts = load_document_starts(root, read_manifest(root)).astype(int)
    gone = np.r_[starts[2] : starts[3], starts[-2] : starts[-1]]  # a document inside a built shard, and the added fact
    queries = stored_keys(root, 0, starts[-2])[::7]
    candidates = np.tile(np.arange(starts[2] - 20, starts[3] + 20), (len(queries), 1))  # pointers into and around the gap
    keys = document_keys(tiny_model_dir, FACT)
    if index != "ivfpq":
        assert held_near(root, keys).all()  # the check below can fail: the keys are in the files before
    forget_documents(tombstoned, documents=[2, record.first_document])

    manifest, records = forget_documents(erased, documents=[2, record.first_document], erase=True)

    assert records[1].erased_codes == record.shards and records[0].erased_codes
    for shard in manifest.shards:
        index_file = faiss.read_index(str(root / shard.index.path))
        ivf = faiss.extract_index_ivf(index_file) if index == "ivfpq" else None
        if ivf is not None:  # its ids and codes left the IVF lists
            ids = np.concatenate([faiss.rev_swig_ptr(ivf.invlists.get_ids(n), ivf.invlists.list_size(n)) for n in range(ivf.nlist)])
            first = sum(s.entries for s in manifest.shards[: manifest.shards.index(shard)])
            assert not np.isin(ids + first, gone).any() and index_file.ntotal == shard.entries - shard.removed == len(ids)
    if index != "ivfpq":  # its key vectors are overwritten
        assert not held_near(root, keys).any()
    for a, b in zip(nearest(erased, queries, 16), nearest(tombstoned, queries, 16)):  # every other id answers as before
        assert np.array_equal(a, b)
    for a, b in zip(open_shards(erased, manifest), open_shards(tombstoned, read_manifest(tombstoned))):
        for x, y in zip(a.lookup(queries, candidates), b.lookup(queries, candidates)):
            assert np.array_equal(x, y)
    assert verify_datastore(root, samples=100)["problems"] == []
    compacted = knnlm_index("compact", str(root), "--quiet")
    assert compacted.returncode == 0, compacted.stderr
    assert read_manifest(root).entries == starts[-1] - len(gone)


def test_an_hnsw_store_refuses_to_erase_in_place_names_compact_and_changes_nothing(corpus, tiny_model_dir, tmp_path):
    root = build(corpus, tiny_model_dir, tmp_path / "ds", index="hnsw")
    before = digest(root)
    result = knnlm_index("forget", str(root), "--document", "1", "--erase")
    assert result.returncode == 1 and "IndexHNSWFlat index (HNSW32) cannot erase" in result.stderr and "compact" in result.stderr, (
        result.stderr
    )
    assert digest(root) == before and not (tmp_path / ".ds.partial").exists()


def test_a_server_up_for_months_keeps_a_bounded_list_of_ended_jobs():
    from knnlm_serve.server.document_jobs import KEPT_JOBS, DocumentJobs

    jobs = DocumentJobs()
    first = jobs.begin("a", "add")
    jobs.end(first, time.monotonic())
    running = jobs.begin("b", "compact")
    for _ in range(KEPT_JOBS + 5):
        jobs.end(jobs.begin("a", "forget"), time.monotonic(), error=None)
    assert len(jobs.jobs) == KEPT_JOBS + 1 and running.id in jobs.jobs and first.id not in jobs.jobs
    assert list(jobs.jobs.values())[-1].state == "done"
