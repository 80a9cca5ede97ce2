"""knnlm-eval tasks' items: the JSONL they come in, and the prompt/answer token boundary (SmolLM2's tokenizer)."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from knnlm_serve.eval.task_items import TaskItem, read_items, tokenize_item
from knnlm_serve.eval.text import EvalError


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return AutoTokenizer.from_pretrained(smollm2_dir)


def item(prompt: str, answer: str) -> TaskItem:
    return TaskItem(prompt, answer, "x", "item", 1)


def test_an_answer_after_a_space_splits_at_the_word(tokenizer):
    tokenized = tokenize_item(tokenizer, item("The capital of France is", " Paris"))
    assert tokenized is not None
    assert tokenizer.decode(tokenized.answer_ids) == " Paris"
    assert tokenized.prompt_ids + tokenized.answer_ids == tokenizer("The capital of France is Paris").input_ids


@pytest.mark.parametrize(
    "prompt, answer",
    [("The capital of France is ", "Paris"), ("json.dum", "ps"), ("x", "")],
    ids=["space-on-the-prompt-side", "mid-word", "empty-answer"],
)
def test_a_boundary_inside_a_token_is_skipped_not_scored(tokenizer, prompt, answer):
    assert tokenize_item(tokenizer, item(prompt, answer)) is None


def test_items_are_read_with_defaults_for_id_and_kind(tmp_path):
    path = tmp_path / "items.jsonl"
    path.write_text(
        json.dumps({"prompt": "a", "answer": " b"}) + "\n\n" + json.dumps({"prompt": "c", "answer": " d", "id": "q", "kind": "question"})
    )
    first, second = read_items(path)
    assert (first.id, first.kind, first.line) == ("1", "item", 1)
    assert (second.id, second.kind, second.line) == ("q", "question", 3)


@pytest.mark.parametrize(
    "lines, message",
    [
        (['{"prompt": "a", "answer": " b"}', "{oops"], "items.jsonl:2: not a JSON object"),
        (['{"prompt": "a"}'], "items.jsonl:1: field 'answer' must be a non-empty string"),
        (['{"prompt": "a", "answer": " b", "anwser": 1}'], "items.jsonl:1: unknown field 'anwser'"),
        (["", "  "], "holds no items"),
        (['{"prompt": "a", "answer": " b", "id": "1"}', '{"prompt": "c", "answer": " d", "id": "1"}'], "item ids repeat"),
    ],
    ids=["bad-json", "no-answer", "unknown-field", "empty", "repeated-id"],
)
def test_a_malformed_items_file_names_its_line(tmp_path, lines, message):
    path = tmp_path / "items.jsonl"
    path.write_text("\n".join(lines))
    with pytest.raises(EvalError, match=message):
        read_items(path)
