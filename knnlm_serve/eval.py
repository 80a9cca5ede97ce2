"""`knnlm-eval`: perplexity of a held-out text under the base LM and under kNN-LM, with sweeps.

The served numbers come from vLLM with the knnlm plugin (prompt logprobs of the interpolated
distribution), scored in the index builder's sliding windows so each token is predicted once.
Sweeps never rerun the model: one vLLM pass with kNN off gives log p_LM(target); each datastore
variant is searched once at the largest k with the same keys the plugin uses (KeyEncoder over the
same windows); p_kNN for every (k, τ) and the mixture for every λ are then array operations. The
best setting, picked on the tuning part only, is scored once more through vLLM with kNN on, and
the report shows both numbers (they must agree).
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import faiss
import numpy as np
from tqdm import tqdm

from index_builder.corpus import find_files, iter_documents
from index_builder.encode import KeyEncoder, WindowPlan, plan_windows, window_values
from knnlm_serve.config import KeyType, KnnConfig
from knnlm_serve.datastore import Manifest
from knnlm_serve.model import model_fingerprint
from knnlm_serve.runtime import CONFIG_ENV, DatastoreInfo, Runtime, check_datastore, hidden_size_of
from knnlm_serve.interpolate import adaptive_lambda
from knnlm_serve.shard import merge_topk, open_shards, search_index

SEARCH_BATCH = 2048


class EvalError(ValueError):
    """An evaluation that cannot run as asked; the message names the input and the fix."""


@dataclass(frozen=True)
class EvalConfig:
    """What `knnlm-eval` sweeps and how it windows the text."""

    context_length: int = 512
    stride: int = 256
    lambdas: tuple[float, ...] = tuple(round(0.05 * i, 2) for i in range(21))
    temperatures: tuple[float, ...] = (0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 20.0, 50.0, 100.0)
    ks: tuple[int, ...] = (16, 64, 256, 1024)
    nprobes: tuple[int, ...] = ()  # IVF datastores: also search at these nprobe (default: the manifest's)
    exact: bool = False  # also search exactly (flat L2 over the kept keys; needs --keep-keys)
    fractions: tuple[float, ...] = ()  # also search random fractions of the first datastore
    tune_fraction: float = 0.2  # the first this share of scored tokens tunes; the rest is reported
    seed: int = 0
    batch_size: int = 8
    kv_cache_gib: float = 1.0
    text_field: str = "text"
    progress: bool = True


# ---------------------------------------------------------------- the text and its windows


@dataclass(frozen=True)
class EvalText:
    """The tokenized text, its windows, and the scored positions: position p predicts tokens[p+1]."""

    tokens: np.ndarray  # int32 [N]
    documents: int
    plan: WindowPlan
    targets: np.ndarray  # int32 [T], in window order
    tune: np.ndarray  # bool [T]: the tuning part (the first tune_fraction of targets)


def load_eval_text(inputs: list[str | Path], model_dir: Path, config: EvalConfig) -> EvalText:
    """Read the text like the index builder does (same formats, same tokenizer call)."""
    from transformers import AutoTokenizer

    files = find_files(inputs)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    docs = [np.asarray(tokenizer(t).input_ids, dtype=np.int32) for t in iter_documents(files, text_field=config.text_field)]
    offsets = np.zeros(len(docs) + 1, dtype=np.int64)
    np.cumsum([len(d) for d in docs], out=offsets[1:])
    where = ", ".join(map(str, inputs))
    if offsets[-1] == 0:
        raise EvalError(f"the eval text ({where}) is empty")
    if offsets[-1] < config.context_length:
        raise EvalError(
            f"the eval text ({where}) has {offsets[-1]} tokens, fewer than one window of --context-length "
            f"{config.context_length}; pass a longer text or a smaller --context-length"
        )
    tokens = np.concatenate(docs)
    plan = plan_windows(offsets, config.context_length, config.stride)
    targets = window_values(tokens, plan)
    tune = np.arange(len(targets)) < max(1, round(config.tune_fraction * len(targets)))
    return EvalText(tokens, len(docs), plan, targets, tune)


def perplexity(log_probs: np.ndarray) -> float:
    return float(np.exp(-np.mean(log_probs, dtype=np.float64)))


# ---------------------------------------------------------------- scoring through vLLM


def open_engine(model_dir: Path, datastore: DatastoreInfo, config: EvalConfig):
    """An offline vLLM engine with the knnlm plugin serving `datastore` (in-process search).

    The runtime reaches vLLM's engine process through the environment, as in `knnlm-serve`."""
    knn = KnnConfig(datastores={datastore.name: datastore.path}, backend="local", k=max(config.ks), max_k=max(config.ks))
    from vllm import LLM

    from knnlm_serve.cli import VALIDATOR

    # Set only while vLLM starts its processes: anything this process starts later must not inherit it.
    saved = {name: os.environ.get(name) for name in (CONFIG_ENV, "VLLM_DISABLE_COMPILE_CACHE")}
    os.environ[CONFIG_ENV] = str(Runtime(knn=knn, datastores={datastore.name: datastore}).save())
    os.environ["VLLM_DISABLE_COMPILE_CACHE"] = "1"
    try:
        return LLM(
            model=str(model_dir), dtype="float32", enforce_eager=True, max_model_len=config.context_length + 2,
            kv_cache_memory_bytes=int(config.kv_cache_gib * 2**30), logits_processors=[VALIDATOR], seed=config.seed,
        )
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def score_with_vllm(llm, text: EvalText, xargs: dict, progress: bool = True) -> np.ndarray:
    """log p(target) [T] from vLLM's prompt logprobs, one request per window."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0, extra_args=xargs)
    windows = text.plan.windows
    prompts = [{"prompt_token_ids": text.tokens[f : k1 + 1].tolist()} for f, _, k1 in windows]
    outputs = llm.generate(prompts, params, use_tqdm=progress)
    scores = []
    for (f, k0, k1), out in zip(windows, outputs):
        ids = text.tokens[k0 + 1 : k1 + 1]
        rows = out.prompt_logprobs[k0 + 1 - f : k1 + 1 - f]
        scores.append([row[int(t)].logprob for row, t in zip(rows, ids)])
    return np.concatenate(scores).astype(np.float64)


# ---------------------------------------------------------------- neighbours


def encode_keys(model_dir: Path, text: EvalText, key_type: KeyType, config: EvalConfig) -> np.ndarray:
    """The plugin's query vectors [T, dim] for every scored position, from the same windows."""
    encoder = KeyEncoder(model_dir, key_type, "float32")
    windows = text.plan.windows
    keys = np.empty((len(text.targets), encoder.dim), dtype=np.float32)
    offsets = text.plan.entry_offsets
    bar = tqdm(total=len(text.targets), unit="tok", desc=f"keys ({key_type})", disable=not config.progress)
    for i in range(0, len(windows), config.batch_size):
        batch = windows[i : i + config.batch_size]
        for w, (f, k0, k1), vectors in zip(range(i, i + len(batch)), batch, encoder.encode([text.tokens[f:k1] for f, _, k1 in batch])):
            keys[offsets[w] : offsets[w + 1]] = vectors[k0 - f : k1 - f]
            bar.update(k1 - k0)
    bar.close()
    return keys


