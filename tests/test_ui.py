"""The kNN page (knn.ui) in a real browser: Debian's headless chromium driven by Playwright, against
a real server (tiny model, memorised text, λ 1). `KNNLM_SCREENSHOTS=docs` also writes each view's
screenshot into docs/ui/ (what the docs show)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from local_server import TOKEN, folder_below_root, serving

from index_builder.build import build_datastore
from knnlm_core.config import BuildConfig

pytestmark = pytest.mark.slow

NAME = "page"  # the datastore the page serves by default (λ 1)
PREFIX = "The vault under the old lighthouse opens only when the keeper says the words"
FACT = " zebra quartz maple lantern orbit velvet cobalt thistle ember falcon nimbus quill."
ADDED_PREFIX = "The ferry to the northern islands leaves only after the harbour master rings"
ADDED = " seven copper bells, then a silver gong, and the gulls answer from the breakwater."
DOCS = Path(__file__).resolve().parents[1] / "docs" / "ui"


@pytest.fixture(scope="module")
def server(local_server, tiny_model_dir):
    (corpus := folder_below_root(local_server, "page") / "corpus").mkdir()
    records = [
        {"id": "vault-doc", "text": PREFIX + FACT},
        {"id": "tide-doc", "text": "High tide came at six, and the nets were mended before the boats went out again."},
    ]
    (corpus / "docs.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    docs = corpus.parent / "docs"
    build_datastore([corpus], docs, tiny_model_dir, BuildConfig(index="flat", context_length=128, stride=64), progress=False)
    with serving(local_server, {NAME: docs}, default=NAME):
        yield local_server


@pytest.fixture
def page(browser, server):
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.goto(f"{server.base_url}/knn/ui/")
    page.wait_for_function("window.servedModel !== undefined")
    yield page
    page.close()


def screenshot(page, name: str, tmp_path) -> None:
    target = DOCS if os.environ.get("KNNLM_SCREENSHOTS") == "docs" else tmp_path
    target.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(target / f"{name}.png"), full_page=True)


def run(page, prompt: str, **fields) -> None:
    page.fill("#prompt", prompt)
    for field, value in fields.items():
        page.fill(f"#{field}", str(value))
    page.click("#run")
    page.wait_for_function("!document.getElementById('run').disabled", timeout=180_000)


def test_stored_text_streams_differently_with_knn_on_and_off_side_by_side(page, tmp_path):
    run(page, PREFIX, max_tokens=12)
    assert page.locator("#error").is_hidden(), page.inner_text("#error")
    on, off = page.inner_text("#out-on"), page.inner_text("#out-off")
    assert FACT.startswith(on) and len(on) > 20 and on != off
    screenshot(page, "compare", tmp_path)


def test_a_token_is_shaded_by_its_datastore_share_and_opens_the_document_that_holds_the_text(page, tmp_path):
    run(page, PREFIX, max_tokens=12)
    tokens = page.locator("#out-on .tok")
    assert tokens.count() >= 8
    shares = [float(tokens.nth(i).get_attribute("data-share")) for i in range(tokens.count())]
    assert min(shares) > 0.99  # λ 1: every token came from the datastore
    assert "rgba(31, 111, 235" in tokens.nth(2).get_attribute("style")
    tokens.nth(2).click()
    first = page.locator("#neighbours tr").first
    assert first.locator("a.document").inner_text() == "vault-doc"
    assert page.locator("#neighbours .snippet mark").first.inner_text().strip() in FACT
    first.locator("a.document").click()
    page.wait_for_selector("#document-text:not(:empty)")
    assert PREFIX + FACT in page.inner_text("#document-text")
    screenshot(page, "token", tmp_path)


def test_a_question_in_other_words_lists_the_passage_put_in_its_prompt(page, tmp_path):
    run(page, "Question: what must the keeper say before the lighthouse vault opens?\nAnswer:", knn_context=1, max_tokens=4)
    assert page.locator("#error").is_hidden(), page.inner_text("#error")
    passages = page.locator("#passage-list li.passage")
    assert passages.count() == 1 and passages.first.inner_text().startswith("vault-doc")
    assert FACT.strip() in passages.first.locator(".passage-text").inner_text()  # the passage's own text
    screenshot(page, "passages", tmp_path)


def test_an_admin_add_through_the_page_changes_the_answer_and_the_token_is_never_kept(page, server, tmp_path):
    run(page, ADDED_PREFIX, max_tokens=10)
    before = page.inner_text("#out-on")
    assert not ADDED.startswith(before)
    page.click("#show-datastores")
    page.fill("#admin-token", TOKEN)
    page.dispatch_event("#admin-token", "change")
    page.wait_for_selector(f"#datastore-rows tr[data-name={NAME}]")
    assert page.inner_text(f"#datastore-rows tr[data-name={NAME}] td:nth-child(2)") == "1"  # version
    page.fill("#add-datastore", NAME)
    page.fill("#add-id", "ferry-doc")
    page.fill("#add-text", ADDED_PREFIX + ADDED)
    page.click("#add")
    page.wait_for_function("document.getElementById('job').textContent.includes(': done')", timeout=300_000)
    page.wait_for_function(f"document.querySelector('#datastore-rows tr[data-name={NAME}] td:nth-child(2)').textContent === '2'")
    screenshot(page, "datastores", tmp_path)
    page.click("#show-compare")
    run(page, ADDED_PREFIX, max_tokens=10)
    after = page.inner_text("#out-on")
    assert after != before and ADDED.startswith(after), after
    assert page.evaluate("localStorage.length + sessionStorage.length") == 0 and TOKEN not in page.content()
    assert str(server.config["knn"]["datastore_root"]) not in page.content()  # no server path shown


def test_a_file_uploaded_to_a_new_vector_store_through_the_page_is_followed_to_completed_and_recalled(page, tmp_path):
    prefix, ending = "The lamplighter of the western quay keeps his ladder behind", " the chandler's shop beside the crooked chimney."
    page.click("#show-stores")
    page.fill("#store-name", "quay notes")
    page.click("#create-store")
    page.wait_for_function("document.getElementById('upload-store').options.length > 0")
    page.set_input_files("#upload-file", files=[{"name": "quay.md", "mimeType": "text/markdown", "buffer": (prefix + ending).encode()}])
    page.click("#upload")
    page.wait_for_function("document.getElementById('upload-status').textContent.includes(': completed')", timeout=300_000)
    assert page.locator("#store-error").is_hidden(), page.inner_text("#store-error")
    store = page.eval_on_selector("#upload-store", "s => s.value")
    assert ": completed" in page.inner_text(f"#store-rows tr[data-id={store}]")
    screenshot(page, "vector-stores", tmp_path)
    # The store is a datastore: chosen in the Compare tab, it recalls the uploaded text.
    page.fill("#admin-token", TOKEN)
    page.dispatch_event("#admin-token", "change")
    page.click("#show-compare")
    page.wait_for_function(f"[...document.getElementById('datastore').options].some(o => o.value === '{store}')")
    page.select_option("#datastore", store)
    run(page, prefix, max_tokens=8)
    assert ending.startswith(page.inner_text("#out-on")) and page.inner_text("#out-on"), page.inner_text("#out-on")


@pytest.mark.parametrize("field, value, param", [("knn_lambda", "2", "vllm_xargs.knn_lambda"), ("knn_k", "many", "vllm_xargs.knn_k")])
def test_a_refused_knob_shows_the_apis_message_naming_the_field(page, field, value, param, tmp_path):
    run(page, PREFIX, **{field: value})
    assert page.locator("#error").is_visible() and param in page.inner_text("#error")
    assert page.locator("#run").is_enabled()  # the page did not hang on the refused stream
