"""Provenance API: which documents each generated or scored token drew on.

    POST /v1/knn/explain                         generate from a prompt (or score a given completion)
                                                 and explain every token
    GET  /v1/knn/documents/{datastore}/{doc}     a document of a serving datastore, whole

An explained request is an ordinary engine request with `vllm_xargs.knn_explain` set: the same
search, settings and version pinning as serving, with the worker recording the evidence of its
rows (engine/explanations.py). Once it has finished, its rows are taken through the worker RPC,
and entry ids become documents and snippets here, from the files of the version the request was
pinned to. Requests that do not ask pay nothing. The routes sit under /v1, behind vLLM's API key.

For a token t with the row's λ, neighbours j (distance d_j, value v_j) and temperature τ:
p_kNN(t) = Σ_{v_j = t} softmax(−d/τ)_j, p_LM(t) as the worker recorded it before the mix, and
p = λ·p_kNN + (1−λ)·p_LM, which is what the server served (`logprob`, from vLLM). The worker
records p_LM at the neighbours' values, the LM's top tokens and a scored token; a sampled token
outside those (only possible with temperature > 0) has p_kNN = 0, so p_LM = p/(1−λ) exactly.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from dataclasses import replace
from functools import lru_cache
from pathlib import Path

import numpy as np
from fastapi import APIRouter, HTTPException, Request
from pydantic import BaseModel, ConfigDict, Field

from knnlm_core.datastore import read_manifest
from knnlm_core.errors import ErrorKind, KnnlmError
from knnlm_core.manifest import MANIFEST
from knnlm_core.provenance import DocumentTable, Provenance
from knnlm_serve.engine.explanations import MAX_REQUESTS
from knnlm_serve.engine.request_params import (
    KNOWN_KEYS,
    MAX_EXPLAIN_TOP,
    WIRE_KEY,
    KnnParamError,
    parse_knobs,
    raw_type_error,
    with_defaults,
)
from knnlm_serve.engine.worker_extension import TAKE_EXPLANATION
from knnlm_serve.server.audit import record_of
from knnlm_serve.server.grants import granted, tenant_of, unknown_knob
from knnlm_serve.server.http_errors import KnnRoute, http_error

logger = logging.getLogger("knnlm_serve")

MAX_EXPLAINED_TOKENS = 256
RPC_TIMEOUT_S = 60.0


class ExplainRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None  # accepted for OpenAI-style clients; the server has one model
    prompt: str = Field(min_length=1)
    completion: str | None = Field(None, min_length=1)  # score this continuation instead of generating
    max_tokens: int = Field(16, ge=1, le=MAX_EXPLAINED_TOKENS)
    temperature: float = Field(0.0, ge=0)
    snippet_tokens: int = Field(16, ge=0, le=256)  # tokens of context shown before and after an entry
    vllm_xargs: dict = {}  # the kNN knobs of /v1/completions; knn_explain: neighbours shown per token (5)


router = APIRouter(prefix="/v1/knn", tags=["kNN provenance"], route_class=KnnRoute)


def provenance_of(path: str) -> Provenance:
    """A datastore version's provenance, by its directory, read again if it was rebuilt in place."""
    manifest = Path(path) / MANIFEST
    return _provenance(path, manifest.stat().st_mtime_ns if manifest.exists() else 0)


@lru_cache(maxsize=8)
def _provenance(path: str, manifest_mtime_ns: int) -> Provenance:
    return Provenance.open(Path(path), read_manifest(path))


def origin(table: DocumentTable, document: int, registry) -> dict:
    """Where `document` came from, as clients may see it (its source through `public_source`)."""
    where = table.describe(document)
    return where | {"source": registry.public_source(where["source"])}


def _registry(request: Request):
    registry = getattr(request.app.state, "knnlm_registry", None)
    if registry is None:
        raise HTTPException(503, "kNN is not configured on this server (no knn.datastores)")
    return registry


