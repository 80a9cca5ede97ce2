"""Fitting the mixture to held-out text: sweeps over (k, τ, λ), the adaptive-λ curve and the rule
for skipping searches.

Plain functions over per-token arrays (no model, no search): log p_LM(target), log p_LM of the
LM's top token, the k nearest distances and whether each neighbour's value is the target. `knnlm-eval` reports them;
`knnlm-index` stores the best as the datastore's calibration.
"""

from __future__ import annotations

import numpy as np

from knnlm_core.config import SweepGrid
from knnlm_core.mixture import adaptive_lambda, knn_log_prob, mixture_log_prob
from knnlm_core.pointers import replay


def perplexity(log_probs: np.ndarray) -> float:
    return float(np.exp(-np.mean(log_probs, dtype=np.float64)))


def sweep(log_p_lm: np.ndarray, distances: np.ndarray, match: np.ndarray, tune: np.ndarray, config: SweepGrid) -> dict:
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


def cheapest_k(swept: dict, tolerance: float) -> dict:
    """The smallest k whose best (τ, λ) on the fitting half is within `tolerance` (a share) of the
    best setting's perplexity, that setting, and the per-k curve.

    A search's cost grows with k where kNN-LM's k is large: the top-k selection, the answer sent
    back from every shard, their merge and the mix all scale with it, and for exact and IVF-PQ
    search alike the k = 1024 selection is a fixed part of each step (benchmarks/search_backends.py).
    Perplexity is often flat in k over the top of the grid, so the cheapest k within a small
    tolerance serves nearly the same mixture for less."""
    grid = swept["grid"]
    tune, report = np.asarray(grid["tune_ppl"]), np.asarray(grid["report_ppl"])
    best_tune = float(np.nanmin(tune))
    curve = []
    for a, k in enumerate(grid["k"]):
        b, c = np.unravel_index(np.nanargmin(tune[a]), tune[a].shape)
        curve.append(
            {
                "k": k,
                "temperature": grid["temperature"][b],
                "lambda": grid["lambda"][c],
                "tune_ppl": float(tune[a, b, c]),
                "report_ppl": float(report[a, b, c]),
            }
        )
    chosen = min((c for c in curve if c["tune_ppl"] <= best_tune * (1 + tolerance)), key=lambda c: c["k"])
    return {**chosen, "curve": [{key: c[key] for key in ("k", "tune_ppl", "report_ppl")} for c in curve]}


def narrowest_nprobe(widest: int, tolerance: float, fit_at) -> tuple[int, tuple, list[dict]]:
    """Halve an IVF search's nprobe from `widest` while the calibration fitted at it stays within
    `tolerance` (a share) of the best fitting-half perplexity so far. `fit_at(nprobe)` searches and
    fits, returning (fit, *its arrays). Returns the narrowest nprobe that stayed within, what
    `fit_at` returned for it, and the curve of every nprobe tried.

    An IVF-PQ search's cost is mostly the codes it scans, linear in nprobe, and approximate search
    often loses nothing measurable at a fraction of the build's default breadth."""
    chosen, fitted = widest, fit_at(widest)
    curve = [{"nprobe": widest, **_best_point(fitted[0])}]
    best = curve[0]["tune_ppl"]
    nprobe = widest // 2
    while nprobe >= 1:
        narrower = fit_at(nprobe)
        curve.append({"nprobe": nprobe, **_best_point(narrower[0])})
        if curve[-1]["tune_ppl"] > best * (1 + tolerance):
            break
        best = min(best, curve[-1]["tune_ppl"])
        chosen, fitted = nprobe, narrower
        nprobe //= 2
    return chosen, fitted, curve


def _best_point(fit: dict) -> dict:
    """A fit's lowest fitting-half perplexity over (k, τ, λ), and that setting's on the judged half."""
    point = min(fit["k_curve"]["ks"], key=lambda p: p["tune_ppl"])
    return {"tune_ppl": point["tune_ppl"], "report_ppl": point["report_ppl"]}


