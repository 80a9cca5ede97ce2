"""Scoring a text through the serving path: vLLM with the kNN plugin, and the same keys and search offline.

`score_with_vllm` gets log p(target) from vLLM's prompt logprobs (kNN off: the base LM, with log p
of the LM's top token, the confidence adaptive retrieval skips on; kNN on: the served mixture). For sweeps, `encode_keys` computes the plugin's query vectors with the builder's
encoder over the same windows, and `find_neighbours` searches each datastore variant once.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import faiss
import numpy as np

from knnlm_core.config import EvalConfig, KeyType, KnnConfig
from knnlm_core.keys import KeyEncoder, encode_windows
from knnlm_core.manifest import Manifest, served_nprobe
from knnlm_core.search import open_shards, search_many
from knnlm_serve.eval.text import EvalError, EvalText
from knnlm_serve.runtime import DatastoreInfo, Runtime


def open_engine(model_dir: Path, datastores: list[DatastoreInfo], *, k: int, max_model_len: int, kv_cache_gib: float, seed: int = 0):
    """An offline vLLM engine serving `datastores` (the first is the default) through the kNN plugin,
    with in-process search and at most `k` neighbours a row. Fail-closed (`fail_open: false`): an
    error in kNN's path stops the evaluation instead of scoring rows from the LM alone as kNN's.

    Started as knnlm-serve starts vLLM (plugin allowlisted, our worker extension),
    then attached over vLLM's worker RPC. The environment is changed only while vLLM starts its
    processes: anything this process starts later must not inherit it."""
    from vllm import LLM

    from knnlm_serve.engine.plugin import vllm_environment
    from knnlm_serve.engine.worker_extension import ATTACH, EXTENSION

    runtime = Runtime(
        knn=KnnConfig(backend="local", k=k, max_k=k, fail_open=False),
        datastores={d.name: d for d in datastores},
        default=datastores[0].name,
    )
    environment = vllm_environment()
    saved = {name: os.environ.get(name) for name in environment}
    os.environ.update(environment)
    try:
        llm = LLM(
            model=str(model_dir),
            dtype="float32",
            enforce_eager=True,
            max_model_len=max_model_len,
            kv_cache_memory_bytes=int(kv_cache_gib * 2**30),
            worker_extension_cls=EXTENSION,
            seed=seed,
        )
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    llm.collective_rpc(ATTACH, args=(runtime.model_dump_json(),))
    return llm


def close_engine(llm) -> None:
    """Stop the engine's processes now. An engine left to the garbage collector (an error's
    traceback holds it) keeps its engine process waiting for input, and Python's exit waits for that
    process forever."""
    llm.llm_engine.engine_core.shutdown()


def score_with_vllm(llm, text: EvalText, xargs: dict, progress: bool = True, top: bool = False):
    """log p(target) [T] from vLLM's prompt logprobs, one request per window; with `top`, also log p
    of the top token at each position [T] (prompt logprobs of rank 1 come with the target's)."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=int(top), temperature=0.0, extra_args=xargs)
    windows = text.plan.windows
    prompts = [{"prompt_token_ids": text.tokens[f : k1 + 1].tolist()} for f, _, k1 in windows]
    outputs = llm.generate(prompts, params, use_tqdm=progress)
    scores, tops = [], []
    for (f, k0, k1), out in zip(windows, outputs):
        ids = text.tokens[k0 + 1 : k1 + 1]
        rows = out.prompt_logprobs[k0 + 1 - f : k1 + 1 - f]
        scores.append([row[int(t)].logprob for row, t in zip(rows, ids)])
        tops.append([max(p.logprob for p in row.values()) for row in rows])
    log_p = np.concatenate(scores).astype(np.float64)
    return (log_p, np.concatenate(tops).astype(np.float64)) if top else log_p


def encode_keys(model_dir: Path, text: EvalText, key_type: KeyType, config: EvalConfig) -> np.ndarray:
    """The plugin's query vectors [T, dim] for every scored position, from the same windows."""
    encoder = KeyEncoder(model_dir, key_type, "float32")
    keys = np.empty((len(text.targets), encoder.dim), dtype=np.float32)
    encode_windows(encoder, text.tokens, text.plan, keys, config.batch_size, progress=config.progress, desc=f"keys ({key_type})")
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
        served = served_nprobe(m)
        # The served nprobe first: variant 0 is what the vLLM engine serves; the build's is searched too.
        probes = [served, *sorted({*config.nprobes, m.index.nprobe} - {served})] if served is not None else [None]
        variants += [Variant(name, m.key_type, m.index.factory, p) for p in probes]
        if config.exact and m.index.factory != "Flat":
            if any(s.keys is None for s in m.shards):
                raise EvalError(f"--exact needs the stored keys of datastore {name!r}; rebuild it with --keep-keys")
            variants.append(Variant(name, m.key_type, "exact", None))
        if n == 0:
            variants += [Variant(name, m.key_type, m.index.factory, served, f) for f in config.fractions if f < 1]
    return variants


def full_retrieval_variant(variants: list[Variant], manifests: dict[str, Manifest]) -> Variant:
    """The first datastore as built, searched at the build's nprobe over all its entries: the full
    retrieval that its served setting (calibration's nprobe, skipped searches, pointers) is judged against."""
    main, manifest = next(iter(manifests.items()))
    return next(v for v in variants if v.datastore == main and v.index != "exact" and v.fraction == 1 and v.nprobe == manifest.index.nprobe)


def find_neighbours(root: Path, manifest: Manifest, variant: Variant, keys: np.ndarray, k: int, config: EvalConfig):
    """The merged top-k (distances, tokens, entry ids [T, k]) of every query under `variant`."""
    searchers = open_shards(root, manifest, use_gpu=None)
    rng = np.random.default_rng(config.seed)
    shards = []
    for entry, s in zip(manifest.shards, searchers):
        index = s.index
        if variant.index == "exact":
            index = faiss.IndexFlatL2(s.dim)
            index.add(np.load(root / entry.keys.path, mmap_mode="r").astype(np.float32))
        keep = s.keep
        if variant.fraction < 1:
            sample = rng.random(s.ntotal) < variant.fraction
            keep = sample if keep is None else sample & keep
        shards.append((index, s.values, keep, s.first_id))
    return search_many(shards, keys, k, variant.nprobe, progress=config.progress, desc=f"search {variant.label}")
