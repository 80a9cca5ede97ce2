"""Torch's share of search gives FAISS's answers, whichever path a call takes: exact search
of flat shards, and the coarse step (each query's nprobe lists) of IVF shards."""

from __future__ import annotations

from collections import Counter

import faiss
import numpy as np
import pytest

from index_builder.build import build_from_keys
from knnlm_core.config import BuildConfig
from knnlm_core.datastore import read_manifest
from knnlm_core.manifest import ModelIdentity
from knnlm_core.pointers import RowLinks, find_linked, successors
from knnlm_core.search import (
    FlatKeys,
    coarse_by_torch,
    faiss_search,
    flat_keys,
    ivf_centroids,
    ivf_of,
    omp_spins_briefly,
    open_shards,
    search_index,
    search_many,
    torch_is_faster,
    torch_search,
)


def flat_index(keys: np.ndarray) -> faiss.IndexFlatL2:
    index = faiss.IndexFlatL2(keys.shape[1])
    index.add(keys)
    return index


def assert_same_neighbours(expected: tuple[np.ndarray, np.ndarray], found: tuple[np.ndarray, np.ndarray], values: np.ndarray) -> None:
    """Same distances to fp32 rounding and, row by row, the same multiset of tokens (ties may swap ids)."""
    (expected_d, expected_ids), (distances, ids) = expected, found
    assert ids.shape == expected_ids.shape
    np.testing.assert_allclose(distances, expected_d, rtol=1e-4, atol=1e-3)
    for row, expected_row in zip(ids, expected_ids):
        assert Counter(values[row[row >= 0]].tolist()) == Counter(values[expected_row[expected_row >= 0]].tolist())


@pytest.mark.parametrize("batch, k", [(1, 8), (1, 1024), (32, 1024), (5, 3000)])
def test_torch_search_equals_faiss_flat(batch, k):
    rng = np.random.default_rng(0)
    keys, values = rng.normal(size=(2000, 64)).astype(np.float32), rng.integers(0, 50, 2000)
    queries = np.concatenate([keys[:1] + 1e-4, rng.normal(size=(batch - 1, 64))]).astype(np.float32)  # one near-zero distance
    index = flat_index(keys)
    distances, ids = torch_search(flat_keys(index, on_gpu=False), queries, k)
    assert_same_neighbours(index.search(queries, min(k, 2000)), (distances, ids), values)
    assert np.all(distances >= 0) and np.all(np.diff(distances, axis=1) >= 0)


def test_small_searches_go_to_faiss_large_ones_to_torch():
    assert not torch_is_faster(4, 3_000, "cpu") and torch_is_faster(4, 10_000, "cpu") and torch_is_faster(32, 3_000, "cpu")
    assert torch_is_faster(1, 100, "cuda")


def test_a_keep_mask_leaves_the_same_entries_out_as_faiss():
    rng = np.random.default_rng(2)
    keys, values = rng.normal(size=(500, 16)).astype(np.float32), rng.integers(0, 30, 500)
    queries, keep = rng.normal(size=(32, 16)).astype(np.float32), rng.random(500) < 0.3
    index = flat_index(keys)
    distances, ids = torch_search(flat_keys(index, on_gpu=False), queries, 700, keep)
    kept = int(keep.sum())
    assert np.all(keep[ids[:, :kept]]) and np.all(ids[:, kept:] == -1) and np.all(np.isinf(distances[:, kept:]))
    expected_d, expected_ids = faiss_search(index, queries, 700, None, keep)
    assert_same_neighbours((expected_d[:, :kept], expected_ids[:, :kept]), (distances[:, :kept], ids[:, :kept]), values)
    by_search_index = search_index(index, values, queries, 700, keep=keep, exact=flat_keys(index, on_gpu=False))
    np.testing.assert_allclose(by_search_index[0][:, :kept], expected_d[:, :kept], rtol=1e-4, atol=1e-3)


@pytest.fixture(params=[1, 2], ids=["1 thread", "2 threads"])
def threads(request):
    """Both sides of `torch_is_faster`'s single-query rule: FAISS when it runs single-threaded."""
    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(request.param)
    yield request.param
    faiss.omp_set_num_threads(before)


