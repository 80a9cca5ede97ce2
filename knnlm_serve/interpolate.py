"""The kNN-LM distribution: p = λ·p_kNN + (1−λ)·p_LM, computed in fp32 log space.

p_kNN(v) = Σ_{j: token_j = v} softmax_j(−d_j / τ) over the k retrieved neighbours. Padding
neighbours (distance +inf, token −1) get zero weight; a row with no neighbour keeps p_LM.
"""

from __future__ import annotations

import torch


def knn_log_probs(distances: torch.Tensor, tokens: torch.Tensor, temperature: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """log p_kNN [n, vocab] from distances [n, k], tokens [n, k] and per-row temperature [n]."""
    valid = tokens >= 0
    scores = torch.where(valid, -distances.float() / temperature.float()[:, None], -torch.inf)
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # all-padding rows: zeros, not NaN
    p_knn = torch.zeros(distances.shape[0], vocab_size, dtype=torch.float32, device=distances.device)
    p_knn.scatter_add_(1, tokens.clamp(min=0).long(), weights)
    return p_knn.log()


def interpolate(
    lm_logits: torch.Tensor, distances: torch.Tensor, tokens: torch.Tensor, lambda_: torch.Tensor, temperature: torch.Tensor
) -> torch.Tensor:
    """log(λ·p_kNN + (1−λ)·p_LM) per row, fp32 [n, vocab]."""
    log_p_lm = torch.log_softmax(lm_logits.float(), dim=-1)
    log_p_knn = knn_log_probs(distances, tokens, temperature, lm_logits.shape[-1])
    lam = torch.where((tokens >= 0).any(dim=1), lambda_.float(), 0.0)[:, None]
    return torch.logaddexp(lam.log() + log_p_knn, torch.log1p(-lam) + log_p_lm)
