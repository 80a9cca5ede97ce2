"""Calibrated datastores: the build holds a slice out and fits λ, τ, k on it; the server serves them
to requests that name no knob; config overrides and request knobs still win; `calibrate` is atomic."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
from contextlib import closing

import numpy as np
import pytest
import requests
from conftest import STRICT_KNN, TINY_SERVER, prompt_logprobs

from index_builder.build import build_datastore
from index_builder.default_datastore import module_documents
from knnlm_core.calibration import cheapest_k, fit_adaptive_lambda, fit_skip, narrowest_nprobe, perplexity
from knnlm_core.config import BuildConfig, SweepGrid
from knnlm_core.datastore import read_manifest, write_manifest
from knnlm_core.errors import CorpusError
from knnlm_core.heldout import split_heldout
from knnlm_core.manifest import MANIFEST
from knnlm_core.mixture import adaptive_lambda
from knnlm_serve.server.process import RunningServer

TOKEN = "cal-token"
CONFIG = BuildConfig(index="flat", context_length=256, stride=128)
INDEXED = ("json", "argparse", "collections", "functools", "itertools", "pathlib", "dataclasses", "heapq", "statistics")
OTHER = ("bisect", "textwrap", "shlex", "csv")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("cal-corpus")
    docs = module_documents(INDEXED + OTHER)
    for name in INDEXED:
        (root / "indexed").mkdir(exist_ok=True)
        (root / "indexed" / f"{name}.txt").write_text(docs[name])
    for name in OTHER:
        (root / "other").mkdir(exist_ok=True)
        (root / "other" / f"{name}.txt").write_text(docs[name])
    return root


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def build_log():
    """What `knnlm-index build` logs, at every level (a quiet build logs its last line at DEBUG)."""
    logger, handler = logging.getLogger("index_builder"), _Lines()
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield handler.lines
    logger.removeHandler(handler)
    logger.setLevel(level)


@pytest.fixture(scope="module")
def datastores(corpus, tiny_model_dir, build_log):
    root = corpus / "datastores"
    build_datastore([corpus / "indexed"], root / "cal", tiny_model_dir, CONFIG, progress=False)
    shutil.copytree(root / "cal", root / "old")  # as built before calibration existed: no such sections
    manifest = json.loads((root / "old" / MANIFEST).read_text())
    for key in ("calibration", "calibration_note", "calibration_history", "documents", "checksum"):
        manifest.pop(key)
    (root / "old" / MANIFEST).write_text(json.dumps(manifest))
    return root


@pytest.mark.slow
def test_the_build_holds_a_slice_out_and_stores_its_fit(datastores, corpus, tiny_model_dir):
    manifest = read_manifest(datastores / "cal")
    cal = manifest.calibration
    assert cal is not None and cal.tokens >= 1000 and "whole document" in cal.heldout
    assert cal.knn_ppl < cal.base_ppl  # the docs share phrasing: kNN helps on held-out modules
    assert manifest.build.calibration_seconds > 0
    skip = cal.skip  # the skip rule for the served mixture, judged on the second half
    assert skip is not None and 0 <= skip.threshold <= 1 and skip.tolerance == 0.005
    assert (skip.skipped == 0) == (skip.threshold == 1) and skip.full_ppl == pytest.approx(min(cal.knn_ppl, cal.adaptive_ppl), rel=1e-6)
    pointers = cal.pointers  # and the pointer rule, after the skip rule
    assert pointers is not None and pointers.full_ppl == pytest.approx(skip.ppl, rel=1e-6)
    assert (pointers.min_pointers == 0) == (pointers.saved == 0) and pointers.tolerance == skip.tolerance
    assert pointers.min_pointers <= cal.k  # a step keeps k neighbours: more pointers than that never survive
    curve = cal.k_curve  # the served k is the cheapest within the tolerance of the best k
    assert curve is not None and [p.k for p in curve.ks] == sorted(p.k for p in curve.ks) and cal.k in [p.k for p in curve.ks]
    best = min(p.tune_ppl for p in curve.ks)
    assert cal.k == min(p.k for p in curve.ks if p.tune_ppl <= best * (1 + curve.tolerance))
    # Every document is stored, the held-out ones too: an entry for every position but each document's last.
    assert manifest.entries == manifest.corpus.tokens - manifest.corpus.documents
    held = manifest.calibration_documents
    assert 0 < len(held) < len(INDEXED) == manifest.corpus.documents
    assert {d.source for d in held} < {f"{name}.txt" for name in INDEXED} and all(d.tokens[0] == 0 for d in held)


@pytest.mark.slow
def test_a_build_stores_and_lists_every_document_it_was_given(datastores, build_log):
    """The held-out slice is stored: the build's last log line, the manifest and the listing name
    as many documents as the corpus holds, and a held-out document's own sentence finds its passage."""
    from knnlm_core.passages import PassageIndex
    from knnlm_core.provenance import Provenance

    manifest = read_manifest(datastores / "cal")
    provenance = Provenance.open(datastores / "cal", manifest)
    assert provenance.documents == manifest.corpus.documents == len(INDEXED)
    assert {provenance.table.describe(d)["source"] for d in range(provenance.documents)} == {f"{name}.txt" for name in INDEXED}
    (last,) = [line for line in build_log if line.startswith(f"{datastores / 'cal'}: ")]
    assert f", {len(INDEXED)} documents, " in last
    path = datastores / "cal" / manifest.passages.file.path
    with closing(sqlite3.connect(path)) as db:
        first = {
            d.document: db.execute("SELECT text FROM passages WHERE document = ? LIMIT 1", (d.document,)).fetchone()[0]
            for d in manifest.calibration_documents
        }
    passages = PassageIndex(path)
    try:
        assert {d: passages.search(text, 1)[0].document for d, text in first.items()} == {d: d for d in first}
    finally:
        passages.close()


