"""Files and Vector Stores through the unmodified `openai` client against a real server (tiny
model, two tenants' keys): an uploaded file becomes a kNN datastore owned by its key, searched and
recalled, and leaves no copy of its text behind once detached and deleted. The server is the one
test_tenants.py uses too (tests/tenant_server.py: Alice, Bob, `main` and an offline-built store
beside the tenants' datastores)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import openai
import pytest
import requests
from conftest import continuations, greedy, until
from tenant_server import KEYS, MAX_FILE_BYTES, TOKEN

from knnlm_serve.server.process import metric_total, scrape_metrics

pytestmark = pytest.mark.slow

FACT = "The harbour lighthouse keeper of Vellmar island keeps the spare lens in the blue copper chest"
ENDING = " beside the tide clock, wrapped in oiled sailcloth and tied with red cord."


@pytest.fixture(scope="module")
def root(tenant_root):
    return tenant_root


@pytest.fixture(scope="module")
def server(tenant_server):
    return tenant_server


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


def test_expires_after_sets_when_a_file_and_a_store_expire(server):
    """OpenAI's anchors: a file expires `seconds` after its creation, a store `days` after it was last
    active (an attach makes it active); an out-of-bounds expiry is refused naming the field."""
    alice = client(server, "alice")
    made = alice.files.create(
        file=("brief.txt", b"A short brief.\n"), purpose="assistants", expires_after={"anchor": "created_at", "seconds": 3600}
    )
    assert made.expires_at == made.created_at + 3600 == alice.files.retrieve(made.id).expires_at
    store = alice.vector_stores.create(name="brief", expires_after={"anchor": "last_active_at", "days": 2})
    assert store.expires_at == store.last_active_at + 2 * 86400 and store.status == "completed"
    with pytest.raises(openai.BadRequestError) as refused:
        alice.files.create(
            file=("brief.txt", b"A short brief.\n"), purpose="assistants", expires_after={"anchor": "created_at", "seconds": 60}
        )
    assert refused.value.body["param"] == "expires_after"
    alice.vector_stores.delete(store.id)
    alice.files.delete(made.id)


def test_an_expired_store_and_file_are_deleted_with_everything_written_for_them(tiny_model_dir, tmp_path, monkeypatch):
    """The server's expiry pass, in this process over its own root, with the clock moved a day
    and an hour ahead (no test can wait that long): the expired store goes with its datastore and
    its texts, the expired file with its bytes, and no file below the root holds the text; a store
    without `expires_after` stays."""
    import time

    from knnlm_core.config import KnnConfig
    from knnlm_core.config.serve import FilesConfig
    from knnlm_serve.runtime import ServedModel
    from knnlm_serve.server.document_jobs import DocumentJobs
    from knnlm_serve.server.registry import DatastoreRegistry
    from knnlm_serve.server.vector_stores import VectorStores

    registry = DatastoreRegistry(KnnConfig(backend="local", datastore_root=str(tmp_path)), ServedModel.inspect(tiny_model_dir), None)
    stores = VectorStores(registry, DocumentJobs(), FilesConfig())
    stores.start()
    kept = stores.create(None, "kept", {}, None)
    store = stores.create(None, "handbook", {}, {"anchor": "last_active_at", "days": 1})
    stored = stores.files.create(None, "handbook.md", "assistants", (FACT + ENDING).encode(), {"anchor": "created_at", "seconds": 3600})
    stores.attach(store, stored, {}, {})
    until(lambda: store.files[stored.id].status != "in_progress", 120, "the file's indexing")
    assert store.files[stored.id].status == "completed" and store.id in registry.runtime.datastores
    stores.expire()
    assert store.id in stores.stores and stores.files.by_id(stored.id) is not None, "nothing has expired yet"
    later = time.time() + 86400 + 3600 + 1
    monkeypatch.setattr(time, "time", lambda: later)
    stores.expire()
    assert list(stores.stores) == [kept.id] and stores.files.by_id(stored.id) is None
    assert store.id not in registry.runtime.datastores and not (stores.folder / store.id).exists()
    assert below(tmp_path, FACT) == []


def test_an_uploaded_file_is_searched_and_recalled_through_its_store(server, alices_store, tiny_model_dir):
    store, done = alices_store
    alice = client(server, "alice")
    assert done.status == "completed" and done.last_error is None and done.vector_store_id == store.id
    # How the store cut the file, in the form OpenAI's client parses (static sizes, never `auto`).
    assert done.chunking_strategy.type == "static" and done.chunking_strategy.static.chunk_overlap_tokens == 0
    assert 100 <= done.chunking_strategy.static.max_chunk_size_tokens <= 4096
    assert alice.vector_stores.retrieve(store.id).file_counts.completed == 1
    found = alice.vector_stores.search(store.id, query="Where does the keeper keep the spare lens?").data
    assert found and found[0].file_id == done.id and found[0].filename == "handbook.md" and "spare lens" in found[0].content[0].text
    # The store is a datastore of Alice's: kNN at λ 1 recalls the stored continuation.
    ids = continuations(tiny_model_dir, FACT, {"fact": FACT + ENDING}, 8)
    assert greedy(server, ids["prompt"], 8, api_key=KEYS["alice"], knn_datastore=store.id).token_ids == ids["fact"]
    # ... searched in vLLM's worker (knn.files.store_search): no shard actor of its own, unlike the config's.
    shards = requests.get(f"{server.base_url}/v1/knn/health", headers={"X-Admin-Token": TOKEN}, timeout=60).json()["shards"]
    assert {s["datastore"] for s in shards} == {"alpha", "beta", "main"}
    listed = {
        d["name"]: d
        for d in requests.get(f"{server.base_url}/v1/knn/datastores", headers={"X-Admin-Token": TOKEN}, timeout=60).json()["datastores"]
    }
    assert listed[store.id]["in_process"] and not listed["main"]["in_process"]


def test_a_store_built_offline_from_a_folder_serves_as_its_owners(server):
    (store,) = [s for s in client(server, "alice").vector_stores.list() if s.name == "offline"]
    assert store.file_counts.completed == store.file_counts.total == 1
    (hit, *_) = client(server, "alice").vector_stores.search(store.id, query="What colour is the orchard gate painted?").data
    assert hit.filename == "orchard.md" and "plum" in hit.content[0].text
    assert "offline" not in [s.name for s in client(server, "bob").vector_stores.list()]


def test_a_store_built_offline_while_the_server_runs_serves_at_the_first_request_naming_it(server, root, tiny_model_dir, tmp_path):
    (tmp_path / "mill.md").write_text("The Tolland foundry recast the harbour bell in bronze after the flood of the dry year.")
    built = subprocess.run(
        [sys.executable, "-m", "index_builder.cli", "vector-store", str(root), str(tmp_path / "mill.md"), "--name", "later"]
        + ["--owner", "alice", "--model", str(tiny_model_dir), "--index", "flat", "--context-length", "128", "--stride", "64", "--quiet"],
        capture_output=True,
        text=True,
    )
    assert built.returncode == 0, built.stderr[-2000:]
    made = json.loads(built.stdout)
    alice, bob = client(server, "alice"), client(server, "bob")
    with pytest.raises(openai.NotFoundError):
        bob.vector_stores.retrieve(made["id"])  # taken in, and still Alice's
    store = alice.vector_stores.retrieve(made["id"])
    assert store.name == "later" and store.file_counts.completed == 1
    assert store.id in [s.id for s in alice.vector_stores.list()] and store.id not in [s.id for s in bob.vector_stores.list()]
    (file_id,) = [f.id for f in alice.vector_stores.files.list(store.id)]
    assert alice.files.retrieve(file_id).filename == "mill.md"
    (hit, *_) = alice.vector_stores.search(store.id, query="What did the Tolland foundry recast the harbour bell in?").data
    assert hit.file_id == file_id and "bronze" in hit.content[0].text
    listed = requests.get(f"{server.base_url}/v1/knn/datastores", headers={"X-Admin-Token": TOKEN}, timeout=60).json()["datastores"]
    assert store.id in {d["name"] for d in listed}  # its datastore serves


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


def test_file_search_puts_the_stores_passages_in_the_answer_and_names_the_file(server, alices_store):
    store, done = alices_store
    alice = client(server, "alice")
    tools = [{"type": "file_search", "vector_store_ids": [store.id], "max_num_results": 3}]
    question = "Where does the keeper keep the spare lens?"
    asked = alice.responses.create(
        model="tiny", input=question, tools=tools, include=["file_search_call.results"], max_output_tokens=8, temperature=0
    )
    call, *rest = asked.output
    assert call.type == "file_search_call" and call.queries == [question] and call.status == "completed"
    assert call.results[0].file_id == done.id and call.results[0].filename == "handbook.md" and "spare lens" in call.results[0].text
    (message,) = [item for item in rest if item.type == "message"]
    assert [(a.type, a.file_id) for a in message.content[0].annotations] == [("file_citation", done.id)]
    # The passage went into the prompt: the same question costs more prompt tokens with the tool.
    plain = alice.responses.create(model="tiny", input=question, max_output_tokens=8, temperature=0)
    assert asked.usage.input_tokens > plain.usage.input_tokens + 20
    # Without `include`, the call's results are left out.
    assert alice.responses.create(model="tiny", input=question, tools=tools, max_output_tokens=4).output[0].results is None
    # Streamed as OpenAI streams it: the call's own events first at output index 0, the message's
    # at 1 with its citation, numbered in order; the client's stream helper builds the same response.
    with alice.responses.stream(model="tiny", input=question, tools=tools, max_output_tokens=4, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[2:7] == [
        "response.output_item.added",
        "response.file_search_call.in_progress",
        "response.file_search_call.searching",
        "response.file_search_call.completed",
        "response.output_item.done",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert {
        e.output_index for e in events if getattr(e, "output_index", None) is not None and e.type.startswith("response.output_text")
    } == {1}
    (added,) = [e for e in events if e.type == "response.output_text.annotation.added"]
    assert added.annotation.file_id == done.id and kinds.index(added.type) < kinds.index("response.output_text.done")
    assert [item.type for item in final.output] == ["file_search_call", "message"]
    assert final.output[1].content[0].annotations[0].file_id == done.id
    assert final.output[1].content[0].text == asked.output[1].content[0].text[: len(final.output[1].content[0].text)]
    # Another key naming the store gets what a store that does not exist gets.
    bob = [
        requests.post(
            f"{server.base_url}/v1/responses",
            headers={"Authorization": f"Bearer {KEYS['bob']}"},
            json={"model": "tiny", "input": question, "tools": [{"type": "file_search", "vector_store_ids": [vs]}]},
            timeout=60,
        )
        for vs in (store.id, "vs_" + "0" * 24)
    ]
    assert bob[0].status_code == bob[1].status_code == 404
    assert bob[0].text.replace(store.id, "ID") == bob[1].text.replace("vs_" + "0" * 24, "ID")


def test_a_store_whose_passages_cannot_be_read_answers_without_them_and_counts_it(server, root):
    """Fail open: a damaged passage file fails no request; the answer has no results, and it is
    counted (under every vector store's one label)."""
    alice = client(server, "alice")
    store = alice.vector_stores.create(name="damaged")
    alice.vector_stores.files.upload_and_poll(vector_store_id=store.id, file=("d.txt", b"The damaged store once held notes on the kiln."))
    (root / ".knnlm-vector-stores" / store.id / "datastore" / "passages.sqlite").write_bytes(b"not a database" * 100)
    key = 'knnlm_context_failures_total{datastore="vector_stores"}'
    before = scrape_metrics(server.base_url).get(key, 0)
    tools = [{"type": "file_search", "vector_store_ids": [store.id]}]
    asked = alice.responses.create(
        model="tiny", input="What did the kiln notes say?", tools=tools, include=["file_search_call.results"], max_output_tokens=4
    )
    assert asked.output[0].type == "file_search_call" and asked.output[0].results == []
    assert scrape_metrics(server.base_url).get(key, 0) == before + 1
    alice.vector_stores.delete(store.id)


def test_two_keys_under_load_never_see_each_others_files_or_secrets(server, root, alices_store):
    """32 clients at once, each key's mixing uploads, searches, file_search answers and streams
    against its own store, and probing the other's ids: no answer of one key names the other's."""
    import concurrent.futures
    import random

    store_a, done_a = alices_store
    bob = client(server, "bob")
    secret_b = "The cellar of the Orrin mill hides the brass ledger under the third flagstone"
    store_b = bob.vector_stores.create(name="bob")
    done_b = bob.vector_stores.files.upload_and_poll(vector_store_id=store_b.id, file=("ledger.txt", secret_b.encode()))
    assert done_b.status == "completed"
    own = {"alice": (store_a.id, done_a.id, "blue copper chest"), "bob": (store_b.id, done_b.id, "brass ledger")}

    def one(n: int) -> tuple[str, list[str]]:
        who = ("alice", "bob")[n % 2]
        other = "bob" if who == "alice" else "alice"
        me, c, rng = own[who], client(server, who), random.Random(n)
        seen = []
        for kind in rng.sample(["search", "respond", "stream", "list", "probe", "upload"], 4):
            if kind == "search":
                seen += [r.model_dump_json() for r in c.vector_stores.search(me[0], query="where is it kept hidden").data]
            elif kind == "respond":
                tools = [{"type": "file_search", "vector_store_ids": [me[0]]}]
                seen.append(c.responses.create(model="tiny", input="Where is it kept?", tools=tools, max_output_tokens=6).model_dump_json())
            elif kind == "stream":
                xargs = {"knn_datastore": me[0], "knn_context": 1}
                chunks = c.completions.create(
                    model="tiny", prompt="Where is it kept?", max_tokens=6, stream=True, extra_body={"vllm_xargs": xargs}
                )
                seen += [chunk.model_dump_json() for chunk in chunks]
            elif kind == "list":
                seen += [c.files.list().model_dump_json(), c.vector_stores.list().model_dump_json()]
            elif kind == "probe":
                for route in (f"vector_stores/{own[other][0]}", f"files/{own[other][1]}"):
                    r = requests.get(f"{server.base_url}/v1/{route}", headers={"Authorization": f"Bearer {KEYS[who]}"}, timeout=120)
                    assert r.status_code == 404
                    seen.append(r.text.replace(own[other][0], "").replace(own[other][1], ""))  # its own words, not the id it sent
            elif n < 2:  # an upload of each key's: an add
                f = c.files.create(file=(f"note-{n}.txt", f"Note {n} of {who}: the kettle is on the stove.".encode()), purpose="assistants")
                seen.append(c.vector_stores.files.create(me[0], file_id=f.id).model_dump_json())
        return who, seen

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(one, range(32)))
    for who, seen in answers:
        other = own["bob" if who == "alice" else "alice"]
        leaked = [s for s in seen if any(mark in s for mark in other)]
        assert leaked == [], (who, leaked[:2])
    for line in map(json.loads, (root / "audit.jsonl").read_text().splitlines()):
        if line["key_id"] in own and line["decision"] == "allowed" and line["status"] != 404:  # a refusal names only what its key sent
            other = own["bob" if line["key_id"] == "alice" else "alice"]
            assert not any(mark in json.dumps(line) for mark in other), json.dumps(line)
    bob.vector_stores.delete(store_b.id)


