"""`evaluate`: base LM vs kNN-LM perplexity with sweeps, the best setting checked through vLLM."""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from knnlm_core.calibration import fit_adaptive_lambda, fit_skip, perplexity, pointer_curve, served_with_skips, sweep
from knnlm_core.config import EvalConfig, KnnConfig
from knnlm_core.datastore import load_document_starts
from knnlm_core.mixture import adaptive_lambda, knn_log_prob, mixture_log_prob
from knnlm_core.model_dir import model_fingerprint
from knnlm_core.pointers import consecutive, replay, shard_lookup
from knnlm_core.search import open_shards
from knnlm_serve.eval.score import (
    Variant,
    close_engine,
    encode_keys,
    find_neighbours,
    full_retrieval_variant,
    open_engine,
    plan_variants,
    score_with_vllm,
)
from knnlm_serve.eval.text import EvalError, load_eval_text
from knnlm_serve.runtime import DatastoreInfo, ServedModel, check_datastore, mix_defaults


@dataclass
class EvalRun:
    """Everything a run computed: the summary (JSON-able) and the per-token arrays."""

    summary: dict
    arrays: dict[str, np.ndarray] = field(default_factory=dict)


class Stopwatch:
    """Seconds per phase of a run, reported as `timings_s`."""

    def __init__(self) -> None:
        self.started, self.seconds = time.monotonic(), {}

    @contextmanager
    def phase(self, name: str):
        t0 = time.monotonic()
        yield
        self.seconds[name] = time.monotonic() - t0

    def report(self) -> dict[str, float]:
        return {k: round(v, 1) for k, v in {**self.seconds, "total_s": time.monotonic() - self.started}.items()}


@dataclass
class Swept:
    """Every variant's sweep over the text, with what the later phases reuse."""

    results: list[dict]
    neighbours: dict[Variant, tuple[np.ndarray, np.ndarray]]  # per variant: distances, whether each neighbour is the target
    keys: dict[str, np.ndarray]  # per key type: the text's query keys
    served_ids: np.ndarray  # the served variant's neighbour ids (pointer following replays from its own searches)