def test_flat_shards_answer_as_faiss_through_shard_searcher_and_search_many(tmp_path, threads):
    rng = np.random.default_rng(1)
    keys, values = rng.normal(size=(24_000, 32)).astype(np.float32), rng.integers(0, 1000, 24_000)
    model = ModelIdentity(name="m", fingerprint="f", hidden_size=32, vocab_size=1000, dtype="float32")
    build_from_keys(keys, values, tmp_path / "ds", model, BuildConfig(index="flat", shards=2), source="test", progress=False)
    shards = open_shards(tmp_path / "ds", read_manifest(tmp_path / "ds"))
    assert all(s.exact is not None for s in shards)
    queries = rng.normal(size=(32, 32)).astype(np.float32)
    for batch, k in ((1, 64), (1, 1024), (32, 1024), (32, 13_000)):  # k past the shard size too
        assert torch_is_faster(batch, 12_000, "cpu") == (batch > 1 or threads > 1)
        q = queries[:batch]
        for shard in shards:
            distances, tokens, ids = shard.search(q, k)
            expected_d, expected_local = faiss_search(shard.index, q, k, None, None)
            width = expected_local.shape[1]
            assert distances.shape == (batch, k) and np.all(np.isinf(distances[:, width:])) and np.all(ids[:, width:] == -1)
            np.testing.assert_array_equal(tokens[:, :width], shard.values[ids[:, :width] - shard.first_id])
            assert_same_neighbours(
                (expected_d, expected_local + shard.first_id), (distances[:, :width], ids[:, :width]), np.asarray(values)
            )
    merged_d, merged_tokens, merged_ids = search_many([(s.index, s.values, None, s.first_id) for s in shards], queries, 1024)
    expected_d, expected_ids = flat_index(keys).search(queries, 1024)
    assert_same_neighbours((expected_d, expected_ids), (merged_d, merged_ids), np.asarray(values))
    np.testing.assert_array_equal(merged_tokens, np.asarray(values)[merged_ids])


@pytest.mark.parametrize("index", ["flat", pytest.param("IVF16,PQ8", marks=pytest.mark.slow), "IVF16,PQ8x4fs"])
def test_memory_mapped_shards_answer_as_read_ones(tmp_path, index):
    from knnlm_core.search import ShardSearcher, shard_first_ids

    rng = np.random.default_rng(3)
    keys, values = rng.normal(size=(4000, 32)).astype(np.float32), rng.integers(0, 1000, 4000)
    model = ModelIdentity(name="m", fingerprint="f", hidden_size=32, vocab_size=1000, dtype="float32")
    build_from_keys(keys, values, tmp_path / "ds", model, BuildConfig(index=index, shards=2), source="test", progress=False)
    manifest = read_manifest(tmp_path / "ds")
    queries, pointers = keys[:8] + 0.01, np.tile(np.arange(2000, 2010), (8, 1))
    for shard, first in zip(manifest.shards, shard_first_ids(manifest)):
        read, mapped = (ShardSearcher(tmp_path / "ds", shard, first, use_gpu=False, mmap=m) for m in (False, True))
        for a, b in zip(read.search(queries, 50, 4), mapped.search(queries, 50, 4)):
            np.testing.assert_array_equal(a, b)
        for a, b in zip(read.lookup(queries, pointers), mapped.lookup(queries, pointers)):  # pointer following reconstructs
            np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_knn_gpu_without_a_gpu_faiss_is_refused_for_ivf_shards_and_served_on_cpu_for_flat_ones(tmp_path):
    """`knn.gpu: true` where FAISS sees no GPU (CI's faiss-cpu): flat shards are torch's and need
    no faiss-gpu; an IVF shard gets an error naming the setting instead of a SWIG AttributeError."""
    from knnlm_core.errors import ConfigError
    from knnlm_core.search import ShardSearcher, gpu_available

    if gpu_available():
        pytest.skip("FAISS sees a GPU here")
    rng = np.random.default_rng(5)
    keys, values = rng.normal(size=(2000, 32)).astype(np.float32), rng.integers(0, 1000, 2000)
    model = ModelIdentity(name="m", fingerprint="f", hidden_size=32, vocab_size=1000, dtype="float32")
    for index in ("flat", "IVF16,PQ8"):
        build_from_keys(keys, values, tmp_path / index, model, BuildConfig(index=index), source="test", progress=False)
        (shard,) = read_manifest(tmp_path / index).shards
        if index == "flat":
            found = ShardSearcher(tmp_path / index, shard, 0, use_gpu=True).search(keys[:4], 5)
            np.testing.assert_array_equal(found[2][:, 0], np.arange(4))
        else:
            with pytest.raises(ConfigError, match="knn.gpu is true .*IndexIVFPQ.*set knn.gpu to null"):
                ShardSearcher(tmp_path / index, shard, 0, use_gpu=True)


