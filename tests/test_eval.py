"""knnlm-eval on the tiny model: its perplexities are the right numbers, and bad input is refused."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import make_tiny_llama

from index_builder.build import build_datastore
from knnlm_core.config import BuildConfig, EvalConfig
from knnlm_core.datastore import read_manifest
from knnlm_core.keys import KeyEncoder
from knnlm_core.manifest import Calibration
from knnlm_core.search import merge_topk, open_shards
from knnlm_serve.eval.cli import main as eval_main
from knnlm_serve.eval.report import write_report
from knnlm_serve.eval.run import evaluate
from knnlm_serve.eval.score import Variant, full_retrieval_variant, plan_variants
from knnlm_serve.eval.text import load_eval_text

CONFIG = EvalConfig(
    context_length=128,
    stride=64,
    ks=(4, 16),
    temperatures=(1.0, 10.0),
    lambdas=(0.0, 0.25, 0.5, 0.9),
    fractions=(0.5,),
    exact=True,
    kv_cache_gib=0.25,
    progress=False,
)


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    """A datastore text, and an eval text that repeats part of it (so retrieval helps) plus new text."""
    import heapq

    work = tmp_path_factory.mktemp("eval-texts")
    (work / "store.txt").write_text(inspect.getdoc(json) + "\n\n" + inspect.getdoc(heapq))
    (work / "heldout.txt").write_text(inspect.getdoc(heapq)[:1500] + "\n\n" + inspect.getdoc(inspect)[:1500])
    return work


@pytest.fixture(scope="module")
def datastores(texts, tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("eval-datastores")
    build = BuildConfig(context_length=128, stride=64, keep_keys=True)
    build_datastore([texts / "store.txt"], out / "flat", tiny_model_dir, build.model_copy(update={"index": "flat"}), progress=False)
    build_datastore([texts / "store.txt"], out / "ivf", tiny_model_dir, build.model_copy(update={"index": "IVF4,PQ8"}), progress=False)
    return {"flat": out / "flat", "ivf": out / "ivf"}


@pytest.fixture(scope="module")
def run(texts, datastores, tiny_model_dir):
    return evaluate([texts / "heldout.txt"], datastores, tiny_model_dir, CONFIG)


@pytest.mark.slow
def test_base_perplexity_equals_transformers(run, texts, tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    text = load_eval_text([texts / "heldout.txt"], tiny_model_dir, CONFIG)
    log_probs, top_log_probs = [], []
    with torch.no_grad():
        for f, k0, k1 in text.plan.windows:
            ids = torch.from_numpy(text.tokens[f : k1 + 1].astype(np.int64))[None]
            logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
            rows = torch.arange(k0 - f, k1 - f)
            log_probs.append(logp[rows, ids[0, rows + 1]].numpy())
            top_log_probs.append(logp[rows].max(dim=1).values.numpy())
    nll = -np.concatenate(log_probs).astype(np.float64)
    np.testing.assert_allclose(run.arrays["log_p_lm"], -nll, atol=1e-3)
    np.testing.assert_allclose(run.arrays["top_log_p_lm"], np.concatenate(top_log_probs), atol=1e-3)
    tune = run.arrays["tune"]
    np.testing.assert_allclose(run.summary["base"]["report_ppl"], np.exp(nll[~tune].mean()), rtol=1e-3)
    np.testing.assert_allclose(run.summary["base"]["tune_ppl"], np.exp(nll[tune].mean()), rtol=1e-3)


@pytest.mark.slow
def test_knn_perplexity_through_vllm_equals_numpy_from_the_same_neighbours(run, texts, datastores, tiny_model_dir):
    served = run.summary["served"]
    k, tau, lam = served["k"], served["temperature"], served["lambda"]
    assert lam > 0 and served["variant"].startswith("flat")
    text = load_eval_text([texts / "heldout.txt"], tiny_model_dir, CONFIG)
    # The plugin's queries (ffn_input of the same windows), searched directly in the datastore's shards.
    encoder = KeyEncoder(tiny_model_dir, "ffn_input", "float32")
    keys = np.concatenate(
        [
            v[k0 - f : k1 - f]
            for (f, k0, k1), v in zip(text.plan.windows, encoder.encode([text.tokens[f:k1] for f, _, k1 in text.plan.windows]))
        ]
    )
    root = datastores["flat"]
    distances, tokens, _ = merge_topk([s.search(keys, k, None) for s in open_shards(root, read_manifest(root))], k)
    weights = np.exp(-(distances - distances[:, :1]) / tau)
    p_knn = (weights * (tokens == text.targets[:, None])).sum(1) / weights.sum(1)
    p = lam * p_knn + (1 - lam) * np.exp(run.arrays["log_p_lm"])
    # Searches skipped where the LM's top probability exceeds the fitted threshold: those tokens get p_LM.
    p = np.where(np.exp(run.arrays["top_log_p_lm"]) > served["skip_threshold"], np.exp(run.arrays["log_p_lm"]), p)
    tune = text.tune
    np.testing.assert_allclose(served["vllm_report_ppl"], np.exp(-np.log(p[~tune]).mean()), rtol=1e-3)
    np.testing.assert_allclose(served["vllm_tune_ppl"], np.exp(-np.log(p[tune]).mean()), rtol=1e-3)
    np.testing.assert_allclose(run.arrays["log_p_knnlm_vllm"], np.log(p), atol=1e-3)
    # Retrieval from a store holding half the held-out text helps a random model a lot.
    assert served["vllm_report_ppl"] < 0.5 * run.summary["base"]["report_ppl"]


@pytest.mark.slow
def test_sweep_tunes_on_the_tuning_part_only_and_writes_the_report(run, tmp_path):
    for variant in run.summary["variants"]:
        grid, best = variant["grid"], variant["best"]
        tune_ppl = np.array(grid["tune_ppl"], dtype=float)
        assert best["tune_ppl"] == pytest.approx(np.nanmin(tune_ppl), rel=1e-4)
        a, b, c = grid["k"].index(best["k"]), grid["temperature"].index(best["temperature"]), grid["lambda"].index(best["lambda"])
        assert best["report_ppl"] == pytest.approx(grid["report_ppl"][a][b][c], rel=1e-4)
    labels = [v["label"] for v in run.summary["variants"]]
    assert any("exact" in x for x in labels) and any("50%" in x for x in labels) and any("IVF4,PQ8" in x for x in labels)
    exact = next(v for v in run.summary["variants"] if v["index"] == "exact")
    flat = run.summary["variants"][0]
    assert exact["best"]["report_ppl"] == pytest.approx(flat["best"]["report_ppl"], rel=1e-3)  # same keys, exact search
    adaptive = run.summary["adaptive"]
    assert adaptive["lambda_max"] in CONFIG.lambdas and np.isfinite(adaptive["report_ppl"])
    written = write_report(run, tmp_path, per_token=True)
    assert {p.name for p in written} >= {
        "results.json",
        "results.md",
        "ppl_vs_lambda.png",
        "ppl_vs_temperature.png",
        "ppl_vs_fraction.png",
        "variants.png",
        "ppl_vs_searches_saved.png",
        "tokens.npz",
    }
    pointers = run.summary["pointers"]["curve"]  # the store holds half the text: pointers survive there
    saved = [c["report_saved"] for c in pointers]
    assert saved == sorted(saved, reverse=True) and saved[0] > 0.2
    assert all(np.isfinite(c["report_ppl"]) for c in pointers)
    skip = run.summary["adaptive_retrieval"]
    assert skip["curve"][0]["report_skipped"] == 0 and skip["curve"][-1]["tune_skipped"] >= 0.9
    assert skip["ppl"] == pytest.approx(next(c["report_ppl"] for c in skip["curve"] if c["threshold"] == skip["threshold"]))
    assert json.loads((tmp_path / "results.json").read_text())["text"]["report_tokens"] == int((~run.arrays["tune"]).sum())
    assert "served through vLLM" in (tmp_path / "results.md").read_text()


@pytest.mark.slow
def test_the_served_setting_is_judged_against_every_row_searched_at_the_build_nprobe(run, datastores):
    # The eval's own run: its first datastore is flat, so full retrieval is the served search itself.
    served_defaults = run.summary["served_defaults"]
    full = served_defaults["full_retrieval"]
    assert full["nprobe"] is None and full["report_ppl"] == pytest.approx(served_defaults["report_ppl_every_search"], rel=1e-9)
    assert full["gap_pct"] == pytest.approx(100 * (served_defaults["report_ppl"] / full["report_ppl"] - 1))
    # An IVF store whose calibration serves fewer lists than its build searched: variant 0 is the
    # served nprobe, full retrieval the build's.
    ivf = read_manifest(datastores["ivf"])  # too small a corpus to calibrate: give it a calibrated nprobe
    ivf = ivf.model_copy(update={"index": ivf.index.model_copy(update={"nprobe": 4}), "calibration": Calibration.model_construct(nprobe=2)})
    variants = plan_variants({"ivf": ivf}, CONFIG)
    assert variants[0].nprobe == 2 and full_retrieval_variant(variants, {"ivf": ivf}) == Variant("ivf", ivf.key_type, ivf.index.factory, 4)


def eval_error(*argv) -> str:
    with pytest.raises(SystemExit) as e:
        eval_main([str(a) for a in argv])
    assert isinstance(e.value.code, str) and e.value.code.startswith("knnlm-eval: error: "), e.value.code
    assert "\n" not in e.value.code
    return e.value.code


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--lambdas", "0.5", "2"], "--lambdas 2.0: Input should be less than or equal to 1"),
        (["--temperatures", "0"], "--temperatures 0.0: Input should be greater than 0"),
        (["--ks", "64", "0"], "--ks 0: Input should be greater than or equal to 1"),
        (["--fractions", "1.5"], "--fractions 1.5: Input should be less than or equal to 1"),
        (["--nprobe", "0"], "--nprobe 0: Input should be greater than or equal to 1"),
        (["--tune-fraction", "1"], "--tune-fraction 1.0: Input should be less than 1"),
    ],
    ids=["lambda", "temperature", "k", "fraction", "nprobe", "tune-fraction"],
)
def test_a_bad_flag_value_is_refused_naming_the_flag_and_the_value(flags, message, tmp_path):
    """Before any text or model is read."""
    assert eval_error(tmp_path / "held-out.txt", "--datastore", f"d={tmp_path}", *flags) == f"knnlm-eval: error: {message}"


def test_empty_text_is_refused(datastores, tiny_model_dir, tmp_path):
    (tmp_path / "empty.txt").write_text("  \n\n")
    assert "is empty" in eval_error(tmp_path / "empty.txt", "--datastore", f"d={datastores['flat']}", "--model", tiny_model_dir)
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9 au lait")
    message = eval_error(tmp_path / "latin1.txt", "--datastore", f"d={datastores['flat']}", "--model", tiny_model_dir)
    assert message.endswith("is empty: " + str(tmp_path / "latin1.txt") + ": not UTF-8, so skipped (save it as UTF-8)"), message


def test_text_shorter_than_one_window_is_refused(datastores, tiny_model_dir, tmp_path):
    (tmp_path / "short.txt").write_text("A short note of a few words.")
    message = eval_error(tmp_path / "short.txt", "--datastore", f"d={datastores['flat']}", "--model", tiny_model_dir)
    assert "fewer than one window" in message and "--context-length 512" in message


def test_datastore_for_another_model_is_refused_with_exit_code_1(datastores, texts, tiny_model_dir, tmp_path):
    other = make_tiny_llama(tmp_path / "other-model", tiny_model_dir, seed=1)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "knnlm_serve.eval.cli",
            str(texts / "heldout.txt"),
            "--datastore",
            f"d={datastores['flat']}",
            "--model",
            str(other),
            "--context-length",
            "128",
            "--stride",
            "64",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("knnlm-eval: error: datastore 'd'") and "was built for model" in last


@pytest.mark.slow
def test_evaluation_leaves_no_plugin_switch_in_the_environment(run):
    """Processes started after an evaluation (a plain server, say) must not inherit its kNN switch."""
    import os

    assert "knnlm" not in os.environ.get("VLLM_PLUGINS", "").split(",")


@pytest.mark.slow
def test_a_knn_error_stops_the_evaluation_instead_of_scoring_the_lm_alone(texts, datastores, tiny_model_dir, tmp_path, monkeypatch):
    """A datastore file replaced after the checks and the sweep, before the engine's kNN pass: a
    server answers from the LM alone (fail-open), while an evaluation must stop with the error,
    and stop its engine with it (left running, the engine's process keeps Python from exiting)."""
    import shutil

    import psutil

    from knnlm_serve.eval import run as evaluation

    shutil.copytree(datastores["flat"], tmp_path / "flat")
    fitted = evaluation.fit_skip

    def fit_then_replace(*args, **kwargs):
        for index in (tmp_path / "flat").glob("shard-*/index.faiss"):
            index.write_bytes(b"replaced")
        return fitted(*args, **kwargs)

    monkeypatch.setattr(evaluation, "fit_skip", fit_then_replace)
    with pytest.raises(Exception):  # noqa: B017, PT011 - vLLM reports the engine's failure in its own types
        evaluate([texts / "heldout.txt"], {"flat": tmp_path / "flat"}, tiny_model_dir, CONFIG)
    # Its own children only: the suite's background soak runs a server's engine further down this tree.
    engines = [p for p in psutil.Process().children() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not [p for p in engines if "EngineCore" in p.name()], engines
