"""`file_search` in the Responses API: the request's vector stores answer with passages and kNN.

Admission (server/admission.py) hands a Responses request with a `file_search` tool here before
vLLM sees it. Its question (a string `input`, or the last user message) searches every store the
tool names; their passages, ranked together by phrase relevance and each above its store's gate,
go into the request's `instructions` while they fit the model's length; the tool is removed (vLLM
has none of that name), and kNN mixes from the store of the best passage (`knn_datastore`,
unless the request names one). The response gets a `file_search_call` output item (its `results`
when `include` asks for `file_search_call.results`) and a `file_citation` annotation per file
used on each output text; a stream gets them as OpenAI streams them (`SearchEvents`).
"""

from __future__ import annotations

import json
import logging
import secrets
from dataclasses import dataclass

from knnlm_core.errors import ErrorKind, KnnlmError
from knnlm_serve import metrics
from knnlm_serve.server import context as ctx
from knnlm_serve.server.grants import tenant_of
from knnlm_serve.server.vector_store_search import search_store

logger = logging.getLogger("knnlm_serve")

TOOL = "file_search"
INCLUDE_RESULTS = "file_search_call.results"
MAX_RESULTS = 50


@dataclass(frozen=True)
class FileSearch:
    call: dict  # the response's file_search_call output item
    cited: list[dict]  # one file_citation annotation per file whose passage went into the prompt


def admitted(state, scope, request: dict) -> tuple[dict, FileSearch | None]:
    """The request with the stores' passages in its instructions and the tool removed (unchanged,
    and None, where it has no file_search tool)."""
    tools = request.get("tools")
    found = [(i, t) for i, t in enumerate(tools) if isinstance(t, dict) and t.get("type") == TOOL] if isinstance(tools, list) else []
    if not found:
        return request, None
    stores = getattr(state, "knnlm_vector_stores", None)
    if stores is None:
        raise KnnlmError("file_search needs vector stores: this server keeps none (set knn.datastore_root)", ErrorKind.MALFORMED, "tools")
    (i, tool), *more = found
    if more:
        raise KnnlmError(
            "give one file_search tool, naming every vector store in its vector_store_ids", ErrorKind.MALFORMED, f"tools[{more[0][0]}]"
        )
    ids, count = tool.get("vector_store_ids"), tool.get("max_num_results", 10)
    if not isinstance(ids, list) or not ids or not all(isinstance(v, str) for v in ids):
        raise KnnlmError(
            "vector_store_ids must be a non-empty list of vector store ids", ErrorKind.MALFORMED, f"tools[{i}].vector_store_ids"
        )
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_RESULTS:
        raise KnnlmError(f"max_num_results must be an integer from 1 to {MAX_RESULTS}", ErrorKind.MALFORMED, f"tools[{i}].max_num_results")
    key = tenant_of(scope)
    chosen = [stores.get(key.id if key is not None else None, v) for v in ids]
    query = question(request)
    ranked = sorted((found for store in chosen for found in _searched(stores, store, query, count)), key=lambda found: -found[0]["score"])[
        :count
    ]
    tokenizer = ctx.tokenizer_of(str(stores.registry.model.path))
    used = fitting(ranked, request, query, tokenizer, state.vllm_config.model_config.max_model_len)
    request = {**request, "tools": [t for t in tools if t is not tool]}
    if not request["tools"] or request.get("tool_choice") not in (None, "auto", "none"):
        request.pop("tool_choice", None)
    if used:
        text = ctx.HEADER + "".join(r["content"][0]["text"].strip() + "\n\n" for r, _ in used)
        request["instructions"] = (request["instructions"] + "\n\n" if request.get("instructions") else "") + text.rstrip()
        xargs = dict(request.get("vllm_xargs") or {})
        xargs.setdefault("knn_datastore", used[0][1])
        request["vllm_xargs"] = xargs
    results = [{**{k: r[k] for k in ("file_id", "filename", "score", "attributes")}, "text": r["content"][0]["text"]} for r, _ in used]
    include = INCLUDE_RESULTS in (request.get("include") or [])
    call = {"id": f"fs_{secrets.token_hex(12)}", "type": "file_search_call", "status": "completed", "queries": [query]}
    call["results"] = results if include else None
    files = {r["file_id"]: r["filename"] for r in results}
    return request, FileSearch(call, [{"type": "file_citation", "file_id": f, "filename": n} for f, n in files.items()])


def _searched(stores, store, query: str, count: int) -> list[tuple[dict, str]]:
    """The store's results above its gate, with its id; none where its search fails (fail open:
    the request is answered without its passages, logged and counted)."""
    try:
        return [(r, store.id) for r in search_store(stores, store, query, count, gated=True)]
    except Exception as e:  # noqa: BLE001 - a damaged passage file must not fail the request
        logger.warning("file_search in vector store %s failed, answered without its passages: %s", store.id, e)
        metrics.CONTEXT_FAILURES.labels(metrics.datastore_label(store.id)).inc()
        return []


def question(request: dict) -> str:
    """The request's question: a string `input`, or its last user message's text."""
    items = request.get("input")
    if isinstance(items, str):
        return items
    for item in reversed(items if isinstance(items, list) else []):
        if isinstance(item, dict) and item.get("role") == "user":
            content = item.get("content")
            if isinstance(content, str):
                return content
            if isinstance(content, list):
                return " ".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    raise KnnlmError("file_search needs a question: a string input, or a user message in input", ErrorKind.MALFORMED, "input")


