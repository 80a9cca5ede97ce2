"""In-context passages: the `knn_context` knob, applied at admission in the API server.

    vllm_xargs.knn_context   0..MAX_CONTEXT_PASSAGES   passages of the request's datastore to put
                                                       in front of the prompt (0: none)

Before vLLM sees a completion or chat request, its own text (the prompt; in a chat, the last user
message) queries the datastore's passage index (knnlm_core/passages.py), which ranks passages by
how much of the question they hold word for word, whatever text the question sits in. Passages at
or below the datastore's relevance gate (fitted at build time on questions made from held-out
documents) are left out, so a request about something the store does not hold gets no context. The rest go, best first, into the
prompt: a completion's prompt gets them in front of it (a prompt of token ids, their token ids,
which the response lists so that a client can score the same prompt again); a chat gets them as
a system message at the start (after an existing system message's text). They must fit: prompt, context and the
completion (`max_tokens`, or `CHAT_RESERVE` where a chat sets none) within `max_model_len`, less
`TEMPLATE_RESERVE` tokens for a chat template; passages are taken whole while they fit, the
rest left out. The response names the passages used in a `knn_context` field (OpenAI clients
ignore it). The knob is removed before vLLM parses the request. A retrieval that fails (a
damaged passage file) serves the request without passages, says so in that field and counts it
(`knnlm_context_failures_total`): it never fails the request.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from knnlm_core.errors import ErrorKind, KnnlmError
from knnlm_core.passages import Passage, PassageIndex
from knnlm_serve.engine.request_params import KnnParamError
from knnlm_serve.runtime import DatastoreInfo

logger = logging.getLogger("knnlm_serve")

KNOB = "knn_context"
MAX_CONTEXT_PASSAGES = 8
CHAT_RESERVE = 256  # completion tokens kept free where a chat sets no max_tokens
TEMPLATE_RESERVE = 64  # a chat template's own tokens
HEADER = "Relevant passages:\n\n"


@dataclass(frozen=True)
class Context:
    datastore: str
    passages: list[Passage]
    gated: int  # passages retrieved but at or below the relevance gate
    truncated: int  # passages that passed the gate but did not fit
    error: str | None = None  # why none were retrieved (the request was served without them)

    def text(self) -> str:
        return HEADER + "".join(p.text.strip() + "\n\n" for p in self.passages) if self.passages else ""

    def described(self, origin) -> dict:
        """What the response says: each passage's document, source, id, token span and relevance
        (`origin(document)`: where the document came from, as clients may see it)."""
        used = []
        for p in self.passages:
            where = origin(p.document)
            used.append(
                {"passage": p.id, "document": p.document, "source": where["source"], "id": where["id"], "span": [p.start, p.stop]}
                | {"relevance": round(p.relevance, 4), "text": p.text.strip()}
            )
        described = {"datastore": self.datastore, "passages": used, "gated": self.gated, "truncated": self.truncated}
        return described | ({"error": self.error} if self.error else {})


def context_count(xargs: dict) -> int:
    """The knob's value, checked (0 where the request does not set it)."""
    value = xargs.get(KNOB, 0)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_CONTEXT_PASSAGES:
        raise KnnParamError(KNOB, value, f"an integer in [0, {MAX_CONTEXT_PASSAGES}] (passages put in front of the prompt)")
    return value


def retrieve(info: DatastoreInfo, query: str, count: int, budget: int, count_tokens) -> Context:
    """Up to `count` passages of the datastore for `query` that pass its gate and fit `budget` tokens."""
    entry = info.passages
    found = passage_index(str(Path(info.path) / entry.file.path), entry.file.sha256).search(query, count, entry.relevance)
    gate = entry.gate
    relevant = [p for p in found if gate is None or p.relevance > gate]
    chosen, used = [], count_tokens(HEADER)
    for passage in relevant:
        size = count_tokens(passage.text.strip() + "\n\n")
        if used + size <= budget:
            chosen.append(passage)
            used += size
    return Context(info.name, chosen, len(found) - len(relevant), len(relevant) - len(chosen))


