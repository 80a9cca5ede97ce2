"""In-context passages: the `knn_context` knob, applied at admission in the API server.

    vllm_xargs.knn_context   0..MAX_CONTEXT_PASSAGES   passages of the request's datastore to put
                                                       in front of the prompt (0: none)

Before vLLM sees a completion or chat request, its own text (the prompt; in a chat, the last user
message) queries the datastore's passage index (knnlm_core/passages.py). Passages at or below the
datastore's relevance gate (fitted at build time on held-out text) are left out, so a request
about something the store does not hold gets no context. The rest go, best first, into the
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

    def described(self, table) -> dict:
        """What the response says: each passage's document, source, id, token span and relevance."""
        used = []
        for p in self.passages:
            where = table.describe(p.document)
            used.append(
                {"passage": p.id, "document": p.document, "source": where["source"], "id": where["id"], "span": [p.start, p.stop]}
                | {"relevance": round(p.relevance, 4)}
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
    found = passage_index(str(Path(info.path) / info.passages.file.path), info.passages.file.sha256).search(query, count)
    gate = info.passages.gate
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


def query_text(body: dict, chat: bool, tokenizer) -> str:
    """The request's own text: a completion's prompt (text, or token ids decoded), or a chat's last user message."""
    if not chat:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return tokenizer.decode(prompt)
        if not isinstance(prompt, str):
            raise KnnlmError(f"vllm_xargs.{KNOB} needs one prompt, as text or as token ids (not a list of prompts)", ErrorKind.MALFORMED)
        return prompt
    for message in reversed(body.get("messages") or []):
        if isinstance(message, dict) and message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, list):
                content = " ".join(part.get("text", "") for part in content if isinstance(part, dict))
            return content if isinstance(content, str) else ""
    raise KnnlmError(f"vllm_xargs.{KNOB} needs a user message to retrieve passages for", ErrorKind.MALFORMED)


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
    if messages and isinstance(messages[0], dict) and messages[0].get("role") == "system" and isinstance(messages[0].get("content"), str):
        messages[0] = {**messages[0], "content": messages[0]["content"] + "\n\n" + text.rstrip()}
    else:
        messages.insert(0, {"role": "system", "content": text.rstrip()})
    return {**body, "messages": messages}, None


def token_budget(body: dict, chat: bool, prompt_tokens: int, max_model_len: int) -> int:
    """Tokens the context may take (see the module docstring)."""
    completion = body.get("max_completion_tokens") or body.get("max_tokens") or (CHAT_RESERVE if chat else 16)
    return max_model_len - prompt_tokens - int(completion) - (TEMPLATE_RESERVE if chat else 0)