@pytest.mark.parametrize("batch, k", [(1, 1), (1, 32), (11, 32), (32, 256)])
def test_bf16_preselection_finds_the_exact_neighbours(batch, k):
    """Flat shards on a CPU with native bf16 pick candidates with bf16 dot products and re-score
    them in fp32: the answer is exact search's (clustered keys, queries near stored ones)."""
    rng = np.random.default_rng(3)
    centres = rng.normal(size=(40, 64)).astype(np.float32) * 4
    keys = (centres[rng.integers(0, 40, 6000)] + rng.normal(size=(6000, 64))).astype(np.float32)
    values = rng.integers(0, 200, 6000)
    queries = (keys[rng.integers(0, 6000, batch)] + 0.3 * rng.normal(size=(batch, 64))).astype(np.float32)
    index = flat_index(keys)
    exact = flat_keys(index, on_gpu=False)
    with_bf16 = FlatKeys(exact.keys, exact.norms, exact.keys.bfloat16())
    assert_same_neighbours(index.search(queries, k), torch_search(with_bf16, queries, k), values)
    keep = rng.random(6000) < 0.5
    expected = faiss_search(index, queries, k, None, keep)
    distances, ids = torch_search(with_bf16, queries, k, keep)
    assert np.all(keep[ids]) and np.all(np.diff(distances, axis=1) >= 0)
    assert_same_neighbours(expected, (distances, ids), values)


@pytest.mark.slow
@pytest.mark.parametrize("factory", ["IVF1024,PQ8", "IVF1024,Flat", "IVF1024,PQ16x4fs"])
def test_ivf_shards_probe_the_lists_faiss_probes(tmp_path, factory, monkeypatch):
    """Single-threaded IVF shards find each query's nprobe lists with torch at a decode step's batch
    and FAISS scans them: FAISS's own answer, with a subset too, and at nprobe past the list count.
    On two threads only fast-scan shards do, and only where OpenMP's threads spin briefly."""
    rng = np.random.default_rng(4)
    centres = rng.normal(size=(64, 32)).astype(np.float32) * 3
    keys = (centres[rng.integers(0, 64, 16_000)] + rng.normal(size=(16_000, 32))).astype(np.float32)
    values = rng.integers(0, 500, 16_000)
    model = ModelIdentity(name="m", fingerprint="f", hidden_size=32, vocab_size=500, dtype="float32")
    build_from_keys(keys, values, tmp_path / "ds", model, BuildConfig(index=factory), source="test", progress=False)
    (shard,) = open_shards(tmp_path / "ds", read_manifest(tmp_path / "ds"), use_gpu=False)
    assert shard.centroids is not None and len(shard.centroids.keys) == 1024
    queries = (keys[rng.integers(0, 16_000, 32)] + 0.3 * rng.normal(size=(32, 32))).astype(np.float32)
    keep = rng.random(16_000) < 0.5
    fast_scan, ivf = factory.endswith("fs"), ivf_of(shard.index)
    assert shard.fast_scan == fast_scan and ivf.nlist == 1024
    before = faiss.omp_get_max_threads()
    for name in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY"):
        monkeypatch.delenv(name, raising=False)
    try:
        faiss.omp_set_num_threads(1)
        # else FAISS's quantizer would run both times
        assert coarse_by_torch(len(queries), ivf) and not coarse_by_torch(8, ivf)
        for nprobe, k, subset in ((4, 100, None), (16, 1024, None), (8, 50, keep), (2000, 20, None)):
            check_ivf_search(shard, queries, nprobe, k, subset)
        faiss.omp_set_num_threads(2)
        omp_spins_briefly.cache_clear()
        assert not coarse_by_torch(len(queries), ivf)  # libgomp's default spin
        monkeypatch.setenv("GOMP_SPINCOUNT", "1000")  # as in shard actors (SHARD_ACTOR_ENV)
        omp_spins_briefly.cache_clear()
        assert coarse_by_torch(len(queries), ivf) == fast_scan
        check_ivf_search(shard, queries, 16, 1024, None)
    finally:
        faiss.omp_set_num_threads(before)
        omp_spins_briefly.cache_clear()
    assert ivf_centroids(flat_index(keys)) is None