def evaluate(inputs: list[str | Path], datastores: dict[str, str | Path], model_dir: Path, config: EvalConfig = EvalConfig()) -> EvalRun:
    """Base LM vs kNN-LM perplexity with sweeps; the first datastore is the one served through vLLM."""
    if not datastores:
        raise EvalError("no datastore given; pass --datastore NAME=PATH (one or more)")
    clock = Stopwatch()
    model = ServedModel.inspect(model_dir)
    checked = {name: check_datastore(name, path, model) for name, path in datastores.items()}
    manifests = {name: m for name, (_, m) in checked.items()}
    variants = plan_variants(manifests, config)
    text = load_eval_text(inputs, model_dir, config)
    tune, main = text.tune, next(iter(checked))
    with clock.phase("engine_start_s"):
        llm = open_engine(
            model_dir,
            [checked[main][0]],
            k=max(config.ks),
            max_model_len=config.context_length + 2,
            kv_cache_gib=config.kv_cache_gib,
            seed=config.seed,
        )
    try:  # an engine left open on an error keeps the process from exiting (close_engine)
        with clock.phase("base_pass_s"):
            log_p_lm, top_log_p = score_with_vllm(llm, text, {"knn": False}, config.progress, top=True)
        swept = _sweep_variants(variants, checked, text, log_p_lm, model_dir, config, clock)
        results, neighbours = swept.results, swept.neighbours

        best_i = int(np.argmin([r["best"]["tune_ppl"] for r in results]))
        best_v, best = variants[best_i], results[best_i]["best"]
        distances, match = neighbours[best_v]
        log_p_knn = knn_log_prob(distances, match, best["k"], best["temperature"])
        adaptive = fit_adaptive_lambda(log_p_lm, log_p_knn, distances[:, 0].astype(np.float64), tune, config)

        # The served setting: the first datastore at its served nprobe, at its own best (k, τ, λ),
        # with searches skipped where the LM is confident (the skip rule fitted to that setting).
        served, sb = variants[0], results[0]["best"]
        sd, sm = neighbours[served]
        log_p_full = mixture_log_prob(log_p_lm, knn_log_prob(sd, sm, sb["k"], sb["temperature"]), sb["lambda"], np.isfinite(sd[:, 0]))
        with clock.phase("pointers_s"):
            replayer = PointerReplay.of(Path(checked[main][0].path), manifests[main], text, swept.keys[served.key_type], sd.shape[1])
            pointers = replayer and _pointer_curve(replayer, sd, swept.served_ids, sb, log_p_lm, log_p_full, tune)
        skip = fit_skip(log_p_lm, log_p_full, top_log_p, tune, config.skip_tolerance)
        setting = {
            "knn_lambda": sb["lambda"],
            "knn_k": sb["k"],
            "knn_temperature": sb["temperature"],
            "knn_skip_threshold": skip["threshold"],
        }
        with clock.phase("knn_pass_s"):
            log_p_served = score_with_vllm(llm, text, {"knn": True, "knn_datastore": main, **setting}, config.progress)
        log_p_numpy = served_with_skips(log_p_lm, log_p_full, top_log_p, skip["threshold"])
    finally:
        close_engine(llm)
    full = full_retrieval_variant(variants, manifests)
    served_defaults = _served_defaults(
        checked[main][0], log_p_lm, top_log_p, sd, sm, swept.served_ids, replayer, tune, best, (full, neighbours[full])
    )
    mixture = {k: sb[k] for k in ("k", "temperature", "lambda")}
    summary = {
        "model": {"name": model_dir.name, "path": str(model_dir), "fingerprint": model_fingerprint(model_dir)},
        "text": {
            "sources": [str(p) for p in inputs],
            "documents": text.documents,
            "tokens": int(len(text.tokens)),
            "scored_tokens": int(len(text.targets)),
            "context_length": config.context_length,
            "stride": config.stride,
            "windows": int(len(text.plan.windows)),
            "tune_tokens": int(tune.sum()),
            "report_tokens": int((~tune).sum()),
            "split": f"tuning = the first {config.tune_fraction:.0%} of scored tokens (in text order), report = the rest",
        },
        "base": {"tune_ppl": perplexity(log_p_lm[tune]), "report_ppl": perplexity(log_p_lm[~tune])},
        "best": {"variant": best_v.label, "index": best_v.index, "nprobe": best_v.nprobe, "key_type": best_v.key_type, **best},
        "adaptive": {"variant": best_v.label, "k": best["k"], "temperature": best["temperature"], **adaptive},
        "served_defaults": served_defaults,
        "served": {
            "variant": served.label,
            **mixture,
            "skip_threshold": skip["threshold"],
            "skipped_report": float(np.mean(np.exp(top_log_p[~tune]) > skip["threshold"])),
            "vllm_tune_ppl": perplexity(log_p_served[tune]),
            "vllm_report_ppl": perplexity(log_p_served[~tune]),
            "numpy_tune_ppl": perplexity(log_p_numpy[tune]),
            "numpy_report_ppl": perplexity(log_p_numpy[~tune]),
            "max_abs_logprob_diff": float(np.max(np.abs(log_p_served - log_p_numpy))),
        },
        "adaptive_retrieval": {"variant": served.label, **mixture, **skip},
        "pointers": pointers and {"variant": served.label, **mixture, **pointers},
        "variants": results,
        "config": config.model_dump(mode="json"),
        "timings_s": clock.report(),
    }
    arrays = {
        "target": text.targets,
        "tune": tune,
        "log_p_lm": log_p_lm,
        "top_log_p_lm": top_log_p,
        "log_p_knnlm_vllm": log_p_served,
        "log_p_knnlm_numpy": log_p_numpy,
        "d_nearest": sd[:, 0],
    }
    return EvalRun(_plain(summary), arrays)


def _sweep_variants(variants: list[Variant], checked: dict, text, log_p_lm, model_dir: Path, config: EvalConfig, clock: Stopwatch) -> Swept:
    """Search each variant's neighbours of the text (keys encoded once per key type) and sweep (k, τ, λ) over them."""
    keys, neighbours, results, served_ids = {}, {}, [], None
    for v in variants:
        if v.key_type not in keys:
            with clock.phase(f"keys_{v.key_type}_s"):
                keys[v.key_type] = encode_keys(model_dir, text, v.key_type, config)
        info, manifest = checked[v.datastore]
        t0 = time.monotonic()
        distances, tokens, ids = find_neighbours(Path(info.path), manifest, v, keys[v.key_type], max(config.ks), config)
        search_s = time.monotonic() - t0
        served_ids = ids if served_ids is None else served_ids
        neighbours[v] = distances, tokens == text.targets[:, None]
        result = sweep(log_p_lm, *neighbours[v], text.tune, config)
        results.append(
            {
                "label": v.label,
                "datastore": v.datastore,
                "key_type": v.key_type,
                "index": v.index,
                "nprobe": v.nprobe,
                "fraction": v.fraction,
                "entries": manifest.entries,
                "search_s": round(search_s, 2),
                **result,
            }
        )
    return Swept(results, neighbours, keys, served_ids)


