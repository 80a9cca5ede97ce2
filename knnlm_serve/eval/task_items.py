"""Task items for `knnlm-eval tasks`: a JSONL of {prompt, answer, id?, kind?}, and where the answer's
tokens begin.

With byte-level BPE the tokens of `prompt + answer` need not be the prompt's tokens followed by
the answer's: a space or a word can merge across the boundary. An item is scored only where the
whole text tokenizes as the prompt's own tokens and then tokens that decode to exactly the
answer; any other item is skipped and counted, never scored wrong.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from knnlm_serve.eval.text import EvalError


@dataclass(frozen=True)
class TaskItem:
    prompt: str
    answer: str
    id: str
    kind: str
    line: int  # 1-based line of the JSONL file


@dataclass(frozen=True)
class TokenizedItem:
    item: TaskItem
    prompt_ids: list[int]
    answer_ids: list[int]


def read_items(path: Path) -> list[TaskItem]:
    """Every item of the JSONL file; a malformed line is an error naming the file and the line."""
    items = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise EvalError(f"cannot read the task items {path}: {e}") from None
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError as e:
            raise EvalError(f"{path}:{number}: not a JSON object ({e.msg})") from None
        if not isinstance(record, dict):
            raise EvalError(f"{path}:{number}: not a JSON object")
        for field in ("prompt", "answer"):
            if not isinstance(record.get(field), str) or not record[field]:
                raise EvalError(f"{path}:{number}: field {field!r} must be a non-empty string")
        if unknown := sorted(set(record) - {"prompt", "answer", "id", "kind"}):
            raise EvalError(f"{path}:{number}: unknown field {unknown[0]!r} (an item has prompt, answer, id and kind)")
        items.append(TaskItem(record["prompt"], record["answer"], str(record.get("id", number)), str(record.get("kind", "item")), number))
    if not items:
        raise EvalError(f"{path} holds no items: write one JSON object per line with prompt and answer")
    if len({i.id for i in items}) != len(items):
        raise EvalError(f"{path}: item ids repeat; give each item its own id (or none)")
    return items


def tokenize_item(tokenizer, item: TaskItem) -> TokenizedItem | None:
    """The item's prompt tokens and the answer's tokens after them, or None where `prompt + answer`
    does not tokenize as the prompt's own tokens followed by tokens that decode to the answer."""
    prompt_ids = tokenizer(item.prompt).input_ids
    whole = tokenizer(item.prompt + item.answer).input_ids
    answer_ids = whole[len(prompt_ids) :]
    if whole[: len(prompt_ids)] != prompt_ids or not answer_ids or tokenizer.decode(answer_ids) != item.answer:
        return None
    return TokenizedItem(item, list(prompt_ids), list(answer_ids))