@cache
def tokenizer_of(model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@cache
def passage_index(path: str, sha256: str) -> PassageIndex:
    """One open index per version's file (its checksum tells versions apart)."""
    return PassageIndex(Path(path))


class BodyFieldError(KnnlmError):
    """A field of the request body that the passages need and cannot read: a 400 naming it."""

    kind = ErrorKind.MALFORMED

    def __init__(self, param: str, allowed: str):
        super().__init__(f"{param} must be {allowed} (with vllm_xargs.{KNOB})", param=param)


def query_text(body: dict, chat: bool, tokenizer) -> str:
    """The request's own text: a completion's prompt (text, or token ids decoded), or a chat's last user message."""
    if not chat:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            try:
                return tokenizer.decode(prompt)
            except (OverflowError, TypeError, ValueError) as e:
                raise BodyFieldError("prompt", f"token ids of the model's vocabulary ({e})") from e
        if not isinstance(prompt, str):
            raise BodyFieldError("prompt", "one prompt, as text or as token ids (not a list of prompts)")
        return prompt
    for i, message in reversed(list(enumerate(chat_messages(body)))):
        if message.get("role") == "user":
            return message_text(message, f"messages[{i}].content")
    raise BodyFieldError("messages", "a list with a user message to retrieve passages for")


def chat_messages(body: dict) -> list[dict]:
    """A chat's messages, checked to be a list of objects."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise BodyFieldError("messages", "a list of message objects")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BodyFieldError(f"messages[{i}]", "a message object")
    return messages


def message_text(message: dict, param: str) -> str:
    """A message's text: its content, or the text of its content parts."""
    content = message.get("content")
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(part, dict) and isinstance(part.get("text", ""), str) for part in content):
        return " ".join(part.get("text", "") for part in content)
    raise BodyFieldError(param, "text, or a list of content parts whose text is a string")


def prompt_text(body: dict, chat: bool, query: str) -> str:
    """The text the prompt's tokens are counted from: a completion's query, or every message of a chat."""
    if not chat:
        return query
    return "\n".join(message_text(m, f"messages[{i}].content") for i, m in enumerate(chat_messages(body)))


def with_context(body: dict, chat: bool, context: Context, tokenizer) -> tuple[dict, list[int] | None]:
    """The request body with the context in its prompt; for a prompt of token ids, the ids put in front of it."""
    text = context.text()
    if not text:
        return body, None
    if not chat and isinstance(body["prompt"], list):
        ids = tokenizer(text, add_special_tokens=False).input_ids
        return {**body, "prompt": ids + body["prompt"]}, ids
    if not chat:
        return {**body, "prompt": text + body["prompt"]}, None
    messages = list(body["messages"])
    first = messages[0] if messages else {}
    if first.get("role") == "system" and isinstance(first.get("content"), str):
        messages[0] = {**first, "content": first["content"] + "\n\n" + text.rstrip()}
    elif first.get("role") == "system" and isinstance(first.get("content"), list):
        messages[0] = {**first, "content": [*first["content"], {"type": "text", "text": "\n\n" + text.rstrip()}]}
    else:
        messages.insert(0, {"role": "system", "content": text.rstrip()})
    return {**body, "messages": messages}, None


def token_budget(body: dict, chat: bool, prompt_tokens: int, max_model_len: int) -> int:
    """Tokens the context may take (see the module docstring)."""
    return max_model_len - prompt_tokens - completion_tokens(body, chat) - (TEMPLATE_RESERVE if chat else 0)


def completion_tokens(body: dict, chat: bool) -> int:
    """The completion's length as the request sets it (an integer, or its digits, as vLLM accepts them)."""
    for field in ("max_completion_tokens", "max_tokens"):
        value = body.get(field)
        if value is None:
            continue
        if isinstance(value, str) and value.strip().isdigit():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise BodyFieldError(field, "a positive integer")
        return value
    return CHAT_RESERVE if chat else 16
