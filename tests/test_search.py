"""Exact search of flat shards with torch gives FAISS's answers."""

from __future__ import annotations

import faiss
import numpy as np
import pytest

from index_builder.build import build_from_keys
from knnlm_core.config import BuildConfig
from knnlm_core.datastore import ModelIdentity, read_manifest
from knnlm_core.search import ExactKeys, open_shards


@pytest.mark.parametrize("batch, k", [(1, 8), (32, 1024), (5, 3000)])
def test_torch_exact_search_equals_faiss_flat(batch, k):
    rng = np.random.default_rng(0)
    keys = rng.normal(size=(2000, 64)).astype(np.float32)
    queries = rng.normal(size=(batch, 64)).astype(np.float32)
    index = faiss.IndexFlatL2(64)
    index.add(keys)
    expected_d, expected_ids = index.search(queries, min(k, 2000))
    distances, ids = ExactKeys.of(index).search(queries, k)
    assert ids.shape == expected_ids.shape
    np.testing.assert_allclose(distances, expected_d, rtol=1e-4, atol=1e-3)
    assert np.mean(ids == expected_ids) > 0.999  # ties aside, the same neighbours in the same order


def test_a_flat_shard_searches_with_torch_and_pads_past_its_size(tmp_path):
    rng = np.random.default_rng(1)
    keys, values = rng.normal(size=(300, 32)).astype(np.float32), rng.integers(0, 1000, 300)
    model = ModelIdentity(name="m", fingerprint="f", hidden_size=32, vocab_size=1000, dtype="float32")
    build_from_keys(keys, values, tmp_path / "ds", model, BuildConfig(index="flat", shards=2), source="test", progress=False)
    shards = open_shards(tmp_path / "ds", read_manifest(tmp_path / "ds"))
    assert all(s.exact is not None for s in shards)
    queries = keys[:4] + 1e-3
    for shard in shards:
        distances, tokens, ids = shard.search(queries, 200)
        assert distances.shape == (4, 200) and np.all(np.isinf(distances[:, shard.ntotal :])) and np.all(ids[:, shard.ntotal :] == -1)
        found = ids[:, : shard.ntotal]
        np.testing.assert_array_equal(tokens[:, : shard.ntotal], values[found])
        np.testing.assert_allclose(distances[:, : shard.ntotal], ((keys[found] - queries[:, None]) ** 2).sum(2), rtol=1e-4, atol=1e-4)