def test_the_cheapest_k_within_the_tolerance_is_served():
    rng = np.random.default_rng(0)
    ks, temperatures, lambdas = [16, 64, 256, 1024], [1.0, 10.0], [0.0, 0.25, 0.5]
    # Perplexity over (k, τ, λ): k = 16 is 3% worse than the best (k = 1024), k = 64 0.2% worse.
    best_at_k = {16: 10.3, 64: 10.02, 256: 10.01, 1024: 10.0}
    tune = 10.0 + rng.uniform(0.5, 1.0, (4, 2, 3))
    for a, k in enumerate(ks):
        tune[a, 1, 2] = best_at_k[k]
    swept = {
        "grid": {"k": ks, "temperature": temperatures, "lambda": lambdas, "tune_ppl": tune.tolist(), "report_ppl": (tune + 1).tolist()}
    }
    assert cheapest_k(swept, 0.0)["k"] == 1024
    chosen = cheapest_k(swept, 0.0025)
    assert chosen["k"] == 64 and (chosen["temperature"], chosen["lambda"]) == (10.0, 0.5)
    assert chosen["tune_ppl"] == 10.02 and chosen["report_ppl"] == 11.02
    assert cheapest_k(swept, 0.05)["k"] == 16
    assert [p["k"] for p in chosen["curve"]] == ks and [p["tune_ppl"] for p in chosen["curve"]] == [best_at_k[k] for k in ks]


def test_nprobe_is_halved_while_the_perplexity_holds():
    def fit_at(ppl_at: dict):
        searched = []

        def fit(nprobe):
            searched.append(nprobe)
            return {
                "k_curve": {
                    "ks": [
                        {"k": 64, "tune_ppl": ppl_at[nprobe] + 0.5, "report_ppl": 0},
                        {"k": 128, "tune_ppl": ppl_at[nprobe], "report_ppl": ppl_at[nprobe] + 1},
                    ]
                }
            }, f"arrays at {nprobe}"

        return fit, searched

    # 16 and 8 lists lose under 0.25% against 32; 4 loses 5%: serve 8, and stop searching at 4.
    fit, searched = fit_at({32: 10.0, 16: 10.01, 8: 10.02, 4: 10.5, 2: 10.0})
    nprobe, (chosen, arrays), curve = narrowest_nprobe(32, 0.0025, fit)
    assert nprobe == 8 and arrays == "arrays at 8" and searched == [32, 16, 8, 4]
    assert curve == [{"nprobe": n, "tune_ppl": p, "report_ppl": p + 1} for n, p in ((32, 10.0), (16, 10.01), (8, 10.02), (4, 10.5))]
    assert narrowest_nprobe(32, 0.0, fit_at({32: 10.0, 16: 10.01})[0])[0] == 32  # no tolerance: the build's breadth
    assert narrowest_nprobe(4, 0.0025, fit_at({4: 10.0, 2: 10.0, 1: 9.99})[0])[0] == 1  # down to one list if nothing is lost


