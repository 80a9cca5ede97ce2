"""The kNN-LM distribution: p = λ·p_kNN + (1−λ)·p_LM, for serving and for evaluation.

The server mixes into the step's logits in place (`interpolate`, fp32 logits); the evaluator scores
targets only (`knn_log_prob`, `mixture_log_prob`, fp64). Both use the same λ rule
(`adaptive_lambda`).

p_kNN(v) = Σ_{j: token_j = v} softmax_j(−d_j / τ) over the k retrieved neighbours. Padding
neighbours (distance +inf, token −1) get zero weight; a row with no neighbour keeps p_LM.

p_kNN is non-zero on at most k tokens, and off them the mixture is (1−λ)·p_LM (at least
LM_FLOOR·p_LM, then normalised: λ = 1 is p_kNN but for that floor): a row's logits
shifted by one constant, which a softmax does not see. So the mix writes only a row's k neighbour
entries: this runs in every decode step, where full-vocabulary passes and fresh [rows, vocabulary]
tensors were its cost. The LM's log normaliser is the caller's, from the log-softmax it computes
once per row for the skip rule.
"""

from __future__ import annotations

import math

import numba
import numpy as np
import torch

# The LM's least weight in the mix: at λ = 1 a token no neighbour predicts keeps LM_FLOOR·p_LM, not
# 0, so that a constraint vLLM applies after the mix (structured outputs, allowed_token_ids,
# bad_words, min_tokens) always leaves it a token to sample: where no neighbour's token is allowed,
# the LM's best allowed token.
LM_FLOOR = 1e-10


def adaptive_lambda(d_nearest: np.ndarray, lambda_max: float, slope: float, center: float) -> np.ndarray:
    """λ(d) = λ_max·sigmoid(slope·(center − d)): trust retrieval more when the nearest key is close
    (Drozdov et al. 2022). `knnlm-eval` fits the three numbers; `knn.adaptive_lambda` serves them."""
    return lambda_max / (1.0 + np.exp(-slope * (center - d_nearest)))


def interpolate(
    logits: torch.Tensor,
    rows: np.ndarray,
    log_z: np.ndarray,
    distances: np.ndarray,
    tokens: np.ndarray,
    lambda_: np.ndarray,
    temperature: np.ndarray,
) -> torch.Tensor:
    """Mix p_kNN into `logits[rows]` (fp32 [N, vocab] on any device; written in place and
    returned): afterwards each of those rows' log-softmax is log(λ·p_kNN + (1−λ)·p_LM), where p_LM
    is the softmax of the row as given and `log_z` [n] its logsumexp.

    Only the k neighbour entries of a row are written. Its other entries keep their logits, which
    differ from log((1−λ)·p_LM) by log_z − log(1−λ) across the whole row, so the neighbour entries
    get the mixture plus that constant (1−λ at least LM_FLOOR: the softmax normalises what the
    floor adds). A row with no neighbour is left as it was.

    The neighbours are host arrays (the shards' answers), so one compiled loop mixes the entries
    on the host: in the logits themselves when they are contiguous host memory, else on a copy of
    the entries read to the host and written back (three tensor operations). The formula as tensor
    operations took some forty a step, each paying its dispatch."""
    n, k = tokens.shape
    rows = np.asarray(rows, dtype=np.int64)
    f32 = [np.asarray(x, dtype=np.float32) for x in (log_z, distances, lambda_, temperature)]  # one compiled signature
    neighbours = (tokens.astype(np.int32, copy=False), f32[0], f32[1], f32[2], f32[3], math.log(LM_FLOOR))
    if logits.device.type == "cpu" and logits.is_contiguous():
        _mix_entries(logits.numpy(), rows, True, *neighbours)
        return logits
    # Padding slots read and write the row's first neighbour token: every write to a token carries the same value.
    columns = np.where(tokens >= 0, tokens, np.maximum(tokens[:, :1], 0)).astype(np.int64)
    at = (torch.from_numpy(rows).to(logits.device)[:, None].expand(n, k), torch.from_numpy(columns).to(logits.device))
    entries = logits[at].cpu().numpy()
    _mix_entries(entries, np.arange(n), False, *neighbours)
    return logits.index_put_(at, torch.from_numpy(entries).to(logits.device))