def test_a_detached_and_deleted_file_leaves_no_copy_of_its_text(server, root, alices_store, tiny_model_dir):
    store, done = alices_store
    alice = client(server, "alice")
    other = alice.vector_stores.files.upload_and_poll(
        vector_store_id=store.id, file=("other.txt", b"The mill wheel turns slowly in the dry season.")
    )
    assert other.status == "completed" and below(root, "blue copper chest")
    alice.vector_stores.files.delete(done.id, vector_store_id=store.id)
    listed = [f.id for f in alice.vector_stores.files.list(store.id).data]
    assert other.id in listed and done.id not in listed
    assert all(r.file_id != done.id for r in alice.vector_stores.search(store.id, query="spare lens copper chest").data)
    alice.files.delete(done.id)
    assert below(root, "blue copper chest") == [] and below(root, "oiled sailcloth") == []
    ids = continuations(tiny_model_dir, FACT, {"fact": FACT + ENDING}, 8)
    assert greedy(server, ids["prompt"], 8, api_key=KEYS["alice"], knn_datastore=store.id).token_ids != ids["fact"]  # nor recalled
    alice.vector_stores.delete(store.id)
    assert not (root / ".knnlm-vector-stores" / store.id).exists()
    assert [p.parent.name for p in below(root, "mill wheel")] == [".knnlm-files"]  # the upload itself, until it is deleted