def test_the_ceiling_tolerance_trusts_a_verbatim_match_more_for_a_bounded_cost():
    rng = np.random.default_rng(0)
    n = 4000
    d = rng.uniform(5, 15, n)  # held-out text: never close to a stored key
    log_p_lm = np.log(rng.uniform(0.05, 0.5, n))
    right = rng.uniform(size=n) < np.clip((15 - d) / 10, 0, 1) * 0.6  # retrieval is right more often when closer
    log_p_knn = np.where(right, np.log(0.6), np.log(1e-3))
    tune = np.arange(n) < n // 2

    def at_zero(fit: dict) -> float:
        return float(adaptive_lambda(np.zeros(1), fit["lambda_max"], fit["slope"], fit["center"])[0])

    best = fit_adaptive_lambda(log_p_lm, log_p_knn, d, tune, SweepGrid())
    ceiling = fit_adaptive_lambda(log_p_lm, log_p_knn, d, tune, SweepGrid(ceiling_tolerance=0.005))
    assert at_zero(best) < 0.5 < at_zero(ceiling)
    assert best["tune_ppl"] <= ceiling["tune_ppl"] <= best["tune_ppl"] * 1.005


def test_the_skip_rule_skips_where_the_lm_alone_is_as_good():
    rng = np.random.default_rng(0)
    n = 4000
    top_log_p = np.log(rng.uniform(0.05, 1.0, n))
    confident = np.exp(top_log_p) > 0.6
    log_p_lm = np.where(confident, np.log(0.9), np.log(0.01))
    # kNN helps a lot where the LM is unsure and costs a little where it is confident.
    log_p_knnlm = np.where(confident, np.log(0.88), np.log(0.3))
    tune = np.arange(n) < n // 2
    fit = fit_skip(log_p_lm, log_p_knnlm, top_log_p, tune, tolerance=0.005)
    assert 0.55 <= fit["threshold"] <= 0.65
    assert fit["skipped"] == pytest.approx(np.mean(confident[~tune]), abs=0.03)
    assert fit["ppl"] < fit["full_ppl"]  # skipping where kNN hurt even helps
    served = np.where(np.exp(top_log_p) > fit["threshold"], log_p_lm, log_p_knnlm)
    assert fit["ppl"] == pytest.approx(perplexity(served[~tune]))
    # Where every skip costs more than the tolerance, nothing is skipped.
    never = fit_skip(np.full(n, np.log(0.01)), np.full(n, np.log(0.3)), top_log_p, tune, tolerance=0.005)
    assert never["threshold"] == 1.0 and never["skipped"] == 0


def test_the_split_is_stable_and_small_corpora_are_calibrated_on_nothing():
    tokens = np.arange(40_000, dtype=np.int32) % 977
    offsets = np.array([0, 10_000, 20_000, 30_000, 40_000])
    a, b = split_heldout(tokens, offsets), split_heldout(tokens, offsets)
    assert np.array_equal(a.tokens, b.tokens) and a.spans == b.spans and sum(e - s for _, s, e in a.spans) == len(a.tokens)
    one_doc = split_heldout(tokens, np.array([0, 40_000]))
    assert "last 4000 tokens" in one_doc.description and np.array_equal(one_doc.tokens, tokens[-4000:])
    assert split_heldout(tokens[:5000], np.array([0, 5000])) is None


def test_a_small_corpus_says_it_was_calibrated_on_nothing(tmp_path, tiny_model_dir):
    (tmp_path / "t.txt").write_text("A short text that cannot spare a held-out slice. " * 20)
    manifest = build_datastore([tmp_path / "t.txt"], tmp_path / "ds", tiny_model_dir, CONFIG, progress=False)
    assert manifest.calibration is None and "calibrated on nothing" in manifest.calibration_note