def fitting(ranked: list, request: dict, query: str, tokenizer, max_model_len: int) -> list:
    """The ranked results whose passages fit beside the prompt and the answer, whole, best first."""
    tokens = lambda text: len(tokenizer(text, add_special_tokens=False).input_ids)  # noqa: E731
    answer = request.get("max_output_tokens") or ctx.CHAT_RESERVE
    budget = max_model_len - tokens((request.get("instructions") or "") + query) - answer - ctx.TEMPLATE_RESERVE - tokens(ctx.HEADER)
    used = []
    for result, store in ranked:
        size = tokens(result["content"][0]["text"].strip() + "\n\n")
        if size <= budget:
            used.append((result, store))
            budget -= size
    return used


def answered(response: dict, search: FileSearch) -> dict:
    """The response with the file_search_call item first and the citations on its output texts."""
    return {**response, "output": [search.call, *(cited(item, search) for item in response.get("output") or [])]}


def cited(item, search: FileSearch):
    """A message item with the citations on each of its output texts (any other item as it is)."""
    if not isinstance(item, dict) or item.get("type") != "message":
        return item
    return {**item, "content": [_cited_text(part, search) for part in item.get("content") or []]}


def _cited_text(part, search: FileSearch):
    if not isinstance(part, dict) or part.get("type") != "output_text":
        return part
    index = len(part.get("text") or "")
    return {**part, "annotations": [*(part.get("annotations") or []), *({**c, "index": index} for c in search.cited)]}


def answering(send, search: FileSearch, stream: bool):
    """`send` with the response's JSON (or its stream's events, `SearchEvents`) answered; an
    error response is passed on as it is."""
    state = {"refused": False, "start": None, "body": b"", "events": b""}
    events = SearchEvents(search)

    async def sending(message):
        if message["type"] == "http.response.start":
            state["refused"] = message.get("status", 200) >= 400
            if stream or state["refused"]:
                return await send(message)
            state["start"] = message
            return None
        if message["type"] != "http.response.body" or state["refused"]:
            return await send(message)
        if stream:
            state["events"] += message.get("body", b"")
            *whole, state["events"] = state["events"].split(b"\n\n")
            body = b"".join(events.passed(e) for e in whole)
            if not message.get("more_body", False):
                body += state["events"]
            return await send({**message, "body": body})
        state["body"] += message.get("body", b"")
        if message.get("more_body", False):
            return None
        try:
            body = json.dumps(answered(json.loads(state["body"]), search)).encode()
        except ValueError:
            body = state["body"]
        headers = [(k, v) for k, v in state["start"]["headers"] if k.lower() != b"content-length"]
        await send({**state["start"], "headers": [*headers, (b"content-length", str(len(body)).encode())]})
        return await send({"type": "http.response.body", "body": body, "more_body": False})

    return sending


class SearchEvents:
    """A Responses stream's events as OpenAI streams a file_search: the file_search_call item's
    events at output index 0 after `response.in_progress` (the search is done by then), every
    later item one index on, a `file_citation` per file on each message's output text (an
    `annotation.added` event each before its `output_text.done`, and in the `done` events), and
    the events numbered again."""

    def __init__(self, search: FileSearch):
        self.search, self.called, self.sequence = search, False, 0

    def passed(self, event: bytes) -> bytes:
        """`rewritten`, or the event as vLLM sent it where that fails (fail open: the stream goes on,
        logged)."""
        try:
            return self.rewritten(event)
        except Exception:  # noqa: BLE001 - the answer matters more than its file_search events
            logger.warning("file_search: a stream event passed on unrewritten", exc_info=True)
            return event + b"\n\n"

    def rewritten(self, event: bytes) -> bytes:
        """One server-sent event (without its blank line) as the events it becomes, each ended."""
        data = next((json.loads(line[len(b"data: ") :]) for line in event.split(b"\n") if line.startswith(b"data: {")), None)
        if not isinstance(data, dict):
            return event + b"\n\n"
        kind, out = data.get("type"), []
        if not self.called and (kind == "response.in_progress" or "output_index" in data):
            self.called = True
            if kind == "response.in_progress":
                return b"".join(self._sse(d) for d in [data, *self._call_events()])
            out = self._call_events()
        if "output_index" in data:
            data["output_index"] += 1
        if kind == "response.output_text.done":
            index = len(data.get("text") or "")
            out += [
                {
                    **self._at(data),
                    "type": "response.output_text.annotation.added",
                    "annotation_index": n,
                    "annotation": {**c, "index": index},
                }
                for n, c in enumerate(self.search.cited)
            ]
        elif kind == "response.content_part.done":
            data["part"] = _cited_text(data.get("part"), self.search)
        elif kind == "response.output_item.done":
            data["item"] = cited(data.get("item"), self.search)
        elif kind == "response.completed" and isinstance(data.get("response"), dict):
            data["response"] = answered(data["response"], self.search)
        return b"".join(self._sse(d) for d in [*out, data])

    def _call_events(self) -> list[dict]:
        call = self.search.call
        at = {"output_index": 0, "item_id": call["id"]}
        return [
            {"type": "response.output_item.added", "output_index": 0, "item": {**call, "status": "in_progress", "results": None}},
            *({"type": f"response.file_search_call.{phase}", **at} for phase in ("in_progress", "searching", "completed")),
            {"type": "response.output_item.done", "output_index": 0, "item": call},
        ]

    @staticmethod
    def _at(data: dict) -> dict:
        return {k: data[k] for k in ("item_id", "output_index", "content_index") if k in data}

    def _sse(self, data: dict) -> bytes:
        data = {**data, "sequence_number": self.sequence}
        self.sequence += 1
        return f"event: {data['type']}\ndata: {json.dumps(data)}\n\n".encode()