def compile_mix() -> None:
    """Compile (or load from numba's cache) the mix's loop now, not in a request's first kNN step."""
    lone = (np.zeros(1, np.int64), np.zeros(1), np.zeros((1, 1)), np.zeros((1, 1), np.int32), np.ones(1), np.ones(1))
    interpolate(torch.zeros(1, 2), *lone)  # in place
    interpolate(torch.zeros(1, 4)[:, :2], *lone)  # through a copy of the entries


@numba.njit(cache=True, nogil=True)
def _mix_entries(table, rows, by_token, tokens, log_z, distances, lambda_, temperature, log_floor):  # pragma: no cover - compiled
    """In place: the LM's logit at `tokens[i, j]` in row `rows[i]` of `table`, at column `tokens[i, j]`
    (`by_token`: the logits themselves) or at column j (the row's entries, read out slot by slot),
    becomes that token's mixture plus the row's constant (see `interpolate`), computed in fp64. A
    padding slot (token −1) stands for the row's first token: in the logits it is not written, among
    the read-out entries it gets that token's value."""
    n, k = tokens.shape
    weights = np.empty(k)
    for i in range(n):
        row = rows[i]
        top = -np.inf
        for j in range(k):
            if tokens[i, j] >= 0:
                top = max(top, -distances[i, j] / temperature[i])
        if top == -np.inf:
            continue  # no neighbour: the row keeps p_LM
        total = 0.0
        for j in range(k):
            weights[j] = np.exp(-distances[i, j] / temperature[i] - top) if tokens[i, j] >= 0 else 0.0
            total += weights[j]
        lam = float(lambda_[i])
        log_lam = np.log(lam) if lam > 0 else -np.inf
        log_rest = max(np.log1p(-lam), log_floor) if lam < 1 else log_floor
        z = float(log_z[i])
        order = np.argsort(tokens[i])  # each token's slots together, to sum its weights once
        start = 0
        while start < k:
            token, end, p_knn = tokens[i, order[start]], start, 0.0
            while end < k and tokens[i, order[end]] == token:
                p_knn += weights[order[end]]
                end += 1
            if token >= 0:
                a = log_lam + np.log(p_knn / total) if p_knn > 0 else -np.inf
                b = log_rest + float(table[row, token if by_token else order[start]]) - z
                high, low = max(a, b), min(a, b)
                mixed = high + np.log1p(np.exp(low - high)) if low > -np.inf else high
                for s in range(start, end):
                    table[row, token if by_token else order[s]] = mixed + z - log_rest
            start = end
        if not by_token:
            for j in range(k):
                if tokens[i, j] < 0:
                    table[row, j] = table[row, 0]


def knn_log_prob(distances: np.ndarray, match: np.ndarray, k: int, temperature: float) -> np.ndarray:
    """log p_kNN(target) [T] from the k nearest: log Σ_match softmax(−d/τ) (−inf if none match)."""
    scores = -distances[:, :k].astype(np.float64) / temperature  # padding (+inf) -> -inf
    top = np.max(scores, axis=1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    weights = np.exp(scores - top)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.log(np.sum(weights * match[:, :k], axis=1)) - np.log(np.sum(weights, axis=1))


def mixture_log_prob(log_p_lm: np.ndarray, log_p_knn: np.ndarray, lambda_, has_neighbour: np.ndarray) -> np.ndarray:
    """log(λ·p_kNN + (1−λ)·p_LM), λ scalar or per token, with the server's LM_FLOOR (normalised as
    its softmax does); rows without neighbours keep p_LM (as the server)."""
    lam = np.where(has_neighbour, lambda_, 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):  # log 0 = -inf
        log_rest = np.maximum(np.log1p(-lam), math.log(LM_FLOOR))
        return np.logaddexp(np.log(lam) + log_p_knn, log_rest + log_p_lm) - np.logaddexp(np.log(lam), log_rest)
