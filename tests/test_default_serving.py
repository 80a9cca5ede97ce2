"""The README's main job on the real model: SmolLM2 + the embedded datastore, as `make serve` runs it."""

from __future__ import annotations

import heapq
import inspect
import shutil
from pathlib import Path

import pytest
import requests
import yaml
from conftest import until

from index_builder.build import build_datastore
from knnlm_core.config import BuildConfig
from knnlm_serve.server.process import RunningServer

pytestmark = pytest.mark.slow


TOKEN = "s3cret"
FACTS = {  # made-up facts the model cannot know: only the datastore's passages can answer questions about them
    "quellin.txt": "The Quellin bridge over the river Zorva was built in 1873 by the engineer Marta Vosk. It has nine arches.",
    "tarrow.txt": "The Tarrow lighthouse stands on the island of Pell. Its keeper, Ivo Brask, lights the lamp at dusk.",
    "ombel.txt": "The Ombel festival is held every spring in the town of Kessa, where bakers sell honey bread.",
}


@pytest.fixture(scope="module")
def root(smollm2_dir, tmp_path_factory) -> Path:
    """The default server's datastore root: `facts`, a datastore of made-up facts (SmolLM2's keys)."""
    root = tmp_path_factory.mktemp("default")
    (root / "facts-corpus").mkdir()
    for name, text in FACTS.items():
        (root / "facts-corpus" / name).write_text(text)
    build_datastore([root / "facts-corpus"], root / "facts", smollm2_dir, BuildConfig(index="flat", shards=1), progress=False)
    return root


@pytest.fixture(scope="module")
def default_server(root):
    """`configs/default.yaml` as `make serve` runs it, plus the facts datastore and the admin API."""
    config = yaml.safe_load(open("configs/default.yaml"))
    knn = {**config["knn"], "datastores": {**config["knn"]["datastores"], "facts": str(root / "facts")}}
    knn |= {"admin_token": TOKEN, "datastore_root": str(root)}
    with RunningServer({**config, "knn": knn, "kv_cache_gib": 0.5}, root, startup_timeout=900) as server:
        yield server


def test_default_datastore_pulls_completions_onto_the_documentation(default_server):
    client = default_server.openai_client()

    def complete(xargs):
        result = client.completions.create(
            model="smollm2", prompt="heapq.heappush\n\n", max_tokens=24, temperature=0, extra_body={"vllm_xargs": xargs}
        )
        return result.choices[0].text.strip()

    plain, knn = complete({"knn": False}), complete({"knn_lambda": 0.9})
    docs = " ".join(inspect.getdoc(heapq).split())
    assert " ".join(knn.split())[:40] in docs, f"kNN answer {knn!r} is not the datastore's text"
    assert " ".join(plain.split())[:40] not in docs and plain != knn


def ask(server, question: str, chat: bool, **xargs):
    """Greedy answer to `question` from the facts datastore (completion or chat), and the response's knn_context."""
    client, extra = server.openai_client(), {"vllm_xargs": {"knn_datastore": "facts"} | xargs}
    if chat:
        result = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": question}], max_tokens=16, temperature=0, extra_body=extra
        )
        text = result.choices[0].message.content
    else:
        prompt = f"Question: {question}\nAnswer:"
        result = client.completions.create(model="smollm2", prompt=prompt, max_tokens=16, temperature=0, extra_body=extra)
        text = result.choices[0].text
    return text, (result.model_extra or {}).get("knn_context")


def sources(context) -> list[str]:
    return [p["source"] for p in context["passages"]]


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_a_question_only_a_stored_document_answers_is_answered_with_knn_context_naming_the_passage(default_server, chat):
    # kNN off: kNN in the logits can recall stored text itself (a store this small serves the config's λ)
    without, none = ask(default_server, "Who built the Quellin bridge?", chat, knn=False)
    answer, context = ask(default_server, "Who built the Quellin bridge?", chat, knn=False, knn_context=2)
    assert "Marta" in answer and "Marta" not in without and none is None, (answer, without)
    assert context["datastore"] == "facts" and sources(context)[0] == "quellin.txt"
    assert context["passages"][0]["span"][0] == 0 and context["passages"][0]["document"] >= 0


def test_a_streamed_answer_names_its_passages_in_the_first_event(default_server):
    stream = default_server.openai_client().completions.create(
        model="smollm2",
        prompt="Question: Who built the Quellin bridge?\nAnswer:",
        max_tokens=16,
        temperature=0,
        stream=True,
        extra_body={"vllm_xargs": {"knn_datastore": "facts", "knn": False, "knn_context": 2}},
    )
    events = list(stream)
    assert sources(events[0].model_extra["knn_context"])[0] == "quellin.txt"
    assert all("knn_context" not in (e.model_extra or {}) for e in events[1:]) and "Marta" in "".join(
        e.choices[0].text for e in events if e.choices
    )


