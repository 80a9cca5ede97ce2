"""The evidence behind each row of a request that asked to be explained (POST /v1/knn/explain).

Recorded in the worker, in the same pass that serves the row and only for such requests: what
happened (searched, followed pointers, skipped, fell back), the datastore version, λ and τ, every
neighbour (entry id, value, distance), and p_LM at the tokens the explanation can ask about (the
neighbours' values, the LM's top tokens, and a scored prompt row's target). The API server takes
a finished request's rows through the worker RPC and turns entry ids into documents and snippets
(server/explain.py). Other requests pay one attribute check per row.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from knnlm_serve.engine.batch_requests import BatchRequest
from knnlm_serve.runtime import DatastoreInfo

LM_TOP = 10  # the LM's top tokens recorded per row: a greedy pick is always among them or the neighbours'
MAX_REQUESTS = 64  # explained requests kept until taken: a client that never takes its rows leaks nothing


class ExplanationLog:
    def __init__(self) -> None:
        self._requests: OrderedDict[str, dict[int, dict]] = OrderedDict()

    def record(self, explain_id: str, position: int, row: dict) -> None:
        rows = self._requests.setdefault(explain_id, {})
        rows[position] = row  # a recomputed position (preemption) replaces the earlier record
        if len(self._requests) > MAX_REQUESTS:
            self._requests.popitem(last=False)

    def take(self, explain_id: str) -> list[dict]:
        """The request's rows by position, once: the log forgets them."""
        rows = self._requests.pop(explain_id, {})
        return [rows[p] for p in sorted(rows)]


def row_evidence(
    position: int,
    status: str,
    info: DatastoreInfo,
    lm_log_probs: torch.Tensor,
    target: int | None,
    neighbours: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
    lambda_: float = 0.0,
    temperature: float = 1.0,
) -> dict:
    """One row's record (JSON-able). `neighbours`: (distances, tokens, ids) of this row, padded
    with -1 tokens; `lm_log_probs`: the row's log p_LM over the vocabulary, before the mix."""
    asked = [lm_log_probs.topk(LM_TOP).indices.cpu().numpy()]
    record = {"position": position, "status": status, "datastore": [info.name, info.version, info.path]}
    if target is not None:
        asked.append(np.array([target]))
    if neighbours is not None:
        distances, tokens, ids = neighbours
        valid = tokens >= 0
        asked.append(tokens[valid])
        record.update(
            {
                "lambda": float(lambda_),
                "temperature": float(temperature),
                "ids": ids[valid].tolist(),
                "tokens": tokens[valid].tolist(),
                "distances": distances[valid].astype(float).tolist(),
            }
        )
    tokens = np.unique(np.concatenate(asked)).astype(np.int64)
    record["lm"] = dict(zip(tokens.tolist(), lm_log_probs[torch.from_numpy(tokens).to(lm_log_probs.device)].double().tolist()))
    return record


class Evidence:
    """The explained rows of one call: their p_LM (taken before any row is mixed) and what happened to them."""

    def __init__(self, positions: np.ndarray, sampling: bool, logits: torch.Tensor, rows: list[int]):
        self.positions, self.sampling = positions, sampling
        self.lm = dict(zip(rows, torch.log_softmax(logits[torch.as_tensor(rows, device=logits.device)], dim=-1)))
        self.outcome: dict[int, tuple] = {}

    def skipped(self, group: list[int], info: DatastoreInfo) -> None:
        """Every explained row of the group, until `found` says otherwise: the skip rule served it p_LM."""
        self.outcome.update({r: ("skipped", info, None) for r in group if r in self.lm})

    def found(self, group: list[int], info: DatastoreInfo, found) -> None:
        for i, r in enumerate(group):
            if r in self.lm:
                self.outcome[r] = (
                    ("fallback", info, None) if found is None else ("pointers" if found.followed[i] else "searched", info, (found, i))
                )

    def record(self, log: ExplanationLog, requests: list[BatchRequest]) -> None:
        for r, (status, info, neighbours) in self.outcome.items():
            request, position = requests[r], int(self.positions[r])
            prompt = request.prompt_tokens or []
            if self.sampling and position < len(prompt) - 1:
                continue  # a chunk of a long prompt: its sample is discarded
            target = prompt[position + 1] if not self.sampling and position + 1 < len(prompt) else None
            row = (None,) if neighbours is None else self._row(*neighbours)
            log.record(request.params.explain_id, position, row_evidence(position, status, info, self.lm[r], target, *row))

    @staticmethod
    def _row(found, i: int) -> tuple:
        return (found.distances[i], found.tokens[i], found.ids[i]), found.lambdas[i], found.temperatures[i]