def fit_adaptive_lambda(log_p_lm, log_p_knn, d_nearest, tune, config: SweepGrid) -> dict:
    """Grid search of (λ_max, slope, center) on the tuning part (after Drozdov et al., 2022).

    Held-out text rarely lies close to a stored key, so the best curve barely constrains λ there;
    of the curves within `config.ceiling_tolerance` of the best, the one with the highest λ at
    distance 0 is kept, so that text in the stored form gets the strongest mixture the held-out
    text allows."""
    has = np.isfinite(d_nearest)
    d = np.where(has, d_nearest, 0.0)
    spread = float(np.std(d[tune & has])) or 1.0
    centers = np.quantile(d[tune & has], np.linspace(0.05, 0.95, 19))
    fits = []
    for lambda_max in (lam for lam in config.lambdas if lam > 0):
        for slope in (s / spread for s in (0.25, 0.5, 1, 2, 4, 8)):
            for center in centers:
                lam = adaptive_lambda(d, lambda_max, slope, center)
                fits.append(
                    (perplexity(mixture_log_prob(log_p_lm[tune], log_p_knn[tune], lam[tune], has[tune])), lambda_max, slope, float(center))
                )
    best = min(fits)[0]
    near = [f for f in fits if f[0] <= best * (1 + config.ceiling_tolerance)]
    ppl, lambda_max, slope, center = max(near, key=lambda f: (float(adaptive_lambda(np.zeros(1), *f[1:])[0]), -f[0]))
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


def served_with_skips(log_p_lm: np.ndarray, log_p_knnlm: np.ndarray, top_log_p: np.ndarray, threshold: float) -> np.ndarray:
    """Per-token log p as served under adaptive retrieval: where the LM's top probability exceeds
    `threshold` the search is skipped and the token gets p_LM, elsewhere the kNN-LM mixture."""
    return np.where(np.exp(top_log_p) > threshold, log_p_lm, log_p_knnlm)


SKIP_SHARES = tuple(round(0.05 * i, 2) for i in range(20))  # shares of tuning tokens to try skipping: 0 .. 0.95


def fit_skip(log_p_lm, log_p_knnlm, top_log_p, tune, tolerance: float) -> dict:
    """The lowest LM top-probability threshold whose skipped searches cost at most `tolerance`
    (a share) of the full-retrieval perplexity on the tuning part, and its curve.

    After He et al. (2021), who skip retrieval where the LM alone is good enough; a threshold on the
    LM's own confidence needs no trained model and costs one max and logsumexp per row at serving.
    Thresholds are tried at quantiles of the tuning part's top probabilities (skipping 0 .. 95%)."""
    top_p = np.exp(top_log_p)
    full_tune = perplexity(log_p_knnlm[tune])
    curve = []
    for share in SKIP_SHARES:
        threshold = 1.0 if share == 0 else float(np.quantile(top_p[tune], 1 - share))
        served = served_with_skips(log_p_lm, log_p_knnlm, top_log_p, threshold)
        curve.append(
            {
                "threshold": threshold,
                "tune_skipped": float(np.mean(top_p[tune] > threshold)),
                "tune_ppl": perplexity(served[tune]),
                "report_skipped": float(np.mean(top_p[~tune] > threshold)),
                "report_ppl": perplexity(served[~tune]),
            }
        )
    best = max((c for c in curve if c["tune_ppl"] <= full_tune * (1 + tolerance)), key=lambda c: c["tune_skipped"])
    return {
        "threshold": best["threshold"],
        "skipped": best["report_skipped"],
        "ppl": best["report_ppl"],
        "full_ppl": curve[0]["report_ppl"],
        "tolerance": tolerance,
        "curve": curve,
    }


def fitting_half(tokens: int) -> np.ndarray:
    """A calibration fits on the first half of its held-out tokens (text order) and is judged on the rest."""
    return np.arange(tokens) < tokens // 2


def served_log_prob(log_p_lm: np.ndarray, distances: np.ndarray, match: np.ndarray, fit: dict) -> np.ndarray:
    """log p of each target under a calibration's mixture: its k, τ and fixed or adaptive λ."""
    log_p_knn = knn_log_prob(distances, match, fit["k"], fit["temperature"])
    d_nearest = distances[:, 0].astype(np.float64)
    has = np.isfinite(d_nearest)
    curve = fit["adaptive_lambda"]
    lam = (
        fit["lambda"]
        if fit["mode"] == "fixed"
        else adaptive_lambda(np.where(has, d_nearest, 0.0), curve["lambda_max"], curve["slope"], curve["center"])
    )
    return mixture_log_prob(log_p_lm, log_p_knn, lam, has)


POINTER_MINIMUMS = (1, 4, 16, 64, 256)  # minimums of surviving pointers tried by calibration and knnlm-eval