def test_an_added_document_is_retrieved_and_a_forgotten_one_never_again(default_server, root):
    def admin(method, route, **body):
        return requests.request(
            method, f"{default_server.base_url}/v1/knn{route}", json=body or None, headers={"X-Admin-Token": TOKEN}, timeout=120
        )

    question = "Who founded the Velmor library?"
    assert all(p["id"] != "velmor" for p in ask(default_server, question, False, knn=False, knn_context=1)[1]["passages"])
    added = admin(
        "POST",
        "/datastores/facts/documents",
        texts=[{"text": "The Velmor library was founded by the poet Anselm Drey in 1911.", "id": "velmor"}],
    )
    assert added.status_code == 202, added.text
    until(lambda: admin("GET", f"/jobs/{added.json()['id']}").json()["state"] != "running", 300, "the add never finished")
    job = admin("GET", f"/jobs/{added.json()['id']}").json()
    assert job["state"] == "done", job["error"]
    answer, context = ask(default_server, question, False, knn=False, knn_context=1)
    assert context["passages"][0]["id"] == "velmor" and "Anselm" in answer, answer
    # named as the server's copy below the datastore root; the names the build gave do not change
    assert context["passages"][0]["source"].startswith(".knnlm-added/facts/"), context
    assert sources(ask(default_server, "Who built the Quellin bridge?", False, knn=False, knn_context=2)[1])[0] == "quellin.txt"

    forgot = admin("DELETE", f"/datastores/facts/documents/{job['record']['first_document']}")

    assert forgot.status_code == 200, forgot.text
    _, context = ask(default_server, question, False, knn_context=8)
    assert all(p["id"] != "velmor" for p in context["passages"])


def test_context_that_does_not_fit_the_model_is_left_out_by_the_documented_rule(default_server):
    client = default_server.openai_client()
    question = "Question: Who built the Quellin bridge?\nAnswer:"
    prompt_tokens = client.completions.create(model="smollm2", prompt=question, max_tokens=1).usage.prompt_tokens
    room = 2048 - prompt_tokens - 6  # leaves the context 6 tokens: less than the header and any passage
    result = client.completions.create(
        model="smollm2",
        prompt=question,
        max_tokens=room,
        temperature=0,
        extra_body={"vllm_xargs": {"knn_datastore": "facts", "knn_context": 3}},
    )
    context = result.model_extra["knn_context"]
    assert context["passages"] == [] and context["truncated"] >= 1


@pytest.mark.parametrize("value", [-1, 9, "2", True, None])
def test_a_bad_knn_context_is_a_400_naming_it(default_server, value):
    response = requests.post(
        f"{default_server.base_url}/v1/completions",
        json={"model": "smollm2", "prompt": "Who built the Quellin bridge?", "max_tokens": 4, "vllm_xargs": {"knn_context": value}},
        timeout=60,
    )
    assert response.status_code == 400 and "knn_context" in response.text, response.text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_request_vllm_refuses_after_retrieval_names_no_passage(default_server, stream):
    """The passages were retrieved, but vLLM refused the request (too many tokens): none was used."""
    response = requests.post(
        f"{default_server.base_url}/v1/completions",
        json={
            "model": "smollm2",
            "prompt": "Who built the Quellin bridge?",
            "max_tokens": 100_000,
            "stream": stream,
            "vllm_xargs": {"knn_datastore": "facts", "knn_context": 1},
        },
        timeout=60,
    )
    assert response.status_code == 400 and "max_tokens" in response.text, response.text
    assert "knn_context" not in response.text, response.text


QUESTION = {"role": "user", "content": "Who built the Quellin bridge?"}


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("completions", {"prompt": "Who built the Quellin bridge?", "max_tokens": "four"}, "max_tokens"),
        ("completions", {"prompt": [504, 2, -5], "max_tokens": 4}, "prompt"),
        ("completions", {"prompt": ["Who built it?", "And when?"], "max_tokens": 4}, "prompt"),
        ("chat/completions", {"messages": ["Be brief.", QUESTION], "max_tokens": 4}, "messages[0]"),
        ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages[0].content"),
        ("chat/completions", {"messages": [QUESTION], "max_completion_tokens": [4]}, "max_completion_tokens"),
    ],
)
def test_a_body_the_passages_cannot_read_is_a_400_naming_its_field(default_server, route, body, param):
    response = requests.post(
        f"{default_server.base_url}/v1/{route}",
        json={"model": "smollm2", **body, "vllm_xargs": {"knn_datastore": "facts", "knn_context": 1}},
        timeout=60,
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    assert "Marta" in ask(default_server, "Who built the Quellin bridge?", True, knn=False, knn_context=1)[0]


def test_a_damaged_passage_file_serves_the_request_without_passages_and_counts_it(default_server, root):
    shutil.copytree(root / "facts", root / "facts-damaged")
    loaded = requests.post(
        f"{default_server.base_url}/v1/knn/datastores",
        json={"name": "damaged", "path": "facts-damaged"},
        headers={"X-Admin-Token": TOKEN},
        timeout=120,
    )
    assert loaded.status_code == 200, loaded.text
    file = root / "facts-damaged/passages.sqlite"
    file.write_bytes(b"\0" * file.stat().st_size)  # damaged after the load's checks, its size kept

    answer, context = ask(default_server, "Who built the Quellin bridge?", False, knn=False, knn_context=2, knn_datastore="damaged")

    assert answer and context["passages"] == [] and "retrieval failed" in context["error"]
    metrics = requests.get(f"{default_server.base_url}/metrics", timeout=30).text
    assert 'knnlm_context_failures_total{datastore="damaged"} 1.0' in metrics