@router.get("/documents/{datastore}/{document}")
def get_document(datastore: str, document: int, request: Request) -> dict:
    registry = _registry(request)
    served = registry.runtime.datastores
    unknown = HTTPException(404, f"no datastore {datastore!r} is serving; GET /v1/knn/datastores lists them")
    if (key := tenant_of(request.scope)) is not None:
        try:
            granted(request.scope, key, datastore, "documents", served, unknown)
        except KnnlmError as e:
            raise http_error(e, registry) from None
    info = served.get(datastore)
    if info is None:
        raise unknown
    tokenizer = request.app.state.engine_client.get_tokenizer()
    try:
        provenance = provenance_of(info.path)
        tokens = provenance.tokens(document)
    except KnnlmError as e:
        raise http_error(e, registry) from None
    if (record := record_of(request.scope)) is not None:
        record.returned([provenance.table.describe(document)], "whole")
    return {
        "datastore": {"name": info.name, "version": info.version},
        **origin(provenance.table, document, _registry(request)),
        "tokens": len(tokens),
        "text": tokenizer.decode(tokens.tolist()),
    }


@router.post("/explain")
async def explain(body: ExplainRequest, request: Request) -> dict:
    """Refused with a 429 while as many explanations are running as the worker's evidence log
    holds (engine/explanations.py): an explanation is whole or not given."""
    registry = _registry(request)
    running = getattr(request.app.state, "knnlm_explaining", 0)
    if running >= MAX_REQUESTS:
        error = KnnlmError(f"{running} explanations are running, the most this server records at once; retry shortly", ErrorKind.BUSY)
        raise http_error(error, registry)
    request.app.state.knnlm_explaining = running + 1
    try:
        return await _explain(body, request, registry)
    except KnnlmError as e:
        raise http_error(e, registry) from None
    finally:
        request.app.state.knnlm_explaining -= 1


async def _explain(body: ExplainRequest, request: Request, registry) -> dict:
    from vllm import SamplingParams

    engine = request.app.state.engine_client
    if (error := raw_type_error(body.vllm_xargs)) is not None:  # as the completion routes check them (server/admission.py)
        raise error
    xargs = dict(body.vllm_xargs)
    top = xargs.pop("knn_explain", 5)
    if isinstance(top, bool) or not isinstance(top, int) or not 1 <= top <= MAX_EXPLAIN_TOP:
        raise KnnParamError("knn_explain", top, f"an integer in [1, {MAX_EXPLAIN_TOP}] (neighbours per token)")
    explain_id = uuid.uuid4().hex
    xargs["knn_explain"] = {"id": explain_id, "top": top}
    runtime = registry.runtime
    key = tenant_of(request.scope)
    checked = {k: v for k, v in xargs.items() if k != "knn_datastore"} if key is not None else xargs  # a key's names: below
    knobs = parse_knobs(checked, runtime.datastores, runtime.knn.max_k)
    if key is not None:
        requested = xargs.get("knn_datastore")
        unknown = unknown_knob(requested)
        knobs = replace(
            knobs,
            datastore=granted(request.scope, key, requested, "explain", runtime.datastores, unknown),
            admitted=runtime.admission_token,
        )
        if knobs.datastore is None:  # never the server's default, which may be another tenant's
            raise KnnParamError("knn_datastore", None, "a datastore this API key may use: the key has no default datastore")
    params = with_defaults(knobs, runtime)
    if not params.active:
        raise KnnlmError(
            "kNN is off for this request (vllm_xargs knn false or knn_lambda 0): there is nothing to explain", ErrorKind.MALFORMED
        )
    provenance_of(registry.runtime.datastores[params.datastore].path)

    tokenizer = engine.get_tokenizer()
    prompt = tokenizer(body.prompt).input_ids
    scored = tokenizer(body.completion, add_special_tokens=False).input_ids if body.completion else []
    if body.completion and not scored:
        raise KnnlmError("the completion to score has no tokens", ErrorKind.MALFORMED)
    if len(scored) > MAX_EXPLAINED_TOKENS:
        raise KnnlmError(
            f"the completion has {len(scored)} tokens; at most {MAX_EXPLAINED_TOKENS} are explained at once", ErrorKind.MALFORMED
        )
    sampling = SamplingParams(
        max_tokens=1 if scored else body.max_tokens,
        temperature=body.temperature,
        logprobs=0,
        prompt_logprobs=0 if scored else None,
        extra_args={**{k: v for k, v in xargs.items() if k not in KNOWN_KEYS}, WIRE_KEY: knobs.wire()},
    )
    final = None
    registry.note_request()
    try:
        async for output in engine.generate({"prompt_token_ids": prompt + scored}, sampling, f"knn-explain-{explain_id}"):
            final = output
    except ValueError as e:  # vLLM's validation (prompt too long, ...)
        raise KnnlmError(str(e), ErrorKind.MALFORMED) from None
    finally:
        answers = await asyncio.wait_for(engine.collective_rpc(TAKE_EXPLANATION, timeout=RPC_TIMEOUT_S, args=(explain_id,)), RPC_TIMEOUT_S)
    if "error" in answers[0]:
        raise KnnlmError(f"the worker could not return the explanation ({answers[0]['error']}); retry", ErrorKind.UNAVAILABLE)
    by_position = {row["position"]: row for row in json.loads(answers[0]["result"])}

    if scored:  # row p predicts token p + 1; the scored tokens follow the prompt
        first = len(prompt)
        tokens = prompt + scored
        served = [final.prompt_logprobs[first + i][t].logprob for i, t in enumerate(scored)]
        explained = [(first + i - 1, t, lp) for i, (t, lp) in enumerate(zip(scored, served))]
    else:
        completion = final.outputs[0]
        explained = [(len(prompt) - 1 + i, t, completion.logprobs[i][t].logprob) for i, t in enumerate(completion.token_ids)]
        tokens = prompt + list(completion.token_ids)
    missing = sum(position not in by_position for position, _, _ in explained)
    if missing:
        raise KnnlmError(
            f"the evidence of {missing} of {len(explained)} tokens was not recorded (the datastore was unloaded or swapped "
            "while the request waited); retry",
            ErrorKind.UNAVAILABLE,
        )
    pinned = next(iter(by_position.values()))["datastore"]
    explanation = [
        explain_token(by_position[position], token, logprob, top, body.snippet_tokens, tokenizer, registry)
        for position, token, logprob in explained
    ]
    if (record := record_of(request.scope)) is not None:
        record.returned([n for t in explanation for n in t["neighbours"] if "document" in n], "snippet")
    return {
        "datastore": {"name": pinned[0], "version": pinned[1]},
        "prompt_tokens": len(prompt),
        "text": tokenizer.decode(tokens[len(prompt) :]),
        "tokens": explanation,
    }


