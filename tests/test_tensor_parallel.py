"""Tensor parallelism, run: the tiny model split over two CPU ranks (one core each) serves with
kNN exactly what one rank serves: the same greedy tokens and logprobs, one search a step, faults
failing open on both ranks alike, a hot-swap served by both, drafts included (real servers)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import requests
from conftest import STRICT_KNN, TINY_SERVER, continuations, greedy
from datastore_edits import save
from local_server import folder_below_root, serving

from index_builder.build import build_datastore
from knnlm_core.config import BuildConfig
from knnlm_serve.server.process import RunningServer, scrape_metrics

pytestmark = pytest.mark.slow

PREFIX = "The ferryman of the northern crossing wrote in his ledger that on the longest night"
TEXTS = {
    "a": f"{PREFIX} the river froze from bank to bank and the lanterns burned until the morning bell.",
    "b": f"{PREFIX} a grey heron stood on the jetty and would not move for the passengers or the dog.",
}
TOKEN = "tp-admin"
LENGTH = 10


@pytest.fixture(scope="module")
def root(local_server, tiny_model_dir):
    """The datastores, below the shared local server's root: it serves `a` as one rank does."""
    root = folder_below_root(local_server, "tensor-parallel")
    config = BuildConfig(index="flat", context_length=128, stride=64)
    for name, text in TEXTS.items():
        (root / f"{name}.txt").write_text(text)
        build_datastore([root / f"{name}.txt"], root / name, tiny_model_dir, config, progress=False)
    shutil.copytree(root / "a", root / "broken")  # its documents.npy is broken once loaded: pointer following fails
    return root


def knn(root, **settings) -> dict:
    return {
        "datastores": {"a": str(root / "a"), "broken": str(root / "broken")},
        "default_datastore": "a",
        "k": 8,
        "lambda": 1.0,
        "admin_token": TOKEN,
        "datastore_root": str(root),
        **STRICT_KNN,
        **settings,
    }


@pytest.fixture(scope="module")
def servers(local_server, tiny_model_dir, root):
    """(one rank: the shared local server serving `a` at λ 1 and k 8, two ranks with datastore
    drafts and fail-open)."""
    two = {**TINY_SERVER, "model": str(tiny_model_dir), "tensor_parallel_size": 2, "knn": knn(root, draft_tokens=3, fail_open=True)}
    (root / "tp2").mkdir()
    with serving(local_server, {"tp-a": root / "a"}, default="tp-a"), RunningServer(two, root / "tp2") as server:
        yield local_server, server


@pytest.fixture(scope="module")
def ids(tiny_model_dir):
    return continuations(tiny_model_dir, PREFIX, TEXTS, LENGTH)


def same(a, b) -> None:
    assert a.token_ids == b.token_ids
    np.testing.assert_allclose(a.logprobs.token_logprobs, b.logprobs.token_logprobs, atol=1e-4)  # TP sums in another order


def test_two_ranks_serve_what_one_rank_serves_with_knn_on_and_off(servers, ids):
    one, two = servers
    knn_on = greedy(one, ids["prompt"], LENGTH, knn_drafts=False)
    assert knn_on.token_ids == ids["a"]  # kNN changes the continuation: the stored one
    same(greedy(two, ids["prompt"], LENGTH, knn_drafts=False), knn_on)
    same(greedy(two, ids["prompt"], LENGTH, knn=False), greedy(one, ids["prompt"], LENGTH, knn=False))
    same(greedy(two, ids["prompt"], LENGTH), knn_on)  # drafted from the datastore: the same output


def test_two_ranks_search_once_a_step_and_both_mix(servers, ids):
    _, two = servers
    before = scrape_metrics(two.base_url)
    greedy(two, ids["prompt"], LENGTH, knn_drafts=False)
    after = scrape_metrics(two.base_url)
    delta = lambda name: after.get(name, 0) - before.get(name, 0)  # noqa: E731
    assert delta('knnlm_retrieval_steps_total{datastore="a"}') == LENGTH  # rank 0 searched, once a step
    assert delta("knnlm_step_seconds_count") == 2 * LENGTH  # both ranks mixed every step


def test_a_fault_in_rank_zeros_search_fails_open_on_both_ranks(servers, root, ids):
    """documents.npy of `broken` is replaced after load: pointer following fails on rank 0, which
    begins the step's search; both ranks serve the rows LM-only, and the server goes on."""
    _, two = servers
    plain = greedy(two, ids["prompt"], LENGTH, knn=False)
    save(root / "broken" / "documents.npy", np.array([0, "x"], dtype=object))
    failed = greedy(two, ids["prompt"], LENGTH, knn_datastore="broken", knn_pointers=1, knn_drafts=False)
    same(failed, plain)
    assert greedy(two, ids["prompt"], LENGTH, knn_drafts=False).token_ids == ids["a"]  # the other datastore keeps kNN


def test_a_hot_swap_under_two_ranks_serves_the_new_version_on_both(servers, root, ids):
    _, two = servers
    swapped = requests.post(
        f"{two.base_url}/v1/knn/datastores", json={"name": "a", "path": "b"}, headers={"X-Admin-Token": TOKEN}, timeout=120
    )
    assert swapped.status_code == 200, swapped.text
    assert greedy(two, ids["prompt"], LENGTH, knn_drafts=False).token_ids == ids["b"]
    assert greedy(two, ids["prompt"], LENGTH).token_ids == ids["b"]