@pytest.fixture(scope="module")
def server(datastores, tiny_model_dir):
    cal = read_manifest(datastores / "cal").calibration
    # "explicit": the same files, the calibration's values written as config overrides.
    explicit = {"k": cal.k, "temperature": cal.temperature, "skip_threshold": cal.skip.threshold, "min_pointers": cal.pointers.min_pointers}
    adaptive = {}
    if cal.mode == "fixed":
        explicit["lambda"] = cal.lambda_
    else:
        adaptive = {"explicit": cal.adaptive_lambda.model_dump()}
    knn = {
        "datastores": {n: str(datastores / p) for n, p in (("cal", "cal"), ("old", "old"), ("explicit", "cal"), ("override", "cal"))},
        "backend": "local",
        "lambda": 0.3,
        "k": 16,
        "temperature": 3.0,
        "max_k": 1024,
        "adaptive_lambda": adaptive,
        "overrides": {"explicit": explicit, "override": {"lambda": 0.9, "k": 4, "temperature": 0.5}},
        "admin_token": TOKEN,
        "datastore_root": str(datastores),
        **STRICT_KNN,
    }
    with RunningServer({**TINY_SERVER, "model": str(tiny_model_dir), "knn": knn}, datastores) as server:
        yield server


@pytest.fixture(scope="module")
def prompt(corpus, tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)((corpus / "other" / "textwrap.txt").read_text()[:1500]).input_ids


def listing(server) -> dict:
    response = requests.get(f"{server.base_url}/v1/knn/datastores", headers={"X-Admin-Token": TOKEN}, timeout=60)
    assert response.status_code == 200, response.text
    return {d["name"]: d for d in response.json()["datastores"] if d["status"] == "serving"}


@pytest.mark.slow
def test_a_request_with_no_knobs_gets_the_calibration(server, prompt, datastores):
    cal = read_manifest(datastores / "cal").calibration
    served = prompt_logprobs(server, prompt, knn_datastore="cal")
    np.testing.assert_allclose(served, prompt_logprobs(server, prompt, knn_datastore="explicit"), atol=1e-5)
    if cal.mode == "fixed":
        explicit = prompt_logprobs(
            server, prompt, knn_datastore="cal", knn_lambda=cal.lambda_, knn_k=cal.k, knn_temperature=cal.temperature
        )
        np.testing.assert_allclose(served, explicit, atol=1e-5)
    defaults = listing(server)["cal"]["defaults"]
    assert defaults["k"] == cal.k and defaults["temperature"] == cal.temperature
    assert set(defaults["source"].values()) == {"calibration"}


@pytest.mark.slow
def test_config_overrides_then_request_knobs_win(server, prompt):
    overridden = prompt_logprobs(server, prompt, knn_datastore="override")
    as_request = prompt_logprobs(server, prompt, knn_datastore="cal", knn_lambda=0.9, knn_k=4, knn_temperature=0.5)
    np.testing.assert_allclose(overridden, as_request, atol=1e-5)
    request_wins = prompt_logprobs(server, prompt, knn_datastore="override", knn_k=8)
    np.testing.assert_allclose(
        request_wins, prompt_logprobs(server, prompt, knn_datastore="cal", knn_lambda=0.9, knn_k=8, knn_temperature=0.5), atol=1e-5
    )
    assert not np.allclose(request_wins, overridden)
    source = listing(server)["override"]["defaults"]["source"]
    assert source == {
        "lambda": "config override",
        "k": "config override",
        "temperature": "config override",
        "skip_threshold": "calibration",
        "min_pointers": "calibration",
    }


@pytest.mark.slow
def test_a_datastore_built_before_calibration_serves_the_config_defaults(server, prompt):
    np.testing.assert_allclose(
        prompt_logprobs(server, prompt, knn_datastore="old"),
        prompt_logprobs(server, prompt, knn_datastore="old", knn_lambda=0.3, knn_k=16, knn_temperature=3.0),
        atol=1e-5,
    )
    assert set(listing(server)["old"]["defaults"]["source"].values()) == {"config default"}