@dataclass(frozen=True)
class Variant:
    """One way of searching one datastore: as built (at an nprobe) or exact, over all or a fraction."""

    datastore: str
    key_type: KeyType
    index: str  # the manifest's factory string, or "exact"
    nprobe: int | None
    fraction: float = 1.0

    @property
    def label(self) -> str:
        probe = f" nprobe={self.nprobe}" if self.nprobe else ""
        part = f" {self.fraction:.0%}" if self.fraction < 1 else ""
        return f"{self.datastore} [{self.key_type}, {self.index}{probe}{part}]"


def plan_variants(manifests: dict[str, Manifest], config: EvalConfig) -> list[Variant]:
    variants = []
    for n, (name, m) in enumerate(manifests.items()):
        is_ivf = m.index.nprobe is not None
        # The manifest's nprobe first: variant 0 is what the vLLM engine serves.
        probes = [m.index.nprobe, *sorted(set(config.nprobes) - {m.index.nprobe})] if is_ivf else [None]
        variants += [Variant(name, m.key_type, m.index.factory, p) for p in probes]
        if config.exact and m.index.factory != "Flat":
            if any(s.keys is None for s in m.shards):
                raise EvalError(f"--exact needs the stored keys of datastore {name!r}; rebuild it with --keep-keys")
            variants.append(Variant(name, m.key_type, "exact", None))
        if n == 0:
            variants += [Variant(name, m.key_type, m.index.factory, m.index.nprobe, f) for f in config.fractions if f < 1]
    return variants