def pointer_curve(ids, distances, targets, continues, values, lookup, document_starts, served, tune, skipped=None) -> list[dict]:
    """Pointer following replayed (pointers.replay) for each of POINTER_MINIMUMS: the share of
    tokens that followed pointers instead of searching and the perplexity, on both parts;
    `served(distances, ids)` is the per-token log p of the mixture from those neighbours."""
    curve = []
    for minimum in POINTER_MINIMUMS:
        d, i, followed = replay(ids, distances, targets, continues, values, lookup, document_starts, minimum, skipped)
        log_p = served(d, i)
        curve.append(
            {
                "min_pointers": minimum,
                "tune_saved": float(followed[tune].mean()),
                "tune_ppl": perplexity(log_p[tune]),
                "report_saved": float(followed[~tune].mean()),
                "report_ppl": perplexity(log_p[~tune]),
            }
        )
    return curve


def fit_pointers(curve: list[dict], reference_tune_ppl: float, reference_report_ppl: float, tolerance: float) -> dict:
    """The minimum of surviving pointers that saves the most searches on the fitting half while
    its perplexity stays within `tolerance` of `reference` (the same mixture, searching every
    non-skipped row); 0 (off) when none does. `curve` rows: min_pointers, tune/report saved and ppl."""
    fits = [c for c in curve if c["tune_ppl"] <= reference_tune_ppl * (1 + tolerance)]
    best = max(fits, key=lambda c: c["tune_saved"], default=None)
    return {
        "min_pointers": best["min_pointers"] if best else 0,
        "saved": best["report_saved"] if best else 0.0,
        "ppl": best["report_ppl"] if best else reference_report_ppl,
        "full_ppl": reference_report_ppl,
        "tolerance": tolerance,
    }


# ------------------------------------------------------------------ the fit a datastore stores


def fit_calibration(
    log_p_lm: np.ndarray, top_log_p: np.ndarray, distances: np.ndarray, match: np.ndarray, grid: SweepGrid = SweepGrid()
) -> dict:
    """λ, τ, k and the adaptive-λ curve that fit held-out tokens best, which of the two to serve,
    and the skip rule for that served mixture. k is the smallest within `grid.k_tolerance` of the
    best (`cheapest_k`).

    Fitted on the first half of the tokens (text order), judged on the second: the adaptive curve is
    served only where it beats the fixed λ there. τ is searched on the grid and on multiples of the
    median nearest distance, since distance scales differ by model."""
    d1 = distances[:, 0][np.isfinite(distances[:, 0])]
    scale = float(np.median(d1)) if len(d1) and np.median(d1) > 0 else 1.0
    temperatures = tuple(sorted({*grid.temperatures, *(round(scale * m, 6) for m in (0.05, 0.1, 0.2, 0.5, 1, 2, 5))}))
    grid = grid.model_copy(
        update={"temperatures": temperatures, "ks": tuple(k for k in grid.ks if k <= distances.shape[1]) or (distances.shape[1],)}
    )
    tune = fitting_half(len(log_p_lm))
    best = cheapest_k(sweep(log_p_lm, distances, match, tune, grid), grid.k_tolerance)
    log_p_knn = knn_log_prob(distances, match, best["k"], best["temperature"])
    adaptive = fit_adaptive_lambda(log_p_lm, log_p_knn, distances[:, 0].astype(np.float64), tune, grid)
    fit = {
        "lambda": best["lambda"],
        "temperature": best["temperature"],
        "k": best["k"],
        "adaptive_lambda": {key: adaptive[key] for key in ("lambda_max", "slope", "center")},
        "mode": "adaptive" if adaptive["report_ppl"] < best["report_ppl"] * (1 + grid.ceiling_tolerance) else "fixed",
    }
    skip = fit_skip(log_p_lm, served_log_prob(log_p_lm, distances, match, fit), top_log_p, tune, grid.skip_tolerance)
    return {
        **fit,
        "tokens": int(len(log_p_lm)),
        "base_ppl": perplexity(log_p_lm[~tune]),
        "knn_ppl": best["report_ppl"],
        "adaptive_ppl": adaptive["report_ppl"],
        "ceiling_tolerance": grid.ceiling_tolerance,
        "k_curve": {"tolerance": grid.k_tolerance, "ks": best["curve"]},
        "skip": {key: skip[key] for key in ("threshold", "skipped", "ppl", "full_ppl", "tolerance")},
    }
