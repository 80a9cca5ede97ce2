"""The kNN-LM distribution: p = λ·p_kNN + (1−λ)·p_LM, in torch for serving and NumPy for evaluation.

The server mixes whole rows of LM log-probabilities in place (`interpolate`, fp32); the
evaluator scores targets only (`knn_log_prob`, `mixture_log_prob`, fp64). Both use the same λ rule
(`adaptive_lambda`).

p_kNN(v) = Σ_{j: token_j = v} softmax_j(−d_j / τ) over the k retrieved neighbours. Padding
neighbours (distance +inf, token −1) get zero weight; a row with no neighbour keeps p_LM.

p_kNN is non-zero on at most k tokens, so the mix adds log(1−λ) to the LM's log-probabilities in
place and fixes up the k neighbour tokens sparsely: this runs in every decode step, and
full-vocabulary passes (and fresh full-vocabulary tensors) are its cost. The LM's log-softmax is the
caller's, computed once per row for the skip rule and the mix together.
"""

from __future__ import annotations

import numpy as np
import torch


def adaptive_lambda(d_nearest: np.ndarray, lambda_max: float, slope: float, center: float) -> np.ndarray:
    """λ(d) = λ_max·sigmoid(slope·(center − d)): trust retrieval more when the nearest key is close
    (Drozdov et al. 2022). `knnlm-eval` fits the three numbers; `knn.adaptive_lambda` serves them."""
    return lambda_max / (1.0 + np.exp(-slope * (center - d_nearest)))


def interpolate(
    lm_log_probs: torch.Tensor, distances: torch.Tensor, tokens: torch.Tensor, lambda_: torch.Tensor, temperature: torch.Tensor
) -> torch.Tensor:
    """log(λ·p_kNN + (1−λ)·p_LM) per row, written over `lm_log_probs` (fp32 [n, vocab], log p_LM) and returned."""
    valid = tokens >= 0
    scores = torch.where(valid, -distances.float() / temperature.float()[:, None], -torch.inf)
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # all-padding rows: zeros, not NaN
    lam = torch.where(valid.any(dim=1), lambda_.float(), 0.0)[:, None]
    # Padding slots point at the row's first neighbour token: every write to a token carries the same value.
    index = torch.where(valid, tokens, tokens[:, :1].clamp(min=0)).long()
    p_knn = torch.zeros(lm_log_probs.shape, dtype=torch.float32, device=lm_log_probs.device)
    p_at_neighbours = p_knn.scatter_add_(1, index, weights).gather(1, index)  # duplicates summed
    mixed = lm_log_probs.add_(torch.log1p(-lam))
    return mixed.scatter_(1, index, torch.logaddexp(lam.log() + p_at_neighbours.log(), mixed.gather(1, index)))


def knn_log_prob(distances: np.ndarray, match: np.ndarray, k: int, temperature: float) -> np.ndarray:
    """log p_kNN(target) [T] from the k nearest: log Σ_match softmax(−d/τ) (−inf if none match)."""
    scores = -distances[:, :k].astype(np.float64) / temperature  # padding (+inf) -> -inf
    top = np.max(scores, axis=1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    weights = np.exp(scores - top)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.log(np.sum(weights * match[:, :k], axis=1)) - np.log(np.sum(weights, axis=1))


def mixture_log_prob(log_p_lm: np.ndarray, log_p_knn: np.ndarray, lambda_, has_neighbour: np.ndarray) -> np.ndarray:
    """log(λ·p_kNN + (1−λ)·p_LM), λ scalar or per token; rows without neighbours keep p_LM (as the server)."""
    lam = np.where(has_neighbour, lambda_, 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):  # log 0 = -inf, and logaddexp(-inf, -inf) = -inf
        return np.logaddexp(np.log(lam) + log_p_knn, np.log1p(-lam) + log_p_lm)