@dataclass(frozen=True)
class PointerReplay:
    """Pointer following replayed over the eval text as the server would follow it
    (`pointers.replay`): the datastore's values and document starts, which positions continue the
    one before, and exact scoring of candidate entries against each position's key."""

    text: object
    values: np.ndarray
    starts: np.ndarray
    continues: np.ndarray
    lookup: object

    @classmethod
    def of(cls, root: Path, manifest, text, queries: np.ndarray, k: int) -> PointerReplay | None:
        """None for a datastore without document boundaries (built before pointer following)."""
        starts = load_document_starts(root, manifest)
        if starts is None:
            return None
        searchers = open_shards(root, manifest)
        values = np.concatenate([np.asarray(s.values) for s in searchers])
        continues = consecutive(np.concatenate([np.arange(k0, k1) for _, k0, k1 in text.plan.windows]))
        return cls(text, values, starts, continues, shard_lookup(searchers, queries, k))

    def __call__(self, ids, distances, min_pointers: int, skipped=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return replay(ids, distances, self.text.targets, self.continues, self.values, self.lookup, self.starts, min_pointers, skipped)

    def matches(self, ids: np.ndarray) -> np.ndarray:
        return (ids >= 0) & (self.values[np.maximum(ids, 0)] == self.text.targets[:, None])


def _pointer_curve(replayer: PointerReplay, distances, ids, setting: dict, log_p_lm, log_p_full, tune) -> dict:
    """Pointer following replayed over the text at the served setting, for each minimum number of
    surviving pointers: the share of searches it saves and the perplexity, vs every step searched."""

    def served(d: np.ndarray, i: np.ndarray) -> np.ndarray:
        log_p_knn = knn_log_prob(d, replayer.matches(i), setting["k"], setting["temperature"])
        return mixture_log_prob(log_p_lm, log_p_knn, setting["lambda"], np.isfinite(d[:, 0]))

    r, k = replayer, setting["k"]  # the server keeps k neighbours a step: only their successors are candidates
    curve = pointer_curve(ids[:, :k], distances[:, :k], r.text.targets, r.continues, r.values, r.lookup, r.starts, served, tune)
    return {"full_ppl": perplexity(log_p_full[~tune]), "curve": curve}


def _served_defaults(
    info: DatastoreInfo, log_p_lm, top_log_p, distances, match, ids, replayer: PointerReplay | None, tune, best: dict, full: tuple
) -> dict:
    """What a request that sets no knob gets from the first datastore as built (its calibration,
    else the config defaults; searches skipped by its skip rule, pointers followed by its pointer
    rule), scored from the same neighbours, and its gap to the tuned best and to full retrieval
    (`full`: the variant searched at the build's nprobe and its neighbours, every row searched)."""
    d = mix_defaults(KnnConfig(), info.name, info.calibration)
    k = min(d.k, distances.shape[1])

    def mixture(dist: np.ndarray, hit: np.ndarray) -> np.ndarray:
        lam = d.lambda_ if d.lambda_ is not None else adaptive_lambda(dist[:, 0].astype(np.float64), **d.adaptive_lambda.model_dump())
        return mixture_log_prob(log_p_lm, knn_log_prob(dist, hit, k, d.temperature), lam, np.isfinite(dist[:, 0]))

    every_search = mixture(distances, match)
    skipped = np.exp(top_log_p) > d.skip_threshold
    followed = np.zeros(len(distances), dtype=bool)
    served = every_search
    if replayer is not None and d.min_pointers:
        used_d, used_ids, followed = replayer(ids[:, :k], distances[:, :k], d.min_pointers, skipped)
        served = mixture(used_d, replayer.matches(used_ids))
    mix = served_with_skips(log_p_lm, served, top_log_p, d.skip_threshold)
    report = perplexity(mix[~tune])
    full_variant, (full_distances, full_match) = full
    full_report = perplexity(mixture(full_distances, full_match)[~tune])
    return {
        "lambda": "adaptive" if d.lambda_ is None else d.lambda_,
        "k": k,
        "temperature": d.temperature,
        "adaptive_lambda": d.adaptive_lambda.model_dump() if d.adaptive_lambda else None,
        "skip_threshold": d.skip_threshold,
        "skipped_report": float(np.mean(skipped[~tune])),
        "min_pointers": d.min_pointers,
        "followed_report": float(np.mean(followed[~tune])),
        "report_ppl_every_search": perplexity(every_search[~tune]),
        "source": d.source,
        "tune_ppl": perplexity(mix[tune]),
        "report_ppl": report,
        "gap_to_best_pct": 100 * (report / best["report_ppl"] - 1),
        "full_retrieval": {"nprobe": full_variant.nprobe, "report_ppl": full_report, "gap_pct": 100 * (report / full_report - 1)},
    }


def _plain(value):
    """NumPy scalars -> Python numbers, so the summary is JSON as is."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
