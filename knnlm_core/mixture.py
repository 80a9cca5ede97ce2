"""The kNN-LM distribution: p = λ·p_kNN + (1−λ)·p_LM, in torch for serving and NumPy for evaluation.

The server mixes into the step's logits in place (`interpolate`, fp32); the evaluator scores
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
    rows: torch.Tensor,
    log_z: torch.Tensor,
    distances: torch.Tensor,
    tokens: torch.Tensor,
    lambda_: torch.Tensor,
    temperature: torch.Tensor,
) -> torch.Tensor:
    """Mix p_kNN into `logits[rows]` (fp32 [N, vocab]; written in place and returned): afterwards
    each of those rows' log-softmax is log(λ·p_kNN + (1−λ)·p_LM), where p_LM is the softmax of
    the row as given and `log_z` [n] its logsumexp.

    Only the k neighbour entries of a row are written. Its other entries keep their logits, which
    differ from log((1−λ)·p_LM) by log_z − log(1−λ) across the whole row, so the neighbour entries
    get the mixture plus that constant (1−λ at least LM_FLOOR: the softmax normalises what the
    floor adds). A row with no neighbour is left as it was."""
    valid = tokens >= 0
    scores = torch.where(valid, -distances.float() / temperature.float()[:, None], -torch.inf)
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # all-padding rows: zeros, not NaN
    lam = torch.where(valid.any(dim=1), lambda_.float(), 0.0)[:, None]
    # Padding slots point at the row's first neighbour token: every write to a token carries the same value.
    at = (rows[:, None].expand_as(tokens), torch.where(valid, tokens, tokens[:, :1].clamp(min=0)).long())
    log_p_lm = logits[at] - log_z[:, None]
    # p_kNN of each neighbour's token, duplicates summed, in the row's own neighbour entries.
    logits.index_put_(at, torch.zeros_like(weights))
    p_knn = logits.index_put_(at, weights, accumulate=True)[at]
    log_rest = torch.log1p(-lam.double()).clamp(min=math.log(LM_FLOOR)).float()  # log(1−λ), fp64: 1 − 1e-10 is 1 in fp32
    mixed = torch.logaddexp(lam.log() + p_knn.log(), log_rest + log_p_lm)
    return logits.index_put_(at, mixed + log_z[:, None] - log_rest)


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
