"""The plugin's mixture equals a direct NumPy computation of λ·p_kNN + (1−λ)·p_LM."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from knnlm_core.mixture import LM_FLOOR, interpolate, mixture_log_prob
from knnlm_serve.engine.knn_mixer import KnnMixer


def reference(lm_logits, distances, tokens, lam, tau):
    n, vocab = lm_logits.shape
    out = np.empty_like(lm_logits, dtype=np.float64)
    for i in range(n):
        p_lm = np.exp(lm_logits[i] - lm_logits[i].max())
        p_lm /= p_lm.sum()
        p_knn = np.zeros(vocab)
        valid = tokens[i] >= 0
        if valid.any():
            w = np.exp(-(distances[i][valid] - distances[i][valid].min()) / tau[i])
            w /= w.sum()
            for token, weight in zip(tokens[i][valid], w):
                p_knn[token] += weight
            rest = max(1 - float(lam[i]), LM_FLOOR)
            mix = (lam[i] * p_knn + rest * p_lm) / (lam[i] + rest)
        else:
            mix = p_lm
        out[i] = np.log(mix)
    return out


@pytest.mark.parametrize("layout", ["contiguous", "a view of wider logits"])
def test_mixture_matches_numpy_with_duplicates_and_padding(layout):
    """Contiguous host logits are mixed in place; others (a view, a device's) through a copy of the entries."""
    rng = np.random.default_rng(0)
    n, k, vocab = 6, 12, 50
    batch = rng.normal(size=(n + 2, vocab)).astype(np.float32) * 3  # the step's logits
    rows = np.array([0, 2, 3, 4, 5, 7])  # the rows that are mixed; 1 and 6 are not
    distances = np.sort(rng.uniform(0, 20, size=(n, k)), axis=1).astype(np.float32)
    tokens = rng.integers(0, 5, size=(n, k)).astype(np.int32)  # many duplicate neighbour tokens
    distances[1, 7:], tokens[1, 7:] = np.inf, -1  # k larger than the shard: padded
    distances[2, :], tokens[2, :] = np.inf, -1  # nothing retrieved at all
    lam = np.array([0.25, 0.5, 0.9, 0.0, 1.0, 0.75], dtype=np.float32)
    tau = np.array([1.0, 3.0, 0.5, 1.0, 2.0, 10.0], dtype=np.float32)
    logits = torch.from_numpy(batch.copy())
    if layout != "contiguous":  # as vLLM's logits past a padded vocabulary, sliced off
        logits = torch.cat([logits, torch.full((n + 2, 14), 99.0)], dim=1)[:, :vocab]
        assert not logits.is_contiguous()
    log_z = torch.logsumexp(logits[rows], dim=-1).numpy()
    got = interpolate(logits, rows, log_z, distances, tokens, lam, tau)
    assert got is logits  # in place: the step's logits
    mixed = torch.log_softmax(got[rows], dim=-1).numpy()  # what vLLM samples from and reports as logprobs
    expected = reference(batch[rows], distances, tokens, lam, tau)
    assert np.isfinite(mixed).all()  # λ = 1 leaves unseen tokens the LM's floor, not probability 0
    np.testing.assert_allclose(mixed, expected, rtol=1e-5, atol=1e-5)
    # λ = 1 (the fifth mixed row): p_kNN but for the floor, so its neighbours' tokens hold all the mass but about LM_FLOOR.
    assert lam[4] == 1 and abs(np.exp(mixed[4][np.unique(tokens[4])]).sum() - 1) < 1e-6
    # knnlm-eval's mixture (NumPy, fp64) scores a token no neighbour predicts as the server does.
    unseen = np.setdiff1d(np.arange(vocab), tokens[4])[0]
    log_p_lm = torch.log_softmax(torch.from_numpy(batch[rows[4]]).double(), dim=-1)[unseen].item()
    scored = mixture_log_prob(np.array([log_p_lm]), np.array([-np.inf]), 1.0, np.array([True]))[0]
    assert abs(scored - (np.log(LM_FLOOR) + log_p_lm)) < 1e-9 and abs(scored - mixed[4][unseen]) < 1e-4
    np.testing.assert_array_equal(got[[1, 6]].numpy(), batch[[1, 6]])  # rows not mixed are untouched
    np.testing.assert_allclose(got[3].numpy(), batch[3], rtol=1e-6, atol=1e-5)  # no neighbour: the LM's logits
    # Only a row's neighbour entries are written: the rest of it keeps its logits.
    for i, row in enumerate(rows):
        if (tokens[i] >= 0).any():
            off = np.setdiff1d(np.arange(vocab), tokens[i])
            np.testing.assert_array_equal(got[row, off].numpy(), batch[row, off])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_lm_confidence_is_each_rows_log_normaliser_and_top_probability(dtype):
    """The skip rule's top probability and the mix's log normaliser, of the rows asked for only; fp32
    host logits through NumPy, others (a device's; here fp64) through torch, the same numbers."""
    rng = np.random.default_rng(1)
    batch = torch.from_numpy(rng.normal(size=(5, 300)).astype(np.float32) * 4).to(dtype)
    batch[3, 100:] = -torch.inf  # masked by an earlier processor (a grammar, bad words)
    mixer = KnnMixer(retriever=None)
    # Some rows, all rows, then fewer: the mixer's scratch rows, kept from step to step, hold what an
    # earlier step left, and the logits stay as they were.
    for rows in ([0, 3, 4], [0, 1, 2, 3, 4], [4]):
        before = batch.clone()
        log_z, top = mixer.lm_confidence(batch, rows)
        expected = torch.log_softmax(batch[rows].double(), dim=-1)
        np.testing.assert_allclose(log_z, torch.logsumexp(batch[rows].double(), dim=-1).numpy(), rtol=1e-6)
        np.testing.assert_allclose(top, expected.exp().amax(dim=-1).numpy(), rtol=1e-5)
        assert log_z.shape == top.shape == (len(rows),)
        assert torch.equal(batch, before)
