"""Files and Vector Stores through the unmodified `openai` client against a real server (tiny
model, two tenants' keys): an uploaded file becomes a kNN datastore owned by its key, searched and
recalled, and leaves no copy of its text behind once detached and deleted."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
import requests
import yaml
from conftest import STRICT_KNN, TINY_SERVER, continuations, greedy

from index_builder.build import build_datastore
from knnlm_core.config import BuildConfig
from knnlm_core.keys_file import key_hash
from knnlm_serve.server.process import RunningServer

pytestmark = pytest.mark.slow

KEYS = {"alice": "sk-knn-test-alice", "bob": "sk-knn-test-bob"}
FACT = "The harbour lighthouse keeper of Vellmar island keeps the spare lens in the blue copper chest"
ENDING = " beside the tide clock, wrapped in oiled sailcloth and tied with red cord."
MAX_FILE_BYTES = 64 * 1024


@pytest.fixture(scope="module")
def root(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("vector-stores")
    (corpus := root / "main-corpus").mkdir()
    (corpus / "docs.txt").write_text("The tide tables were mended before the boats went out again.\n")
    build_datastore([corpus], root / "main", tiny_model_dir, BuildConfig(index="flat", context_length=128, stride=64), progress=False)
    keys = [{"id": who, "sha256": key_hash(secret), "datastores": {"main": ["generate"]}} for who, secret in KEYS.items()]
    (root / "keys.yaml").write_text(yaml.safe_dump({"keys": keys}))
    return root


@pytest.fixture(scope="module")
def server(tiny_model_dir, root):
    knn = {
        "datastores": {"main": str(root / "main")},
        "k": 8,
        "lambda": 1.0,
        "keys_file": str(root / "keys.yaml"),
        "audit_log": str(root / "audit.jsonl"),
        "datastore_root": str(root),
        "files": {"max_file_bytes": MAX_FILE_BYTES},
        **STRICT_KNN,
    }
    with RunningServer({**TINY_SERVER, "model": str(tiny_model_dir), "knn": knn}, root, api_key=KEYS["alice"]) as server:
        yield server


def client(server, who: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEYS[who], max_retries=0)


@pytest.fixture(scope="module")
def alices_store(server):
    """Alice's store holding the fact, uploaded and polled as OpenAI's docs show."""
    alice = client(server, "alice")
    store = alice.vector_stores.create(name="handbook")
    done = alice.vector_stores.files.upload_and_poll(vector_store_id=store.id, file=("handbook.md", (FACT + ENDING).encode()))
    return store, done


def below(root: Path, text: str) -> list[Path]:
    """Every file below `root` whose bytes hold `text`."""
    return [p for p in root.rglob("*") if p.is_file() and text.encode() in p.read_bytes()]


def test_files_are_created_listed_read_and_deleted(server):
    alice = client(server, "alice")
    made = alice.files.create(file=("notes.txt", b"Plain notes about nothing in particular.\n"), purpose="user_data")
    assert (made.object, made.filename, made.purpose, made.bytes, made.status) == ("file", "notes.txt", "user_data", 41, "processed")
    assert made.id in [f.id for f in alice.files.list()] and alice.files.retrieve(made.id).filename == "notes.txt"
    assert alice.files.content(made.id).read() == b"Plain notes about nothing in particular.\n"
    assert alice.files.delete(made.id).deleted
    with pytest.raises(openai.NotFoundError):
        alice.files.retrieve(made.id)


def test_an_uploaded_file_is_searched_and_recalled_through_its_store(server, alices_store, tiny_model_dir):
    store, done = alices_store
    alice = client(server, "alice")
    assert done.status == "completed" and done.last_error is None and done.vector_store_id == store.id
    assert alice.vector_stores.retrieve(store.id).file_counts.completed == 1
    found = alice.vector_stores.search(store.id, query="Where does the keeper keep the spare lens?").data
    assert found and found[0].file_id == done.id and found[0].filename == "handbook.md" and "spare lens" in found[0].content[0].text
    # The store is a datastore of Alice's: kNN at λ 1 recalls the stored continuation.
    ids = continuations(tiny_model_dir, FACT, {"fact": FACT + ENDING}, 8)
    assert greedy(server, ids["prompt"], 8, api_key=KEYS["alice"], knn_datastore=store.id).token_ids == ids["fact"]


def test_a_batch_counts_an_invalid_file_as_failed(server):
    alice = client(server, "alice")
    store = alice.vector_stores.create(name="batch")
    files = [
        ("one.txt", b"The first good file says the orchard gate is painted green."),
        ("two.html", b"<html><body><p>The second good file says the barn roof is slate.</p></body></html>"),
        ("bad.jsonl", b'{"text": "fine"}\nnot json at all\n'),
    ]
    batch = alice.vector_stores.file_batches.upload_and_poll(vector_store_id=store.id, files=files)
    counts = batch.file_counts
    assert (counts.completed, counts.failed, counts.in_progress, counts.total) == (2, 1, 0, 3)
    failed = alice.vector_stores.files.list(store.id, filter="failed").data
    assert len(failed) == 1 and failed[0].last_error.code == "invalid_file" and "line 2" in failed[0].last_error.message
    alice.vector_stores.delete(store.id)


def test_another_key_gets_exactly_what_an_unknown_id_gets(server, alices_store):
    store, done = alices_store
    routes = [
        ("GET", "files/{file}"),
        ("GET", "files/{file}/content"),
        ("DELETE", "files/{file}"),
        ("GET", "vector_stores/{store}"),
        ("GET", "vector_stores/{store}/files/{file}"),
        ("POST", "vector_stores/{store}/search"),
        ("DELETE", "vector_stores/{store}"),
    ]
    for method, route in routes:
        answers = []
        for store_id, file_id in ((store.id, done.id), ("vs_" + "0" * 24, "file-" + "0" * 24)):
            url = f"{server.base_url}/v1/{route.format(store=store_id, file=file_id)}"
            r = requests.request(method, url, headers={"Authorization": f"Bearer {KEYS['bob']}"}, json={"query": "lens"}, timeout=30)
            answers.append((r.status_code, r.text.replace(store_id, "ID").replace(file_id, "FILE")))
        assert answers[0] == answers[1] and answers[0][0] == 404, (route, answers)
    assert store.id not in [s.id for s in client(server, "bob").vector_stores.list()]
    with pytest.raises(openai.BadRequestError) as refused:  # nor can Bob generate from it
        client(server, "bob").completions.create(
            model="tiny", prompt=FACT, max_tokens=2, extra_body={"vllm_xargs": {"knn_datastore": store.id}}
        )
    assert refused.value.body["param"] == "vllm_xargs.knn_datastore"
    assert client(server, "alice").vector_stores.retrieve(store.id).file_counts.completed == 1  # untouched


@pytest.mark.parametrize(
    "call, param",
    [
        (lambda c, s: c.files.create(file=("empty.txt", b""), purpose="assistants"), "file"),
        (lambda c, s: c.files.create(file=("blob.txt", b"\x00\x01\xff\xfe" * 64), purpose="assistants"), "file"),
        (lambda c, s: c.files.create(file=("big.txt", b"a " * MAX_FILE_BYTES), purpose="assistants"), "file"),
        (lambda c, s: c.files.create(file=("a.txt", b"text"), purpose="fine-tune"), "purpose"),
        (lambda c, s: c.vector_stores.search(s, query="lens", max_num_results=0), "max_num_results"),
        (lambda c, s: c.vector_stores.search(s, query="lens", max_num_results=51), "max_num_results"),
        (
            lambda c, s: c.vector_stores.create(
                chunking_strategy={"type": "static", "static": {"max_chunk_size_tokens": 50, "chunk_overlap_tokens": 0}}
            ),
            "chunking_strategy.static.max_chunk_size_tokens",
        ),
        (lambda c, s: c.vector_stores.files.create(s, file_id="file-" + "0" * 24), "file_id"),
    ],
)
def test_bad_input_is_refused_naming_its_field_and_nothing_is_kept(server, root, alices_store, call, param):
    alice = client(server, "alice")
    before = sorted(p.name for p in (root / ".knnlm-files").iterdir())
    with pytest.raises(openai.APIStatusError) as refused:
        call(alice, alices_store[0].id)
    assert 400 <= refused.value.status_code < 500 and refused.value.body["param"] == param, refused.value.body
    assert sorted(p.name for p in (root / ".knnlm-files").iterdir()) == before
    assert alice.vector_stores.retrieve(alices_store[0].id).file_counts.completed == 1  # still serving


def test_a_detached_and_deleted_file_leaves_no_copy_of_its_text(server, root, alices_store, tiny_model_dir):
    store, done = alices_store
    alice = client(server, "alice")
    other = alice.vector_stores.files.upload_and_poll(
        vector_store_id=store.id, file=("other.txt", b"The mill wheel turns slowly in the dry season.")
    )
    assert other.status == "completed" and below(root, "blue copper chest")
    alice.vector_stores.files.delete(done.id, vector_store_id=store.id)
    assert [f.id for f in alice.vector_stores.files.list(store.id).data] == [other.id]
    assert all(r.file_id != done.id for r in alice.vector_stores.search(store.id, query="spare lens copper chest").data)
    alice.files.delete(done.id)
    assert below(root, "blue copper chest") == [] and below(root, "oiled sailcloth") == []
    ids = continuations(tiny_model_dir, FACT, {"fact": FACT + ENDING}, 8)
    assert greedy(server, ids["prompt"], 8, api_key=KEYS["alice"], knn_datastore=store.id).token_ids != ids["fact"]  # nor recalled
    alice.vector_stores.delete(store.id)
    assert not (root / ".knnlm-vector-stores" / store.id).exists()
    assert [p.parent.name for p in below(root, "mill wheel")] == [".knnlm-files"]  # the upload itself, until it is deleted
