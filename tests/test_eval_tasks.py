"""knnlm-eval tasks against a running server: memorised answers come back with kNN at λ = 1 and not
without, held-out controls gain nothing, and every item is counted (tiny model, real server)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from local_server import folder_below_root, serving

from index_builder.build import build_datastore
from knnlm_core.config import BuildConfig
from knnlm_serve.eval.tasks import names

pytestmark = pytest.mark.slow

WORDS = "amber basil cedar delta ember fable garnet harbor indigo juniper kestrel lilac marble nectar onyx".split()


def fact(n: int) -> tuple[str, str]:
    """A made-up fact: a prompt naming record n, and six words no model could guess."""
    answer = " " + " ".join(WORDS[(n * 7 + i * 3) % len(WORDS)] for i in range(6)) + "."
    return f"Record {n} of the lighthouse keeper's log reads:", answer


@pytest.fixture(scope="module")
def setup(local_server, tiny_model_dir):
    work = folder_below_root(local_server, "tasks")
    stored, heldout = [fact(n) for n in range(6)], [fact(n) for n in range(6, 9)]
    (work / "corpus.jsonl").write_text("".join(json.dumps({"text": p + a}) + "\n" for p, a in stored))
    build_datastore(
        [work / "corpus.jsonl"], work / "facts", tiny_model_dir, BuildConfig(index="flat", context_length=64, stride=32), progress=False
    )
    items = [{"prompt": p, "answer": a, "id": f"s{n}", "kind": "stored"} for n, (p, a) in enumerate(stored)]
    items += [{"prompt": p, "answer": a, "id": f"h{n}", "kind": "heldout"} for n, (p, a) in enumerate(heldout)]
    items.append({"prompt": stored[0][0] + " ", "answer": stored[0][1].lstrip(), "id": "split", "kind": "stored"})  # boundary in a token
    (work / "items.jsonl").write_text("".join(json.dumps(i) + "\n" for i in items))
    with serving(local_server, {"facts": work / "facts"}, default="facts"):
        yield local_server, work


def item_answers(work) -> dict[str, str]:
    return {i["id"]: i["answer"] for i in map(json.loads, (work / "items.jsonl").read_text().splitlines())}


def knnlm_eval(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "knnlm_serve.eval.cli", *args], capture_output=True, text=True, timeout=600)


def test_memorised_answers_come_back_at_full_lambda_and_the_paired_counts_add_up(setup):
    server, work = setup
    result = knnlm_eval(
        "tasks", str(work / "items.jsonl"), "--base-url", server.base_url, "--set", "full:knn_lambda=1", "-o", str(work / "out")
    )
    assert result.returncode == 0, result.stderr
    report = json.loads((work / "out/tasks.json").read_text())
    summary = report["summary"]
    assert [s["id"] for s in report["skipped"]] == ["split"]  # skipped and counted, not scored wrong
    assert summary["full"]["stored"]["exact_match"] == 1.0 > summary["off"]["stored"]["exact_match"]
    answers = item_answers(work)
    assert all(i["full"]["greedy"] == answers[i["id"]] for i in report["items"] if i["kind"] == "stored")  # the report shows them
    assert summary["full"]["heldout"]["exact_match"] == summary["off"]["heldout"]["exact_match"] == 0.0
    for setting in ("served", "full"):
        for kind, s in summary[setting].items():
            v = s["vs_off"]
            assert v["wins"] + v["ties"] + v["losses"] == s["items"]
            assert v["exact_gained"] - v["exact_lost"] == round((s["exact_match"] - summary["off"][kind]["exact_match"]) * s["items"])
    assert summary["full"]["stored"]["vs_off"]["wins"] == 6  # every memorised answer more likely
    assert summary["full"]["all"]["items"] == 9
    assert (work / "out/tasks.png").stat().st_size > 0 and "| full | stored | 6 | 100.0% |" in (work / "out/tasks.md").read_text()


def test_chat_items_go_through_the_chat_route_with_their_passages(setup):
    server, work = setup
    args = ["--base-url", server.base_url, "--chat", "--set", "context:knn=false,knn_context=1", "-o", str(work / "chat")]
    result = knnlm_eval("tasks", str(work / "items.jsonl"), *args)
    assert result.returncode == 0, result.stderr
    report = json.loads((work / "chat/tasks.json").read_text())
    assert report["chat"] and report["summary"]["off"]["all"]["items"] + len(report["skipped"]) == 10
    stored = {i["id"]: i for i in report["items"] if i["kind"] == "stored" and i["id"] != "split"}
    assert len(stored) == 6
    for n in range(6):  # fact n is document n: its passage, retrieved for the user's message, is in the prompt
        item = stored[f"s{n}"]
        assert [p["document"] for p in item["context"]["passages"]] == [n] and item["off"]["passages"] == []
        assert abs(item["context"]["logprob"] - item["off"]["logprob"]) > 1e-3  # the passage changed the scored prompt
    # A chat model answers in prose: a reply matches where it names the answer, and may run past it.
    answers = item_answers(work)
    for item in report["items"]:
        answer = answers[item["id"]]
        for setting in ("off", "context"):
            reply = item[setting]["greedy"]
            assert item[setting]["exact"] == names(reply, answer), reply
    assert max(len(i["off"]["greedy"]) for i in report["items"]) > max(len(a) for a in answers.values())


@pytest.mark.parametrize(
    "args, message",
    [
        (["tasks", "{bad}"], "bad.jsonl:2: not a JSON object"),
        (["tasks", "{items}", "--base-url", "http://127.0.0.1:9"], "no OpenAI-compatible server answers at http://127.0.0.1:9"),
        (["tasks", "{items}", "--set", "strong"], "expected NAME:knob=value"),
    ],
    ids=["malformed-line", "no-server", "bad-setting"],
)
def test_bad_task_input_names_the_problem(setup, args, message):
    _, work = setup
    (work / "bad.jsonl").write_text('{"prompt": "a", "answer": " b"}\n{oops\n')
    result = knnlm_eval(*(a.format(bad=work / "bad.jsonl", items=work / "items.jsonl") for a in args))
    assert result.returncode != 0 and message in result.stderr, result.stderr


def test_a_chat_reply_matches_where_it_names_the_answer_as_a_whole_word():
    assert names("The function is json.dumps.", " dumps") and names("dumps", "dumps")
    assert not names("a dumpster", " dumps") and not names("undumps it", "dumps") and not names("anything", " ")