def check_ivf_search(shard, queries: np.ndarray, nprobe: int, k: int, subset: np.ndarray | None) -> None:
    found = search_index(shard.index, shard.values, queries, k, nprobe, subset, centroids=shard.centroids)
    expected = search_index(shard.index, shard.values, queries, k, nprobe, subset)  # FAISS's quantizer
    # The same neighbours at the same distances; entries at equal distance may swap places.
    assert_same_neighbours((expected[0], expected[2]), (found[0], found[2]), shard.values)
    assert np.mean(found[2] == expected[2]) > 0.999
    if subset is not None:
        assert np.all(subset[found[2][found[2] >= 0]])
    # A row's answer does not depend on the rest of its batch (alone, FAISS's quantizer runs).
    for row in (0, len(queries) - 1):
        alone = search_index(shard.index, shard.values, queries[row : row + 1], k, nprobe, subset, centroids=shard.centroids)
        assert_same_neighbours((found[0][row : row + 1], found[2][row : row + 1]), (alone[0], alone[2]), shard.values)


def test_fast_scan_shards_decode_their_codes_and_score_pointers_as_their_search(tmp_path):
    """The `ivfpq` preset's 4-bit fast-scan codes: FAISS 1.15 cannot reconstruct them (it reads past
    the code and crashes), so a shard decodes them itself (checked against a NumPy decoding of the
    codes FAISS's PQ gives each key), and scores pointer candidates by the index's own scan: the
    distances its search gave the same entries."""
    rng = np.random.default_rng(5)
    centres = rng.normal(size=(32, 32)).astype(np.float32) * 3
    keys = (centres[rng.integers(0, 32, 8000)] + rng.normal(size=(8000, 32))).astype(np.float32)
    model = ModelIdentity(name="m", fingerprint="f", hidden_size=32, vocab_size=500, dtype="float32")
    build_from_keys(
        keys, rng.integers(0, 500, 8000), tmp_path / "ds", model, BuildConfig(index="IVF16,PQ8x4fs"), source="t", progress=False
    )
    (shard,) = open_shards(tmp_path / "ds", read_manifest(tmp_path / "ds"), use_gpu=False)
    ivf = faiss.downcast_index(faiss.extract_index_ivf(shard.index))
    ids = np.sort(rng.choice(8000, 300, replace=False))
    lists = ivf.quantizer.assign(keys[ids], 1).ravel()
    coarse = ivf.quantizer.reconstruct_n(0, ivf.nlist)[lists] if ivf.by_residual else np.zeros_like(keys[ids])
    packed = ivf.pq.compute_codes(np.ascontiguousarray(keys[ids] - coarse))  # 4-bit codes, low nibble first
    codes = np.stack([packed & 15, packed >> 4], axis=2).reshape(len(ids), ivf.pq.M)
    table = faiss.vector_to_array(ivf.pq.centroids).reshape(ivf.pq.M, ivf.pq.ksub, ivf.pq.dsub)
    decoded = coarse + table[np.arange(ivf.pq.M), codes].reshape(len(ids), -1)
    np.testing.assert_allclose(shard.reconstruct(ids), decoded, rtol=1e-5, atol=1e-5)

    queries = (keys[rng.integers(0, 8000, 8)] + 0.3 * rng.normal(size=(8, 32))).astype(np.float32)
    distances, tokens, found = shard.search(queries, 40, 4)
    scored, scored_tokens, scored_ids = shard.lookup(queries, found[:, ::-1])  # candidates in any order
    for row in range(len(queries)):  # by entry: the 8-bit tables leave ties, which may come in any order
        a, b = np.argsort(found[row]), np.argsort(scored_ids[row])
        np.testing.assert_array_equal(scored_ids[row, b], found[row, a])
        np.testing.assert_allclose(scored[row, b], distances[row, a], rtol=1e-6)
        np.testing.assert_array_equal(scored_tokens[row, b], tokens[row, a])
    # Its tables round to 8 bits: the decoded keys' exact distances are close, not equal.
    exact = np.sum((shard.reconstruct(found.ravel()).reshape(8, 40, -1) - queries[:, None]) ** 2, axis=2)
    np.testing.assert_allclose(exact, distances, rtol=0.05)