def find_neighbours(root: Path, manifest: Manifest, variant: Variant, keys: np.ndarray, k: int, config: EvalConfig):
    """The merged top-k (distances [T, k], tokens [T, k]) of every query under `variant`."""
    searchers = open_shards(root, manifest, use_gpu=None)
    rng = np.random.default_rng(config.seed)
    shards = []
    for entry, s in zip(manifest.shards, searchers):
        index = s.index
        if variant.index == "exact":
            index = faiss.IndexFlatL2(s.dim)
            index.add(np.load(root / entry.keys.path, mmap_mode="r").astype(np.float32))
        keep = rng.random(s.ntotal) < variant.fraction if variant.fraction < 1 else None
        shards.append((index, s.values, keep))
    out_d, out_t = [], []
    for i in tqdm(range(0, len(keys), SEARCH_BATCH), desc=f"search {variant.label}", disable=not config.progress):
        q = keys[i : i + SEARCH_BATCH]
        d, t = merge_topk([search_index(ix, v, q, k, variant.nprobe, keep) for ix, v, keep in shards], k)
        out_d.append(d)
        out_t.append(t)
    return np.concatenate(out_d), np.concatenate(out_t)


# ---------------------------------------------------------------- the mixture, in NumPy


def knn_log_prob(distances: np.ndarray, match: np.ndarray, k: int, temperature: float) -> np.ndarray:
    """log p_kNN(target) [T] from the k nearest: log Σ_match softmax(−d/τ) (−inf if none match)."""
    scores = -distances[:, :k].astype(np.float64) / temperature  # padding (+inf) -> -inf
    top = np.max(scores, axis=1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    weights = np.exp(scores - top)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.log(np.sum(weights * match[:, :k], axis=1)) - np.log(np.sum(weights, axis=1))


def mixture_log_prob(log_p_lm: np.ndarray, log_p_knn: np.ndarray, lambda_, has_neighbour: np.ndarray) -> np.ndarray:
    """log(λ·p_kNN + (1−λ)·p_LM), λ scalar or per token; rows without neighbours keep p_LM (as the plugin)."""
    lam = np.where(has_neighbour, lambda_, 0.0)
    with np.errstate(divide="ignore"):
        return np.logaddexp(np.log(lam) + log_p_knn, np.log1p(-lam) + log_p_lm)


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
    best = {"k": ks[a], "temperature": config.temperatures[b], "lambda": config.lambdas[c],
            "tune_ppl": tune_ppl[a, b, c], "report_ppl": report_ppl[a, b, c]}
    grid = {"k": ks, "temperature": list(config.temperatures), "lambda": list(config.lambdas),
            "tune_ppl": tune_ppl.round(4).tolist(), "report_ppl": report_ppl.round(4).tolist()}
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
    return {"lambda_max": lambda_max, "slope": slope, "center": center, "tune_ppl": ppl, "report_ppl": report,
            "mean_lambda_report": float(np.mean(np.where(has, lam, 0)[~tune]))}


# ---------------------------------------------------------------- the whole run


@dataclass
class EvalRun:
    """Everything a run computed: the summary (JSON-able) and the per-token arrays."""

    summary: dict
    arrays: dict[str, np.ndarray] = field(default_factory=dict)


def evaluate(inputs: list[str | Path], datastores: dict[str, str | Path], model_dir: Path, config: EvalConfig = EvalConfig()) -> EvalRun:
    """Base LM vs kNN-LM perplexity with sweeps; the first datastore is the one served through vLLM."""
    if not datastores:
        raise EvalError("no datastore given; pass --datastore NAME=PATH (one or more)")
    started = time.monotonic()
    timings: dict[str, float] = {}
    hidden = hidden_size_of(model_dir)
    checked = {name: check_datastore(name, path, model_dir, hidden) for name, path in datastores.items()}
    manifests = {name: m for name, (_, m) in checked.items()}
    variants = plan_variants(manifests, config)
    text = load_eval_text(inputs, model_dir, config)
    tune = text.tune
    main = next(iter(checked))

    t0 = time.monotonic()
    llm = open_engine(model_dir, checked[main][0], config)
    timings["engine_start_s"] = time.monotonic() - t0
    t0 = time.monotonic()
    log_p_lm = score_with_vllm(llm, text, {"knn": False}, config.progress)
    timings["base_pass_s"] = time.monotonic() - t0

    kmax = max(config.ks)
    keys: dict[str, np.ndarray] = {}
    neighbours: dict[Variant, tuple[np.ndarray, np.ndarray]] = {}
    results = []
    for v in variants:
        if v.key_type not in keys:
            t0 = time.monotonic()
            keys[v.key_type] = encode_keys(model_dir, text, v.key_type, config)
            timings[f"keys_{v.key_type}_s"] = time.monotonic() - t0
        t0 = time.monotonic()
        distances, tokens = find_neighbours(Path(checked[v.datastore][0].path), manifests[v.datastore], v, keys[v.key_type], kmax, config)
        search_s = time.monotonic() - t0
        neighbours[v] = distances, tokens == text.targets[:, None]
        result = sweep(log_p_lm, *neighbours[v], tune, config)
        results.append({"label": v.label, "datastore": v.datastore, "key_type": v.key_type, "index": v.index, "nprobe": v.nprobe,
                        "fraction": v.fraction, "entries": manifests[v.datastore].entries, "search_s": round(search_s, 2), **result})
    best_i = int(np.argmin([r["best"]["tune_ppl"] for r in results]))
    best_v, best = variants[best_i], results[best_i]["best"]
    distances, match = neighbours[best_v]
    log_p_knn = knn_log_prob(distances, match, best["k"], best["temperature"])
    adaptive = fit_adaptive_lambda(log_p_lm, log_p_knn, distances[:, 0].astype(np.float64), tune, config)

    # The served setting: the first datastore as built (manifest nprobe), at its own best (k, τ, λ).
    served, sb = variants[0], results[0]["best"]
    t0 = time.monotonic()
    xargs = {"knn": True, "knn_datastore": main, "knn_lambda": sb["lambda"], "knn_k": sb["k"], "knn_temperature": sb["temperature"]}
    log_p_served = score_with_vllm(llm, text, xargs, config.progress)
    timings["knn_pass_s"] = time.monotonic() - t0
    sd, sm = neighbours[served]
    log_p_numpy = mixture_log_prob(log_p_lm, knn_log_prob(sd, sm, sb["k"], sb["temperature"]), sb["lambda"], np.isfinite(sd[:, 0]))
    del llm
    timings["total_s"] = time.monotonic() - started

    summary = {
        "model": {"name": model_dir.name, "path": str(model_dir), "fingerprint": model_fingerprint(model_dir)},
        "text": {
            "sources": [str(p) for p in inputs], "documents": text.documents, "tokens": int(len(text.tokens)),
            "scored_tokens": int(len(text.targets)), "context_length": config.context_length, "stride": config.stride,
            "windows": int(len(text.plan.windows)), "tune_tokens": int(tune.sum()), "report_tokens": int((~tune).sum()),
            "split": f"tuning = the first {config.tune_fraction:.0%} of scored tokens (in text order), report = the rest",
        },
        "base": {"tune_ppl": perplexity(log_p_lm[tune]), "report_ppl": perplexity(log_p_lm[~tune])},
        "best": {"variant": best_v.label, "index": best_v.index, "nprobe": best_v.nprobe, "key_type": best_v.key_type, **best},
        "adaptive": {"variant": best_v.label, "k": best["k"], "temperature": best["temperature"], **adaptive},
        "served": {
            "variant": served.label, **{k: sb[k] for k in ("k", "temperature", "lambda")},
            "vllm_tune_ppl": perplexity(log_p_served[tune]), "vllm_report_ppl": perplexity(log_p_served[~tune]),
            "numpy_tune_ppl": perplexity(log_p_numpy[tune]), "numpy_report_ppl": perplexity(log_p_numpy[~tune]),
            "max_abs_logprob_diff": float(np.max(np.abs(log_p_served - log_p_numpy))),
        },
        "variants": results,
        "config": {k: list(v) if isinstance(v, tuple) else v for k, v in config.__dict__.items()},
        "timings_s": {k: round(v, 1) for k, v in timings.items()},
    }
    arrays = {"target": text.targets, "tune": tune, "log_p_lm": log_p_lm, "log_p_knnlm_vllm": log_p_served,
              "log_p_knnlm_numpy": log_p_numpy, "d_nearest": sd[:, 0]}
    return EvalRun(_plain(summary), arrays)


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


# ---------------------------------------------------------------- reports


def markdown_table(summary: dict) -> str:
    """One row per setting: base LM, each variant at its tuned best, adaptive λ, and the vLLM check."""
    rows = ["| setting | k | τ | λ | tune ppl | report ppl |", "|---|---|---|---|---|---|"]
    base = summary["base"]
    rows.append(f"| base LM (kNN off, vLLM) | | | | {base['tune_ppl']:.3f} | {base['report_ppl']:.3f} |")
    for r in summary["variants"]:
        b = r["best"]
        rows.append(f"| kNN-LM {r['label']} | {b['k']} | {b['temperature']:g} | {b['lambda']:g} | {b['tune_ppl']:.3f} | {b['report_ppl']:.3f} |")
    a = summary["adaptive"]
    rows.append(
        f"| adaptive λ on {a['variant']}: λ = {a['lambda_max']:g}·σ({a['slope']:.3g}·({a['center']:.4g} − d₁)) | {a['k']} | "
        f"{a['temperature']:g} | mean {a['mean_lambda_report']:.3f} | {a['tune_ppl']:.3f} | {a['report_ppl']:.3f} |"
    )
    s = summary["served"]
    rows.append(
        f"| served through vLLM: {s['variant']} | {s['k']} | {s['temperature']:g} | {s['lambda']:g} | "
        f"{s['vllm_tune_ppl']:.3f} | {s['vllm_report_ppl']:.3f} |"
    )
    t = summary["text"]
    return "\n".join(rows) + (
        f"\n\nText: {t['tokens']:,} tokens, {t['scored_tokens']:,} scored in {t['windows']} windows "
        f"(context {t['context_length']}, stride {t['stride']}); {t['split']}: {t['tune_tokens']:,} tune, "
        f"{t['report_tokens']:,} report. Best on the tuning part: {summary['best']['variant']}, k={summary['best']['k']}, "
        f"τ={summary['best']['temperature']:g}, λ={summary['best']['lambda']:g}. NumPy recomputation of the served "
        f"setting: report ppl {s['numpy_report_ppl']:.3f} (max |Δ log p| {s['max_abs_logprob_diff']:.2e}).\n"
    )


def write_report(run: EvalRun, out_dir: Path, per_token: bool = False) -> list[Path]:
    """results.json, results.md, the plots, and optionally tokens.npz (per-token records)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [out_dir / "results.json", out_dir / "results.md"]
    # Indented, but each innermost list of numbers on one line: the grids stay readable and small.
    text = re.sub(r"\[\s+([-+\d.,eEnul\s]+?)\s+\]", lambda m: "[" + " ".join(m.group(1).split()) + "]", json.dumps(run.summary, indent=1))
    written[0].write_text(text)
    written[1].write_text(markdown_table(run.summary))
    written += plot_results(run.summary, out_dir)
    if per_token:
        np.savez_compressed(out_dir / "tokens.npz", **run.arrays)
        written.append(out_dir / "tokens.npz")
    return written


def plot_results(summary: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = summary["variants"]
    main = variants[0]
    grid, best = main["grid"], main["best"]
    ki, ti = grid["k"].index(best["k"]), grid["temperature"].index(best["temperature"])
    li = grid["lambda"].index(best["lambda"])
    base = summary["base"]["report_ppl"]
    files = []

    def save(fig, ax, name, title, xlabel):
        ax.axhline(base, color="grey", ls="--", label="base LM")
        ax.set(title=title, xlabel=xlabel, ylabel="report perplexity")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=110)
        plt.close(fig)
        files.append(out_dir / name)

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(grid["lambda"], np.array(grid["report_ppl"], dtype=float)[ki, ti], marker="o", ms=3, label=f"{main['label']}\nk={best['k']}, τ={best['temperature']:g}")
    save(fig, ax, "ppl_vs_lambda.png", "Perplexity vs λ", "λ")

    fig, ax = plt.subplots(figsize=(6, 4))
    for a, k in enumerate(grid["k"]):
        ax.plot(grid["temperature"], np.array(grid["report_ppl"], dtype=float)[a, :, li], marker="o", ms=3, label=f"k={k}, λ={best['lambda']:g}")
    ax.set_xscale("log")
    save(fig, ax, "ppl_vs_temperature.png", "Perplexity vs τ", "τ (softmax temperature over −distance)")

    sized = [v for v in variants if v["datastore"] == main["datastore"] and v["index"] == main["index"] and v["nprobe"] == main["nprobe"]]
    if len(sized) > 1:
        sized.sort(key=lambda v: v["fraction"])
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot([v["fraction"] * v["entries"] for v in sized], [v["best"]["report_ppl"] for v in sized], marker="o", label="kNN-LM (tuned)")
        ax.set_xscale("log")
        save(fig, ax, "ppl_vs_fraction.png", "Perplexity vs datastore size (random fractions)", "datastore entries")

    fig, ax = plt.subplots(figsize=(10, 0.45 * len(variants) + 1.5))
    bars = ax.barh([v["label"] for v in variants], [v["best"]["report_ppl"] for v in variants])
    ax.bar_label(bars, fmt="%.2f", fontsize=8)
    ax.invert_yaxis()
    ax.axvline(base, color="grey", ls="--", label="base LM")
    ax.set(title="Tuned kNN-LM per datastore, index, key type, size", xlabel="report perplexity")
    ax.set_xlim(min(v["best"]["report_ppl"] for v in variants) * 0.97, base * 1.02)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "variants.png", dpi=110)
    plt.close(fig)
    files.append(out_dir / "variants.png")
    return files
