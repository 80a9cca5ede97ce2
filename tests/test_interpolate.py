"""The plugin's mixture equals a direct NumPy computation of λ·p_kNN + (1−λ)·p_LM."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from knnlm_serve.config import KnnConfig
from knnlm_serve.interpolate import interpolate
from knnlm_serve.request_params import KnnParamError, parse_knn_params


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
            mix = lam[i] * p_knn + (1 - lam[i]) * p_lm
        else:
            mix = p_lm
        with np.errstate(divide="ignore"):
            out[i] = np.log(mix)
    return out


def test_mixture_matches_numpy_with_duplicates_and_padding():
    rng = np.random.default_rng(0)
    n, k, vocab = 6, 12, 50
    lm = rng.normal(size=(n, vocab)).astype(np.float32) * 3
    distances = np.sort(rng.uniform(0, 20, size=(n, k)), axis=1).astype(np.float32)
    tokens = rng.integers(0, 5, size=(n, k)).astype(np.int32)  # many duplicate neighbour tokens
    distances[1, 7:], tokens[1, 7:] = np.inf, -1  # k larger than the shard: padded
    distances[2, :], tokens[2, :] = np.inf, -1  # nothing retrieved at all
    lam = np.array([0.25, 0.5, 0.9, 0.0, 1.0, 0.75], dtype=np.float32)
    tau = np.array([1.0, 3.0, 0.5, 1.0, 2.0, 10.0], dtype=np.float32)
    got = interpolate(*(torch.from_numpy(x) for x in (lm, distances, tokens, lam, tau))).numpy()
    expected = reference(lm, distances, tokens, lam, tau)
    finite = np.isfinite(expected)
    assert np.array_equal(finite, np.isfinite(got))  # λ = 1 leaves unseen tokens at probability 0
    np.testing.assert_allclose(got[finite], expected[finite], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.exp(got).sum(axis=1), 1.0, rtol=1e-5)


CONFIG = KnnConfig(datastores={"wiki": "/d/wiki", "code": "/d/code"}, k=16, max_k=64)


def test_request_params_default_to_the_server_config():
    params = parse_knn_params(None, CONFIG)
    assert (params.datastore, params.lambda_, params.k, params.temperature, params.active) == ("wiki", 0.25, 16, 1.0, True)
    params = parse_knn_params({"knn_datastore": "code", "knn_lambda": 1, "knn_k": 64, "knn_temperature": 0.5}, CONFIG)
    assert (params.datastore, params.lambda_, params.k, params.temperature) == ("code", 1.0, 64, 0.5)
    assert not parse_knn_params({"knn": False}, CONFIG).active
    assert not parse_knn_params({"knn_lambda": 0}, CONFIG).active


@pytest.mark.parametrize(
    "args, field, allowed",
    [
        ({"knn_lambda": 1.5}, "knn_lambda", "[0, 1]"),
        ({"knn_lambda": "high"}, "knn_lambda", "[0, 1]"),
        ({"knn_k": 0}, "knn_k", "[1, 64]"),
        ({"knn_k": 65}, "knn_k", "[1, 64]"),
        ({"knn_k": 2.5}, "knn_k", "[1, 64]"),
        ({"knn_temperature": 0}, "knn_temperature", "> 0"),
        ({"knn_datastore": "legal"}, "knn_datastore", "'code', 'wiki'"),
        ({"knn": "maybe"}, "knn", "true or false"),
    ],
)
def test_invalid_request_params_name_field_value_and_range(args, field, allowed):
    with pytest.raises(KnnParamError) as e:
        parse_knn_params(args, CONFIG)
    message = str(e.value)
    assert field in message and repr(next(iter(args.values()))) in message and allowed in message


def test_adaptive_lambda_applies_only_when_the_request_sets_none():
    config = CONFIG.model_copy(update={"adaptive_lambda": {"code": {"lambda_max": 0.8, "slope": 1.0, "center": 5.0}}})
    config = type(CONFIG).model_validate(config.model_dump(by_alias=True))
    assert parse_knn_params({"knn_datastore": "code"}, config).lambda_ is None
    assert parse_knn_params({"knn_datastore": "code"}, config).active
    assert parse_knn_params({"knn_datastore": "code", "knn_lambda": 0.4}, config).lambda_ == 0.4
    assert parse_knn_params({"knn_datastore": "wiki"}, config).lambda_ == 0.25  # no adaptive λ for it
