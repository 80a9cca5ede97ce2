"""Tenants (knn.keys_file) through the real server: each API key reaches only its own datastores,
on every route, alone and in batches shared with another tenant's rows (tiny model, memorised text).

Both datastores hold the same opening sentence, each with its own continuation: a completion of it
says which store its neighbours came from. The server is the one test_vector_stores.py uses too
(tests/tenant_server.py: one start for both)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest
import requests
import yaml
from conftest import TINY_SERVER, continuations, greedy, until
from tenant_server import ALL, ENDINGS, KEY_FILE, KEYS, PREFIX, TOKEN, grant, write_keys

from knnlm_core.keys_file import key_hash
from knnlm_serve.server.process import scrape_metrics

pytestmark = pytest.mark.slow

QUESTION = "Which words does the keeper say to open the vault under the old lighthouse?"
LENGTH = 10


@pytest.fixture(scope="module")
def root(tenant_root):
    return tenant_root


@pytest.fixture(scope="module")
def server(tenant_server):
    return tenant_server


@pytest.fixture(scope="module")
def ids(tiny_model_dir):
    return continuations(tiny_model_dir, PREFIX, {name: PREFIX + e for name, e in ENDINGS.items()}, LENGTH)


def call(server, method: str, route: str, key: str | None, headers: dict | None = None, **body) -> requests.Response:
    auth = {"Authorization": f"Bearer {key}"} if key else {}
    return requests.request(method, f"{server.base_url}{route}", json=body or None, headers={**auth, **(headers or {})}, timeout=120)


def audit_lines(root: Path) -> list[dict]:
    path = root / "audit.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_each_key_reads_only_its_own_datastore_on_every_route(server, root, ids):
    for key, mine, other in ((KEYS["a"], "alpha", "beta"), (KEYS["b"], "beta", "alpha")):
        listing = call(server, "GET", "/v1/knn/datastores", key).json()
        assert [d["name"] for d in listing["datastores"]] == [mine] and listing["default"] == mine
        assert "path" not in listing["datastores"][0] and listing["datastores"][0]["rights"] == ALL
        # completions (with drafts and pointers on), named or by the key's default: the key's own store
        for xargs in ({}, {"knn_datastore": mine}, {"knn_pointers": 1}):
            assert greedy(server, ids["prompt"], LENGTH, api_key=key, **xargs).token_ids == ids[mine], xargs
        chat = server.openai_client(key).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": QUESTION}], max_tokens=4, extra_body={"vllm_xargs": {"knn_context": 1}}
        )
        used = chat.model_extra["knn_context"]
        assert used["datastore"] == mine and [p["id"] for p in used["passages"]] == [f"{mine}-vault"]
        # prompt logprobs: the stored continuation is near certain from the key's own store
        scored = server.openai_client(key).completions.create(
            model="tiny", prompt=ids["prompt"] + ids[mine], max_tokens=1, echo=True, logprobs=1, temperature=0
        )
        assert min(scored.choices[0].logprobs.token_logprobs[len(ids["prompt"]) :]) > -0.01
        explained = call(server, "POST", "/v1/knn/explain", key, prompt=PREFIX, max_tokens=LENGTH, vllm_xargs={"knn_explain": 8})
        assert explained.status_code == 200, explained.text
        neighbours = [n for t in explained.json()["tokens"] for n in t["neighbours"]]
        assert f"{mine}-vault" in {n["id"] for n in neighbours} and all(n["id"].startswith(mine) for n in neighbours)
        assert call(server, "GET", f"/v1/knn/documents/{mine}/0", key).status_code == 200
        assert call(server, "GET", f"/v1/knn/documents/{other}/0", key).status_code == 404
    lines = [line for line in audit_lines(root) if line["key_id"] in ("team-a", "team-b")]
    denied = [(line["key_id"], line["datastore"], line["reason"], line["status"]) for line in lines if line["decision"] == "denied"]
    assert denied == [("team-a", "beta", "not_granted", 404), ("team-b", "alpha", "not_granted", 404)]
    lines = [line for line in lines if line["decision"] == "allowed"]
    assert all(line["datastore"] == {"team-a": "alpha", "team-b": "beta"}[line["key_id"]] for line in lines)
    shown = {(line["key_id"], d["as"], d["id"]) for line in lines for d in line["documents"]}
    assert {("team-a", "passage", "alpha-vault"), ("team-a", "snippet", "alpha-vault"), ("team-a", "whole", "alpha-vault")} <= shown
    assert all(doc.startswith({"team-a": "alpha", "team-b": "beta"}[key_id]) for key_id, _, doc in shown)


@pytest.mark.parametrize(
    "method, route, body",
    [
        ("POST", "/v1/completions", {"model": "tiny", "prompt": PREFIX, "max_tokens": 2, "vllm_xargs": {"knn_datastore": "{}"}}),
        (
            "POST",
            "/v1/chat/completions",
            {"model": "tiny", "messages": [{"role": "user", "content": QUESTION}], "vllm_xargs": {"knn_datastore": "{}", "knn_context": 1}},
        ),
        ("POST", "/v1/knn/explain", {"prompt": PREFIX, "vllm_xargs": {"knn_datastore": "{}"}}),
        ("GET", "/v1/knn/documents/{}/0", {}),
    ],
    ids=["completions", "chat-with-passages", "explain", "documents"],
)
def test_another_tenants_datastore_is_refused_byte_for_byte_as_one_that_does_not_exist(server, root, method, route, body):
    def asking(name: str) -> requests.Response:
        filled = json.loads(json.dumps(body).replace("{}", name)) if body else {}
        return call(server, method, route.replace("{}", name), KEYS["a"], **filled)

    hidden, unknown = asking("beta"), asking("no-such-store")
    assert hidden.status_code == unknown.status_code and hidden.status_code in (400, 404), hidden.text
    assert hidden.content.replace(b"beta", b"NAME") == unknown.content.replace(b"no-such-store", b"NAME")
    assert b"alpha" not in hidden.content  # no list of the names a key may use, its own or another's
    reasons = [line["reason"] for line in audit_lines(root) if line["route"] == route.replace("{}", "beta") or line["datastore"] == "beta"]
    assert "not_granted" in reasons  # the audit log knows what the client was not told


def test_a_right_the_key_lacks_is_a_403_naming_it_and_no_default_means_knn_off(server, ids):
    for route, body, right in (
        ("/v1/knn/explain", {"prompt": PREFIX, "vllm_xargs": {"knn_datastore": "alpha"}}, "explain"),
        ("/v1/knn/documents/alpha/0", {}, "documents"),
    ):
        response = call(server, "POST" if body else "GET", route, KEYS["gen"], **body)
        assert response.status_code == 403 and f"right '{right}'" in response.json()["error"]["message"], response.text
    # gen-only has no default datastore: naming none is kNN off, never the server's default (beta)
    off = greedy(server, ids["prompt"], LENGTH, api_key=KEYS["gen"], knn=False).token_ids
    assert greedy(server, ids["prompt"], LENGTH, api_key=KEYS["gen"]).token_ids == off != ids["beta"]
    assert greedy(server, ids["prompt"], LENGTH, api_key=KEYS["gen"], knn_datastore="alpha").token_ids == ids["alpha"]


@pytest.mark.parametrize(
    "headers, message",
    [
        ({}, "no API key given"),
        ({"Authorization": "Bearer sk-knn-not-a-key"}, "Incorrect API key"),
        ({"Authorization": f"Bearer {KEYS['old']}"}, "expired"),
        ({"Authorization": KEYS["a"]}, "not of the form `Bearer <key>`"),
        ({"X-Api-Key": KEYS["a"]}, "this server reads Authorization"),
    ],
    ids=["missing", "wrong", "expired", "no-bearer", "wrong-header"],
)
def test_a_missing_wrong_expired_or_misformed_key_is_a_401_that_never_echoes_it(server, headers, message):
    for method, route in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/v1/knn/datastores"), ("POST", "/tokenize")):
        response = requests.request(method, f"{server.base_url}{route}", json={"model": "tiny", "prompt": "x"}, headers=headers, timeout=60)
        assert response.status_code == 401, (route, response.text)
        error = response.json()["error"]
        assert error["code"] == "invalid_api_key" and message in error["message"]
        for secret in headers.values():
            secret = secret.removeprefix("Bearer ")
            assert secret not in response.text and key_hash(secret) not in response.text
    assert call(server, "GET", "/health", None).status_code == 200  # the probes stay open


def test_a_key_sent_twice_is_a_401(server):
    twice = [("Authorization", f"Bearer {KEYS['a']}"), ("Authorization", f"Bearer {KEYS['b']}")]
    import http.client

    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    connection.putrequest("GET", "/v1/models")
    for name, value in twice:
        connection.putheader(name, value)
    connection.endheaders()
    response = connection.getresponse()
    body = response.read().decode()
    assert response.status == 401 and "more than once" in body and KEYS["a"] not in body


def test_keys_are_added_revoked_and_rotated_through_the_file_without_a_restart(server, root):
    keys = root / "keys.yaml"
    models = lambda key: call(server, "GET", "/v1/models", key).status_code  # noqa: E731
    assert models(KEYS["new"]) == 401
    write_keys(keys, [*KEY_FILE, grant("newcomer", KEYS["new"], {"beta": ["generate"]}, default="beta")])
    assert models(KEYS["new"]) == 200
    assert [d["name"] for d in call(server, "GET", "/v1/knn/datastores", KEYS["new"]).json()["datastores"]] == ["beta"]
    rotated = KEYS["new"] + "-rotated"  # the same id with a new secret: the old one stops at once
    write_keys(keys, [*KEY_FILE, grant("newcomer", rotated, {"beta": ["generate"]})])
    assert models(KEYS["new"]) == 401 and models(rotated) == 200
    keys.write_text("keys: [{id: broken")  # a half-written file: the keys before it stay in force
    assert models(rotated) == 200 and models(KEYS["a"]) == 200
    write_keys(keys, KEY_FILE)  # revoked
    assert models(rotated) == 401 and models(KEYS["a"]) == 200
    assert "knn.keys_file" in server.log_tail(20000) and "not valid YAML" in server.log_tail(20000)


def test_past_its_limits_a_key_gets_429_with_retry_after(server, ids):
    statuses = [call(server, "GET", "/v1/models", KEYS["rpm"]).status_code for _ in range(4)]
    assert statuses == [200, 200, 200, 429]
    limited = call(server, "GET", "/v1/models", KEYS["rpm"])
    assert limited.status_code == 429 and 1 <= int(limited.headers["Retry-After"]) <= 60
    assert "requests per minute" in limited.json()["error"]["message"]
    # tokens: a stream's usage counts, though its client did not ask for usage (nor sees it)
    stream = server.openai_client(KEYS["tpm"]).completions.create(model="tiny", prompt=ids["prompt"], max_tokens=LENGTH, stream=True)
    chunks = list(stream)
    assert all(c.choices for c in chunks) and all(getattr(c, "usage", None) is None for c in chunks)
    with pytest.raises(openai.RateLimitError) as refused:  # (the client would wait Retry-After's seconds and retry)
        server.openai_client(KEYS["tpm"]).with_options(max_retries=0).completions.create(model="tiny", prompt=ids["prompt"], max_tokens=2)
    assert "tokens per minute" in str(refused.value) and int(refused.value.response.headers["Retry-After"]) >= 1
    assert greedy(server, ids["prompt"], LENGTH, api_key=KEYS["a"]).token_ids == ids["alpha"]  # other keys keep being served


def test_thirty_two_streams_of_two_tenants_share_batches_and_never_see_each_others_store(server, root, ids):
    before = len(audit_lines(root))
    results, errors = [], []

    def client(i: int) -> None:
        mine, key = ("alpha", KEYS["a"]) if i % 2 == 0 else ("beta", KEYS["b"])
        openai_client = server.openai_client(key)
        try:
            for _ in range(3):
                if i % 4 < 2:  # streamed completions of the shared sentence
                    stream = openai_client.completions.create(
                        model="tiny",
                        prompt=ids["prompt"],
                        max_tokens=LENGTH,
                        temperature=0,
                        stream=True,
                        extra_body={"return_token_ids": True},
                    )
                    tokens = [t for c in stream for t in (c.choices[0].token_ids or [])]
                    results.append(("tokens", mine, tokens == ids[mine]))
                elif i % 8 < 6:  # chat with passages, sampled (temperature 1): steps mix greedy and sampled rows with drafts
                    chat = openai_client.chat.completions.create(
                        model="tiny",
                        messages=[{"role": "user", "content": QUESTION}],
                        max_tokens=4,
                        extra_body={"vllm_xargs": {"knn_context": 1}},
                    )
                    used = chat.model_extra["knn_context"]
                    results.append(
                        ("passages", mine, used["datastore"] == mine and all(p["id"].startswith(mine) for p in used["passages"]))
                    )
                else:  # explanations
                    response = call(server, "POST", "/v1/knn/explain", key, prompt=PREFIX, max_tokens=LENGTH, vllm_xargs={"knn_explain": 8})
                    assert response.status_code == 200, response.text
                    tokens = response.json()["tokens"]
                    assert all(t["p_knn"] > 0 for t in tokens), [(t["token"], t["status"], t["p_knn"]) for t in tokens]  # λ 1
                    docs = {n["id"] for t in tokens for n in t["neighbours"]}
                    results.append(("snippets", mine, f"{mine}-vault" in docs and all(d.startswith(mine) for d in docs)))
        except Exception as e:  # noqa: BLE001 - every failure is the test's to report
            errors.append(repr(e))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not errors, errors[:3]
    assert len(results) == 96 and all(ok for _, _, ok in results), [r for r in results if not r[2]][:5]
    lines = audit_lines(root)[before:]
    assert len(lines) == 96 and all(line["status"] == 200 and line["decision"] == "allowed" for line in lines)
    assert all(line["datastore"] == {"team-a": "alpha", "team-b": "beta"}[line["key_id"]] for line in lines)
    assert all(d["id"].startswith(line["datastore"]) for line in lines for d in line["documents"])


def test_the_admin_token_keeps_the_admin_routes_and_metrics_count_by_key(server):
    listing = requests.get(f"{server.base_url}/v1/knn/datastores", headers={"X-Admin-Token": TOKEN}, timeout=30).json()
    assert sorted(d["name"] for d in listing["datastores"] if not d["name"].startswith("vs_")) == ["alpha", "beta", "main"]
    assert call(server, "GET", "/v1/knn/health", KEYS["a"]).status_code == 401  # a tenant key is no admin token
    until(
        lambda: scrape_metrics(server.base_url).get('knnlm_tenant_requests_total{decision="allowed",key="team-a"}', 0) > 0, 30, "no metric"
    )
    values = scrape_metrics(server.base_url)
    assert values.get('knnlm_tenant_tokens_total{key="team-a"}', 0) > 0
    assert values.get('knnlm_tenant_denials_total{key="none",reason="unknown"}', 0) > 0
    assert all("sk-knn" not in name for name in values)


def test_a_server_with_a_bad_keys_file_refuses_to_start_naming_the_field(server, root, tiny_model_dir, tmp_path):
    bad = tmp_path / "keys.yaml"
    bad.write_text(yaml.safe_dump({"keys": [grant("x", "s", {"alpha": ["read"]})]}))
    config = {**TINY_SERVER, "model": str(tiny_model_dir), "knn": {"datastores": {"alpha": str(root / "alpha")}, "keys_file": str(bad)}}
    (tmp_path / "serve.yaml").write_text(yaml.safe_dump(config))
    started = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", "knnlm_serve.server.launcher", "--config", str(tmp_path / "serve.yaml")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode != 0 and "keys.0.datastores.alpha.0" in run.stderr and "'generate', 'explain' or 'documents'" in run.stderr
    assert time.monotonic() - started < 120  # before vLLM loads the model
    assert call(server, "GET", "/v1/models", KEYS["a"]).status_code == 200


def test_the_knn_page_with_a_key_shows_and_uses_only_that_keys_datastore(server, browser):
    page = browser.new_page()
    page.goto(f"{server.base_url}/knn/ui/")  # the page's files need no key; every call it makes sends the one typed
    page.fill("#api-key", KEYS["b"])
    page.dispatch_event("#api-key", "change")
    page.wait_for_function("window.servedModel !== undefined && document.querySelectorAll('#datastore option').length > 1")
    assert page.eval_on_selector_all("#datastore option", "options => options.map(o => o.value)") == ["", "beta"]
    page.fill("#prompt", PREFIX)
    page.fill("#max_tokens", "8")
    page.click("#run")
    page.wait_for_function("!document.getElementById('run').disabled", timeout=180_000)
    on = page.inner_text("#out-on")
    assert page.locator("#error").is_hidden() and len(on) > 10 and ENDINGS["beta"].startswith(on), on
    assert "alpha" not in page.content() and KEYS["b"] not in page.content()
    page.close()


def test_knobs_forged_through_a_route_admission_does_not_check_reach_no_datastore(server, ids):
    """vLLM's Anthropic route takes vllm_xargs too: a wire of the API server's own form naming
    another tenant's store is served LM-only (the workers want the admission token)."""
    forged = {"enabled": True, "datastore": "beta", "lambda_": 1.0, "k": 8, "admitted": "0" * 32}
    searched = lambda: scrape_metrics(server.base_url).get('knnlm_retrieval_steps_total{datastore="beta"}', 0)  # noqa: E731
    before = searched()
    body = {
        "model": "tiny",
        "max_tokens": 4,
        "messages": [{"role": "user", "content": PREFIX}],
        "vllm_xargs": {"knnlm": json.dumps(forged)},
    }
    response = call(server, "POST", "/v1/messages", KEYS["a"], **body)
    assert response.status_code == 200, response.text
    time.sleep(2)  # the workers' counters reach /metrics through their multiprocess files
    assert searched() == before