def explain_token(row: dict, token: int, logprob: float, top: int, width: int, tokenizer, registry) -> dict:
    """One token's mixture and its top neighbours by weight, each with its document and a snippet."""
    served = float(np.exp(logprob))
    out = {"token": tokenizer.decode([token]), "token_id": token, "logprob": logprob, "status": row["status"]}
    if "ids" not in row:  # skipped or fallback: the LM alone served it
        p_lm = float(np.exp(row["lm"][str(token)])) if str(token) in row["lm"] else served
        return {**out, "lambda": 0.0, "p_lm": p_lm, "p_knn": None, "p": p_lm, "neighbours": []}
    lam = row["lambda"]
    distances, values, ids = np.array(row["distances"]), np.array(row["tokens"]), np.array(row["ids"])
    scores = -distances / row["temperature"]
    weights = np.exp(scores - scores.max())
    weights /= weights.sum()
    p_knn = float(weights[values == token].sum())
    recorded = row["lm"].get(str(token))
    p_lm = float(np.exp(recorded)) if recorded is not None else (served / (1 - lam) if lam < 1 else None)  # λ 1: p_LM unused
    provenance = provenance_of(row["datastore"][2])
    order = np.argsort(-weights, kind="stable")[:top]
    documents, read_to = provenance.locate(ids[order])
    neighbours = []
    for j, document, position in zip(order.tolist(), documents.tolist(), (read_to + 1).tolist()):
        if document in provenance.forgotten:  # found by a request that began before the forget: nothing of it is shown
            neighbours.append({"entry": int(ids[j]), "forgotten": True, "distance": float(distances[j]), "weight": float(weights[j])})
            continue
        # `position`: the entry's value, the token that followed its context in the document
        before = provenance.tokens(document, position - width, position)
        after = provenance.tokens(document, position + 1, position + 1 + width)
        next_token = tokenizer.decode([int(values[j])])
        neighbours.append(
            {
                "entry": int(ids[j]),
                **origin(provenance.table, document, registry),
                "position": position,
                "distance": float(distances[j]),
                "weight": float(weights[j]),
                "next_token": next_token,
                "snippet": f"{tokenizer.decode(before.tolist())}[[{next_token}]]{tokenizer.decode(after.tolist())}",
            }
        )
    p = lam * p_knn + (1 - lam) * (p_lm or 0.0)
    return {**out, "lambda": lam, "p_lm": p_lm, "p_knn": p_knn, "p": p, "neighbours": neighbours}