def test_metrics_count_every_vector_store_under_one_label_and_name_none(server):
    """Stores come and go at users' will and no series is ever removed: a store's requests,
    searches and jobs are counted under `datastore="vector_stores"`, and no series names its id."""
    alice = client(server, "alice")
    store = alice.vector_stores.create(name="counted")
    alice.vector_stores.files.upload_and_poll(vector_store_id=store.id, file=("c.txt", b"The counted store holds a note on the ferry."))
    before = scrape_metrics(server.base_url)
    greedy(server, [1, 2, 3], 2, api_key=KEYS["alice"], knn_datastore=store.id, knn_skip_threshold=1.0)  # every row searched
    text = requests.get(f"{server.base_url}/metrics", timeout=30).text
    assert store.id not in text and "vs_" not in text
    after = scrape_metrics(server.base_url)
    label = 'datastore="vector_stores"'
    assert after[f"knnlm_requests_total{{{label}}}"] == before.get(f"knnlm_requests_total{{{label}}}", 0) + 1
    assert metric_total(after, rf"knnlm_retrieval_steps_total\{{{label}") > metric_total(before, rf"knnlm_retrieval_steps_total\{{{label}")
    assert metric_total(after, rf'knnlm_document_jobs_total\{{{label},job="build",result="done"') >= 1
    alice.vector_stores.delete(store.id)