def test_rows_linked_in_one_call_get_what_one_call_per_round_gives(tmp_path):
    """A request's draft rows in one search call (`find_linked`): each row follows the pointers of
    the row before it, as sent one call per draft position with its candidates worked out from the
    last call's answer, kept neighbours (k) and document ends respected. Rows with too few
    candidates, or no pointers asked for, are searched."""
    rng = np.random.default_rng(7)
    keys, values = rng.normal(size=(6000, 16)).astype(np.float32), rng.integers(0, 6, 6000)
    model = ModelIdentity(name="m", fingerprint="f", hidden_size=16, vocab_size=6, dtype="float32")
    build_from_keys(keys, values, tmp_path / "ds", model, BuildConfig(index="flat"), source="t", progress=False)
    (shard,) = open_shards(tmp_path / "ds", read_manifest(tmp_path / "ds"))
    starts = np.array([0, 1500, 4000, 6000])
    # three requests of four rows: pointers on, pointers on with a smaller k, pointers off
    previous = np.array([-1, 0, 1, 2, -1, 4, 5, 6, -1, 8, 9, 10])
    min_pointers = np.array([2] * 4 + [1] * 4 + [0] * 4)
    ks = np.array([32] * 4 + [8] * 4 + [32] * 4)
    fed = rng.integers(0, 6, 12)
    queries = (keys[rng.integers(0, 6000, 12)] + 0.5 * rng.normal(size=(12, 16))).astype(np.float32)
    first = np.full((12, 40), -1, dtype=np.int64)
    first[4, :20] = np.arange(100, 120)  # the second request's first row follows pointers of its own
    links = RowLinks(previous, fed, min_pointers, ks)

    linked = find_linked(shard.find, queries, 32, None, first, links, starts)

    expected = [np.full((12, 32), np.inf, np.float32), np.full((12, 32), -1, np.int32), np.full((12, 32), -1, np.int64)]
    followed = []
    for position in range(4):  # one call per draft position, as the worker sends them without links
        rows = np.arange(position, 12, 4)
        pointers = np.full((len(rows), 64), -1, dtype=np.int64)
        for i, row in enumerate(rows):
            if position == 0:
                pointers[i, :40] = first[row]
                continue
            before = row - 1
            kept = expected[2][before, : ks[before]]
            candidates = successors(kept[kept >= 0], expected[1][before, : ks[before]][kept >= 0], int(fed[row]), starts)
            if 0 < min_pointers[row] <= len(candidates):
                pointers[i, : len(candidates)] = candidates
                followed.append(row)
        for column, answer in zip(expected, shard.find(queries[rows], 32, None, pointers)):
            column[rows] = answer
    for got, want in zip(linked, expected):
        np.testing.assert_array_equal(got, want)
    followed_set = set(followed)  # the links were followed where pointers were asked for, not elsewhere
    assert followed_set & {1, 2, 3} and followed_set & {5, 6, 7} and not followed_set & {9, 10, 11}
    searched = shard.search(queries, 32)[2]
    assert all(not np.array_equal(linked[2][row], searched[row]) for row in followed)
