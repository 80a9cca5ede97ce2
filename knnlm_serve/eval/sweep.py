"""Sweeps over (k, τ, λ) and the adaptive-λ fit, from per-token arrays: no model, no search."""

from __future__ import annotations

import numpy as np

from knnlm_core.config import EvalConfig
from knnlm_core.mixture import adaptive_lambda, knn_log_prob, mixture_log_prob


def perplexity(log_probs: np.ndarray) -> float:
    return float(np.exp(-np.mean(log_probs, dtype=np.float64)))


def sweep(log_p_lm: np.ndarray, distances: np.ndarray, match: np.ndarray, tune: np.ndarray, config: EvalConfig) -> dict:
    """Perplexity on both parts for every (k, τ, λ), and the setting with the best tuning perplexity."""
    has = np.isfinite(distances[:, 0])
    ks = [k for k in config.ks if k <= distances.shape[1]]
    shape = (len(ks), len(config.temperatures), len(config.lambdas))
    tune_ppl, report_ppl = np.empty(shape), np.empty(shape)
    for a, k in enumerate(ks):
        for b, tau in enumerate(config.temperatures):
            log_p_knn = knn_log_prob(distances, match, k, tau)
            for c, lam in enumerate(config.lambdas):
                mix = mixture_log_prob(log_p_lm, log_p_knn, lam, has)
                tune_ppl[a, b, c], report_ppl[a, b, c] = perplexity(mix[tune]), perplexity(mix[~tune])
    a, b, c = np.unravel_index(np.nanargmin(tune_ppl), shape)
    best = {
        "k": ks[a],
        "temperature": config.temperatures[b],
        "lambda": config.lambdas[c],
        "tune_ppl": tune_ppl[a, b, c],
        "report_ppl": report_ppl[a, b, c],
    }
    grid = {
        "k": ks,
        "temperature": list(config.temperatures),
        "lambda": list(config.lambdas),
        "tune_ppl": tune_ppl.round(4).tolist(),
        "report_ppl": report_ppl.round(4).tolist(),
    }
    return {"best": best, "grid": grid}


def fit_adaptive_lambda(log_p_lm, log_p_knn, d_nearest, tune, config: EvalConfig) -> dict:
    """Grid search of (λ_max, slope, center) on the tuning part (after Drozdov et al., 2022)."""
    has = np.isfinite(d_nearest)
    d = np.where(has, d_nearest, 0.0)
    spread = float(np.std(d[tune & has])) or 1.0
    centers = np.quantile(d[tune & has], np.linspace(0.05, 0.95, 19))
    best = None
    for lambda_max in (lam for lam in config.lambdas if lam > 0):
        for slope in (s / spread for s in (0.25, 0.5, 1, 2, 4, 8)):
            for center in centers:
                lam = adaptive_lambda(d, lambda_max, slope, center)
                ppl = perplexity(mixture_log_prob(log_p_lm[tune], log_p_knn[tune], lam[tune], has[tune]))
                if best is None or ppl < best[0]:
                    best = (ppl, lambda_max, slope, float(center))
    ppl, lambda_max, slope, center = best
    lam = adaptive_lambda(d, lambda_max, slope, center)
    report = perplexity(mixture_log_prob(log_p_lm[~tune], log_p_knn[~tune], lam[~tune], has[~tune]))
    return {
        "lambda_max": lambda_max,
        "slope": slope,
        "center": center,
        "tune_ppl": ppl,
        "report_ppl": report,
        "mean_lambda_report": float(np.mean(np.where(has, lam, 0)[~tune])),
    }
