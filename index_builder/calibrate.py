"""Calibration: score held-out text with the base LM and through the datastore's own search, fit
λ, τ, k, the adaptive-λ curve and the skip rule, and store them in the manifest as the served defaults.

`knnlm-index build` calibrates on the slice it held out of the corpus (knnlm_core.calibration
.split_heldout); `knnlm-index calibrate` on the user's own text, or again on the build's slice
(re-derived from the corpus the manifest names, e.g. after an upgrade that fits more), keeping the
old calibration in the manifest's history, and fits the passage gate again on the same text
(index_builder/passages.py). Either way the search is the one the server runs: the
index as built, at an nprobe halved from the build's while the perplexity holds (the served
nprobe). The shards are never touched; the manifest is replaced atomically.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from index_builder.passages import refitted_gate
from index_builder.versions import one_writer
from knnlm_core.calibration import (
    fit_calibration,
    fit_pointers,
    fitting_half,
    narrowest_nprobe,
    perplexity,
    pointer_curve,
    served_log_prob,
    served_with_skips,
)
from knnlm_core.config import BuildConfig, SweepGrid
from knnlm_core.corpus import find_files, tokenize_files
from knnlm_core.datastore import check_compatible, load_document_starts, read_manifest, write_manifest
from knnlm_core.errors import CorpusError
from knnlm_core.heldout import MIN_HELDOUT_TOKENS, heldout_entries, split_heldout
from knnlm_core.keys import KeyEncoder, encode_windows
from knnlm_core.manifest import Calibration, Manifest
from knnlm_core.model_dir import model_fingerprint
from knnlm_core.pointers import consecutive, shard_lookup
from knnlm_core.provenance import DocumentTable, served_documents
from knnlm_core.search import open_shards, search_many
from knnlm_core.windows import plan_windows, window_values

logger = logging.getLogger("index_builder")


def calibrate_on(
    root: Path,
    manifest: Manifest,
    model_dir: Path,
    tokens: np.ndarray,
    offsets: np.ndarray,
    heldout: str,
    config: BuildConfig,
    progress: bool,
    excluded: Sequence[tuple[int, int]] = (),
) -> Calibration:
    """The calibration fitted on (tokens, offsets), searching the datastore without the `excluded`
    entry ranges (the held-out text's own entries, where the datastore stores it)."""
    plan = plan_windows(offsets, config.context_length, config.stride)
    encoder = KeyEncoder(model_dir, manifest.key_type, config.dtype)
    keys = np.empty((plan.entries, encoder.dim), dtype=np.float32)
    log_p_lm = np.empty(plan.entries, dtype=np.float64)
    top_log_p = np.empty(plan.entries, dtype=np.float64)
    encode_windows(
        encoder, tokens, plan, keys, config.batch_size, log_p_out=log_p_lm, top_log_p_out=top_log_p, progress=progress, desc="calibrate"
    )
    del encoder
    targets = window_values(tokens, plan)
    searchers = open_shards(root, manifest, excluded=excluded)
    shards = [(s.index, s.values, s.keep, s.first_id) for s in searchers]
    grid = SweepGrid(skip_tolerance=config.skip_tolerance, k_tolerance=config.k_tolerance, ceiling_tolerance=config.ceiling_tolerance)

    def fit_at(nprobe: int | None) -> tuple[dict, np.ndarray, np.ndarray]:
        distances, found, ids = search_many(shards, keys, max(grid.ks), nprobe, progress=progress, desc=f"search nprobe={nprobe}")
        return fit_calibration(log_p_lm, top_log_p, distances, found == targets[:, None], grid), distances, ids

    nprobe, nprobe_curve = manifest.index.nprobe, None
    if nprobe is None:  # not IVF: one search breadth
        fit, distances, ids = fit_at(None)
    else:
        nprobe, (fit, distances, ids), points = narrowest_nprobe(nprobe, config.nprobe_tolerance, fit_at)
        nprobe_curve = {"tolerance": config.nprobe_tolerance, "nprobes": points}
        logger.info("nprobe %d of the build's %d: %s", nprobe, manifest.index.nprobe, points)
    starts = load_document_starts(root, manifest)
    if starts is not None:
        positions = np.concatenate([np.arange(k0, k1) for _, k0, k1 in plan.windows])
        fit["pointers"] = _fit_pointers(
            searchers, starts, keys, ids, distances, targets, consecutive(positions), log_p_lm, top_log_p, fit, config.skip_tolerance
        )
    calibration = Calibration(
        **fit,
        heldout=heldout,
        nprobe=nprobe,
        nprobe_curve=nprobe_curve,
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
    )
    logger.info(
        "calibration on %s held-out tokens: λ %.2f, τ %g, k %d, serving %s λ; ppl base %.3f -> kNN %.3f (adaptive %.3f); "
        "searches skipped where the LM's top probability > %.3f: %.0f%% of tokens, ppl %.3f",
        f"{fit['tokens']:,}",
        calibration.lambda_,
        calibration.temperature,
        calibration.k,
        calibration.mode,
        calibration.base_ppl,
        calibration.knn_ppl,
        calibration.adaptive_ppl,
        calibration.skip.threshold,
        100 * calibration.skip.skipped,
        calibration.skip.ppl,
    )
    if calibration.pointers is not None:
        logger.info(
            "pointer following from %d surviving pointers: %.0f%% of tokens without a search, ppl %.3f (%.3f searching)",
            calibration.pointers.min_pointers,
            100 * calibration.pointers.saved,
            calibration.pointers.ppl,
            calibration.pointers.full_ppl,
        )
    return calibration


def _fit_pointers(searchers, starts, keys, ids, distances, targets, continues, log_p_lm, top_log_p, fit: dict, tolerance: float) -> dict:
    """Replay pointer following over the held-out text with the fitted mixture and skip rule, for
    each minimum of surviving pointers, and keep the one that saves most within the tolerance."""
    values = np.concatenate([np.asarray(s.values) for s in searchers])
    tune = fitting_half(len(targets))
    threshold = fit["skip"]["threshold"]
    skipped = np.exp(top_log_p) > threshold
    lookup = shard_lookup(searchers, keys, distances.shape[1])

    def served(d: np.ndarray, i: np.ndarray) -> np.ndarray:
        match = (i >= 0) & (values[np.maximum(i, 0)] == targets[:, None])
        return served_with_skips(log_p_lm, served_log_prob(log_p_lm, d, match, fit), top_log_p, threshold)

    reference = served(distances, ids)
    k = fit["k"]  # the server keeps the served k neighbours a step: only their successors are candidates
    curve = pointer_curve(ids[:, :k], distances[:, :k], targets, continues, values, lookup, starts, served, tune, skipped)
    return fit_pointers(curve, perplexity(reference[tune]), perplexity(reference[~tune]), tolerance)


def build_heldout(root: Path, manifest: Manifest, model_dir: Path, config: BuildConfig) -> tuple[np.ndarray, np.ndarray, str]:
    """The slice the build held out, re-derived from the corpus files the manifest names: the same
    tokens give the same split. Refused when the files are gone or changed since the build."""
    again = "pass held-out text of the datastore's domain instead: knnlm-index calibrate DATASTORE TEXT..."
    missing = [s for s in manifest.corpus.sources if not Path(s).exists()]
    if missing:
        raise CorpusError(f"datastore {root}: its corpus file {missing[0]} is gone; {again}")
    files = [Path(s) for s in manifest.corpus.sources]
    tokens, offsets = tokenize_files(files, model_dir, text_field=config.text_field, on_bad_utf8=config.on_bad_utf8)
    if len(tokens) != manifest.corpus.tokens:
        raise CorpusError(
            f"datastore {root}: its corpus now has {len(tokens):,} tokens, the build had {manifest.corpus.tokens:,}: "
            f"the files changed since the build; {again}"
        )
    heldout = split_heldout(tokens, offsets)
    if heldout is None:
        raise CorpusError(f"datastore {root}: its corpus is too small to hold out a calibration slice; {again}")
    return heldout.tokens, heldout.offsets, f"build: {heldout.description}"


def stored_slice(root: Path, manifest: Manifest) -> list[tuple[int, int, int]]:
    """The (document, first token, end token) spans of the held-out text the datastore stores, in
    its numbering now (found by the text's sha256, which survives compactions; a forgotten
    document is gone)."""
    if not manifest.calibration_documents:
        return []
    number = served_documents(DocumentTable.read(root / manifest.provenance.path), manifest)
    return [(number[d.sha256], *d.tokens) for d in manifest.calibration_documents if d.sha256 in number]


@one_writer("datastore")
def recalibrate(datastore: str | Path, texts: list[str | Path], model_dir: Path, config: BuildConfig, progress: bool = True) -> Manifest:
    """`knnlm-index calibrate`: calibrate an existing datastore on held-out text of the user's, or
    (no texts) again on the slice its build held out."""
    root = Path(datastore)
    manifest = read_manifest(root)
    check_compatible(manifest, fingerprint=model_fingerprint(model_dir), where=f"datastore {root}")
    if texts:
        tokens, offsets = tokenize_files(find_files(texts), model_dir, text_field=config.text_field, on_bad_utf8=config.on_bad_utf8)
        heldout = f"texts: {', '.join(map(str, texts))}"
        if len(tokens) - (len(offsets) - 1) < MIN_HELDOUT_TOKENS:
            raise CorpusError(
                f"the calibration text ({', '.join(map(str, texts))}) has {len(tokens)} tokens; calibrating needs at least "
                f"{MIN_HELDOUT_TOKENS} scored tokens of held-out text from the datastore's domain"
            )
        spans = []
    else:
        tokens, offsets, heldout = build_heldout(root, manifest, model_dir, config)
        spans = stored_slice(root, manifest)
    excluded = heldout_entries(load_document_starts(root, manifest), spans) if spans else []
    calibration = calibrate_on(root, manifest, model_dir, tokens, offsets, heldout, config, progress, excluded)
    history = [*manifest.calibration_history, *([manifest.calibration] if manifest.calibration else [])]
    passages = manifest.passages
    if passages is not None:
        from transformers import AutoTokenizer

        passages = refitted_gate(root, passages, tokens, offsets, AutoTokenizer.from_pretrained(model_dir), spans)
    updated = manifest.model_copy(
        update={"calibration": calibration, "calibration_note": None, "calibration_history": history, "passages": passages}
    )
    write_manifest(root, updated)
    return updated