@pytest.mark.slow
def test_calibrate_replaces_the_manifest_atomically_and_a_hot_swap_serves_it(server, datastores, corpus, tiny_model_dir):
    shutil.copytree(datastores / "cal", datastores / "recal")
    before = (datastores / "recal" / MANIFEST).read_bytes()
    command = [
        sys.executable,
        "-m",
        "index_builder.cli",
        "calibrate",
        str(datastores / "recal"),
        str(corpus / "other"),
        "--model",
        str(tiny_model_dir),
    ]
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, start_new_session=True)
    seen = ""
    while "calibrate:" not in seen and proc.poll() is None:  # the progress bar of the scoring pass
        seen += proc.stderr.read(1)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert (datastores / "recal" / MANIFEST).read_bytes() == before  # killed mid-run: the old manifest, intact
    read_manifest(datastores / "recal")

    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    manifest = read_manifest(datastores / "recal")
    assert manifest.calibration.heldout.startswith("texts:") and len(manifest.calibration_history) == 1
    assert manifest.calibration_history[0] == read_manifest(datastores / "cal").calibration
    assert [s.model_dump() for s in manifest.shards] == [s.model_dump() for s in read_manifest(datastores / "cal").shards]

    loaded = requests.post(
        f"{server.base_url}/v1/knn/datastores", json={"name": "cal", "path": "recal"}, headers={"X-Admin-Token": TOKEN}, timeout=120
    )
    assert loaded.status_code == 200, loaded.text
    now = listing(server)["cal"]
    assert now["version"] == 2 and now["calibration"]["heldout"].startswith("texts:")
    assert now["defaults"]["k"] == manifest.calibration.k and now["defaults"]["temperature"] == manifest.calibration.temperature


@pytest.mark.slow
def test_calibrate_without_text_refits_the_slice_the_build_held_out(datastores, corpus, tiny_model_dir):
    from index_builder.calibrate import recalibrate

    shutil.copytree(datastores / "cal", datastores / "refit")
    built = read_manifest(datastores / "cal").calibration
    # Its gate as a build fitted it before phrase relevance: the refit fits the gate a build fits now.
    manifest = read_manifest(datastores / "refit")
    legacy = {"relevance": "bm25_per_word", "gate": 1.1, "gate_heldout_pass": 0.01, "gate_stored_pass": 0.9}
    old = manifest.passages.model_copy(update=legacy | {"gate_questions": None, "gate_offtopic_pass": None, "gate_answerable_pass": None})
    write_manifest(datastores / "refit", manifest.model_copy(update={"passages": old}))
    refit = recalibrate(datastores / "refit", [], tiny_model_dir, CONFIG, progress=False)
    new = refit.calibration
    assert new.heldout == built.heldout and refit.calibration_history == [built]  # same slice, old fit kept
    assert (new.lambda_, new.k, new.temperature, new.mode) == (built.lambda_, built.k, built.temperature, built.mode)
    assert new.skip.threshold == pytest.approx(built.skip.threshold) and new.knn_ppl == pytest.approx(built.knn_ppl, rel=1e-4)
    assert refit.passages.relevance == "phrase" and refit.passages == read_manifest(datastores / "cal").passages  # the gate too
    looser = recalibrate(datastores / "refit", [], tiny_model_dir, CONFIG.model_copy(update={"skip_tolerance": 0.05}), progress=False)
    assert looser.calibration.skip.tolerance == 0.05 and looser.calibration.skip.threshold <= built.skip.threshold  # skips more

    # A corpus that changed since the build would give another slice: refused, manifest untouched.
    changed = corpus / "changed"
    shutil.copytree(corpus / "indexed", changed)
    (changed / "json.txt").write_text((changed / "json.txt").read_text() + "\n\nOne more paragraph about JSON.")
    manifest = read_manifest(datastores / "refit")
    moved = manifest.corpus.model_copy(
        update={"sources": [s.replace(str(corpus / "indexed"), str(changed)) for s in manifest.corpus.sources]}
    )
    write_manifest(datastores / "refit", manifest.model_copy(update={"corpus": moved}))
    before = (datastores / "refit" / MANIFEST).read_bytes()
    with pytest.raises(CorpusError, match="changed since the build.*knnlm-index calibrate DATASTORE TEXT"):
        recalibrate(datastores / "refit", [], tiny_model_dir, CONFIG, progress=False)
    assert (datastores / "refit" / MANIFEST).read_bytes() == before
