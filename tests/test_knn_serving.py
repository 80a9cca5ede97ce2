"""kNN-LM through the real server: vLLM engine, Ray shard actors, FAISS, HTTP via the openai client."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import openai
import pytest
from conftest import STRICT_KNN, TINY_SERVER, greedy, prompt_logprobs, starting

from index_builder.build import build_datastore
from knnlm_core.config import BuildConfig
from knnlm_serve.server.process import RunningServer, metric_total, scrape_metrics

pytestmark = pytest.mark.slow

# Two texts that continue the same prefix differently, each memorised by its own datastore.
PREFIX = "The archive of the northern observatory records that on the first night of winter"
TEXT_A = PREFIX + " the astronomers saw a green comet pass slowly below the pole star, and they wrote its path in red ink."
TEXT_B = PREFIX + " a storm broke every window of the east tower, and the great brass telescope was never used again."
K = 8


@pytest.fixture(scope="module")
def token_ids(tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    return {name: tokenizer(text).input_ids for name, text in (("a", TEXT_A), ("b", TEXT_B))}


@pytest.fixture(scope="module")
def knn_settings(tiny_model_dir, tmp_path_factory) -> dict:
    """The reference server's kNN settings, over three datastores built here."""
    work = tmp_path_factory.mktemp("knn")
    config = BuildConfig(index="flat", context_length=128, stride=64)
    for name, text, shards in (("a", TEXT_A, 1), ("a3", TEXT_A, 3), ("b", TEXT_B, 1)):
        (work / f"{name}.txt").write_text(text)
        build_datastore([work / f"{name}.txt"], work / name, tiny_model_dir, config.model_copy(update={"shards": shards}), progress=False)
    return {
        "datastores": {n: str(work / n) for n in ("a", "a3", "b")},
        "default_datastore": "a",
        "k": K,
        "max_k": 64,
        "lambda": 0.25,
        # λ ≈ 1 when the nearest key is (almost) the query itself, ≈ 0 far away
        "adaptive_lambda": {"b": {"lambda_max": 1.0, "slope": 1.0, "center": 20.0}},
        "overlap": False,  # searches after the logits, only of the rows the skip rule keeps: the reference for overlap
        "compiled_graphs": False,  # plain actor calls: the reference for compiled graphs
        # A reference row must never be served LM-only: while the fast server tears down its idle
        # compiled graphs, both cores are busy, and a shard's answer took over the default 10 s.
        "shard_timeout_s": 120.0,
        **STRICT_KNN,
    }


@pytest.fixture(scope="module")
def fast_start(knn_settings, tiny_model_dir, tmp_path_factory, plain_tiny_start):
    """The reference server's datastores and settings with each of its references turned on:
    searches started mid-forward (knn.overlap, under vLLM's compiled graph), shards reached
    through Ray Compiled Graphs, and vLLM's prompt-lookup (`ngram`) speculative decoding. One
    server for the three comparisons (an engine start is the suite's largest cost), starting
    beside the reference server's start and tests, as the plain server does (`plain_tiny_start`)."""
    drafts = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    knn = {**knn_settings, "overlap": True, "compiled_graphs": True}
    config = {
        **TINY_SERVER,
        "enforce_eager": False,
        "model": str(tiny_model_dir),
        "knn": knn,
        "vllm_args": ["--speculative-config", json.dumps(drafts)],
    }
    with starting(RunningServer(config, tmp_path_factory.mktemp("fast"))) as start:
        yield start


@pytest.fixture(scope="module")
def knn_server(knn_settings, fast_start, tiny_model_dir):
    work = Path(knn_settings["datastores"]["a"]).parent
    with RunningServer({**TINY_SERVER, "model": str(tiny_model_dir), "knn": knn_settings}, work) as server:
        yield server


@pytest.fixture(scope="module")
def fast_server(fast_start):
    return fast_start.result()


def complete(server, prompt, max_tokens=16, **xargs):
    return greedy(server, prompt, max_tokens, **xargs)


def prefix_length(ids):
    return len(ids) - 24  # leave 24 tokens of continuation


def test_lambda_one_reproduces_the_memorised_continuation(knn_server, token_ids):
    ids = token_ids["a"]
    n = prefix_length(ids)
    choice = complete(knn_server, ids[:n], max_tokens=16, knn_lambda=1.0)
    assert choice.token_ids == ids[n : n + 16]
    # Returned logprobs are the mixture's: the memorised tokens are near-certain under kNN.
    assert min(choice.logprobs.token_logprobs) > -0.1


def test_at_lambda_one_a_constraint_that_allows_no_neighbours_token_still_gets_an_allowed_one(knn_server, token_ids):
    """λ = 1 leaves the LM only a floor of weight, and vLLM applies allowed_token_ids and structured
    outputs after the mix: where no neighbour's token is allowed, the LM's best allowed one is served."""
    ids = token_ids["a"]
    n = prefix_length(ids)
    allowed = [t for t in range(100, 400) if t not in ids][:40]
    client = knn_server.openai_client()
    constrained = client.completions.create(
        model="tiny",
        prompt=ids[:n],
        max_tokens=6,
        temperature=0,
        extra_body={"allowed_token_ids": allowed, "return_token_ids": True, "vllm_xargs": {"knn_lambda": 1.0}},
    )
    assert constrained.choices[0].token_ids and set(constrained.choices[0].token_ids) <= set(allowed)
    choice = client.completions.create(
        model="tiny",
        prompt=ids[:n],
        max_tokens=3,
        temperature=0,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}, "vllm_xargs": {"knn_lambda": 1.0}},
    )
    assert choice.choices[0].text in ("yes", "no")


def test_knn_off_and_lambda_zero_equal_plain_vllm(knn_server, plain_tiny_server, token_ids):
    ids = token_ids["a"]
    prompt = ids[: prefix_length(ids)]
    plain = complete(plain_tiny_server, prompt)
    for xargs in ({"knn": False}, {"knn_lambda": 0.0}):
        choice = complete(knn_server, prompt, **xargs)
        assert choice.token_ids == plain.token_ids
        np.testing.assert_allclose(choice.logprobs.token_logprobs, plain.logprobs.token_logprobs, atol=1e-4)
    assert plain.token_ids != ids[len(prompt) : len(prompt) + 16]  # the random model alone does not recall it


def test_one_and_three_shards_give_the_same_answers(knn_server, token_ids):
    ids = token_ids["a"]
    prompt = ids[: prefix_length(ids)]
    one = complete(knn_server, prompt, knn_datastore="a", knn_lambda=0.5)
    three = complete(knn_server, prompt, knn_datastore="a3", knn_lambda=0.5)
    assert one.token_ids == three.token_ids
    np.testing.assert_allclose(
        prompt_logprobs(knn_server, ids, knn_datastore="a", knn_lambda=0.5),
        prompt_logprobs(knn_server, ids, knn_datastore="a3", knn_lambda=0.5),
        atol=1e-4,
    )


def test_prompt_logprobs_are_the_mixture(knn_server, plain_tiny_server, token_ids):
    ids = token_ids["a"]
    plain = prompt_logprobs(plain_tiny_server, ids)
    memorised = prompt_logprobs(knn_server, ids, knn_lambda=0.5)
    # Every position of the memorised text gets at least λ·p_kNN ≈ 0.5 of its probability.
    assert np.all(memorised > np.log(0.45)) and np.mean(plain) < -5


MIXED_REQUESTS = [
    {"knn_datastore": "a", "knn_lambda": 1.0},
    {"knn_datastore": "b", "knn_lambda": 1.0},
    {"knn": False},
    {"knn_datastore": "a3", "knn_lambda": 0.5, "knn_k": 2},
    {"knn_datastore": "b", "knn_lambda": 0.3, "knn_temperature": 5.0},
    {"knn_datastore": "a", "knn_lambda": 0.9, "knn_skip_threshold": 0.02},
    {"knn_datastore": "a3", "knn_lambda": 0.9, "knn_pointers": 1},  # its own pointers, across 3 shards
]


def test_mixed_batch_rows_get_their_own_settings(knn_server, token_ids):
    prompt = token_ids["a"][: len(PREFIX.split()) + 2]
    requests = MIXED_REQUESTS * 2
    alone = [complete(knn_server, prompt, **x) for x in requests[:7]]
    with ThreadPoolExecutor(len(requests)) as pool:
        together = list(pool.map(lambda x: complete(knn_server, prompt, **x), requests))
    for i, choice in enumerate(together):
        assert choice.token_ids == alone[i % 7].token_ids
        np.testing.assert_allclose(choice.logprobs.token_logprobs, alone[i % 7].logprobs.token_logprobs, atol=1e-4)
    assert alone[0].token_ids != alone[1].token_ids  # the two datastores really differ


def test_skipped_rows_are_served_the_plain_lm_and_counted(knn_server, token_ids):
    ids = token_ids["a"]

    def echo(**xargs):
        """log p of every prompt token after the first and of one greedy token, with each position's top log p."""
        result = knn_server.openai_client().completions.create(
            model="tiny", prompt=ids, max_tokens=1, temperature=0, echo=True, logprobs=1, extra_body={"vllm_xargs": xargs}
        )
        logprobs = result.choices[0].logprobs
        return np.array(logprobs.token_logprobs[1:]), np.array([max(top.values()) for top in logprobs.top_logprobs[1:]])

    lm, lm_top = echo(knn=False)
    searched, _ = echo(knn_lambda=0.9, knn_skip_threshold=1.0)
    threshold = float(np.median(np.exp(lm_top)))
    skip = np.exp(lm_top) > threshold
    before = scrape_metrics(knn_server.base_url)
    served, _ = echo(knn_lambda=0.9, knn_skip_threshold=threshold)
    after = scrape_metrics(knn_server.base_url)
    np.testing.assert_allclose(served[skip], lm[skip], atol=1e-5)  # skipped: exactly the plain LM
    np.testing.assert_allclose(served[~skip], searched[~skip], atol=1e-5)  # searched: the full mixture
    assert np.all(np.abs(searched - lm)[~skip] > 0.01)  # which really differs from the LM
    counted = {
        name: metric_total(after, rf'knnlm_{name}_total\{{datastore="a"') - metric_total(before, rf'knnlm_{name}_total\{{datastore="a"')
        for name in ("skipped_rows", "queries")
    }
    assert counted == {"skipped_rows": skip.sum(), "queries": (~skip).sum()}


def test_pointer_following_scores_the_successors_exactly(knn_server, token_ids, tiny_model_dir, tmp_path_factory):
    """λ = 1: each served log p is log p_kNN. Replay the server's rule in NumPy over the stored keys:
    the first sampling row searches all entries; each later one, whose previous neighbours with the
    value it was fed leave at least `m` successors in their document, is scored against those only."""
    import faiss

    from knnlm_core.datastore import load_document_starts, read_manifest
    from knnlm_core.keys import KeyEncoder
    from knnlm_core.mixture import knn_log_prob

    ids = token_ids["a"]
    n, generate, m = prefix_length(ids), 12, 1
    root = Path(knn_server.config["knn"]["datastores"]["a"])
    manifest = read_manifest(root)
    index = faiss.read_index(str(root / manifest.shards[0].index.path))
    stored = faiss.rev_swig_ptr(index.get_xb(), index.ntotal * index.d).reshape(index.ntotal, index.d).copy()
    values = np.load(root / manifest.shards[0].values.path)
    starts = load_document_starts(root, manifest)

    before = scrape_metrics(knn_server.base_url)
    out = complete(knn_server, ids[:n], max_tokens=generate, knn_lambda=1.0, knn_k=K, knn_temperature=20.0, knn_pointers=m)
    after = scrape_metrics(knn_server.base_url)
    tokens = ids[:n] + out.token_ids
    queries = KeyEncoder(tiny_model_dir, "ffn_input", "float32").encode([np.array(tokens[:-1])])[0][n - 1 :]

    expected, followed, previous = [], 0, None
    for step, (query, token) in enumerate(zip(queries, out.token_ids)):
        distances = ((stored - query) ** 2).sum(1)
        candidates = np.arange(len(stored))
        if previous is not None:
            fed = tokens[n - 1 + step]
            right = previous[values[previous] == fed]
            successors = right[right + 1 < starts[np.searchsorted(starts, right, side="right")]] + 1
            if len(successors) >= m:
                candidates, followed = successors, followed + 1
        nearest = candidates[np.argsort(distances[candidates], kind="stable")[:K]]
        padded = np.full(K, np.inf)
        padded[: len(nearest)] = distances[nearest]
        match = np.zeros((1, K), dtype=bool)
        match[0, : len(nearest)] = values[nearest] == token
        expected.append(knn_log_prob(padded[None], match, K, 20.0)[0])
        previous = nearest
    np.testing.assert_allclose(out.logprobs.token_logprobs, expected, atol=2e-3)
    assert followed >= generate // 2  # a memorised text: pointers survive most steps
    counted = metric_total(after, r'knnlm_pointer_rows_total\{datastore="a"') - metric_total(
        before, r'knnlm_pointer_rows_total\{datastore="a"'
    )
    assert counted == followed
    # And without the knob, the same request searches every step, with the same tokens.
    assert complete(knn_server, ids[:n], max_tokens=generate, knn_lambda=1.0, knn_k=K, knn_temperature=20.0).token_ids == out.token_ids


def test_adaptive_lambda_from_the_config_when_the_request_sets_none(knn_server, token_ids):
    ids = token_ids["b"]
    n = prefix_length(ids)
    adaptive = complete(knn_server, ids[:n], knn_datastore="b")  # no knn_lambda: adaptive λ ≈ 1 on exact matches
    assert adaptive.token_ids == ids[n : n + 16]
    fixed = complete(knn_server, ids[:n], knn_datastore="b", knn_lambda=0.05)
    assert fixed.token_ids == adaptive.token_ids
    # p_LM of the random model is negligible, so log p ≈ log λ + log p_kNN: the two differ by log(λ_adaptive / 0.05),
    # with λ_adaptive = σ(20 − d₁) ≈ 1 for these exact matches.
    difference = np.array(adaptive.logprobs.token_logprobs) - np.array(fixed.logprobs.token_logprobs)
    np.testing.assert_allclose(difference, np.log(1 / 0.05), atol=0.05)


def test_streaming_with_vllm_xargs_and_logprobs(knn_server, token_ids):
    ids = token_ids["b"]
    n = prefix_length(ids)
    stream = knn_server.openai_client().completions.create(
        model="tiny",
        prompt=ids[:n],
        max_tokens=12,
        temperature=0,
        stream=True,
        logprobs=1,
        extra_body={"vllm_xargs": {"knn_datastore": "b", "knn_lambda": 1.0}},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    logprobs = [lp for c in chunks if c.choices and c.choices[0].logprobs for lp in c.choices[0].logprobs.token_logprobs]
    whole = complete(knn_server, ids[:n], max_tokens=12, knn_datastore="b", knn_lambda=1.0)
    assert text == whole.text and len(logprobs) == 12


def test_chat_completions_accept_knn_xargs(knn_server):
    result = knn_server.openai_client().chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": PREFIX}],
        max_tokens=5,
        temperature=0,
        extra_body={"vllm_xargs": {"knn_lambda": 0.5}},
    )
    assert result.choices[0].message.content is not None and result.usage.completion_tokens >= 1


@pytest.mark.parametrize(
    "xargs, field",
    [
        ({"knn_lambda": 1.5}, "knn_lambda"),
        ({"knn_k": 0}, "knn_k"),
        ({"knn_k": 65}, "knn_k"),
        ({"knn_temperature": -1}, "knn_temperature"),
        ({"knn_datastore": "legal"}, "knn_datastore"),
        ({"knn_lambda": "high"}, "knn_lambda"),
        ({"knn_skip_threshold": 2}, "knn_skip_threshold"),
        ({"knn_pointers": -1}, "knn_pointers"),
        ({"knn_lamda": 0.9}, "knn_lamda"),  # a misspelt knob is refused, not silently ignored
    ],
)
def test_invalid_xargs_are_a_400_naming_the_field(knn_server, xargs, field):
    with pytest.raises(openai.BadRequestError) as e:
        complete(knn_server, PREFIX, max_tokens=2, **xargs)
    assert field in e.value.message and str(next(iter(xargs.values()))) in e.value.message
    assert complete(knn_server, PREFIX, max_tokens=2).token_ids  # and the server keeps serving


def test_overlap_serves_what_is_served_without_it(knn_server, fast_server, token_ids):
    """knn.overlap (the default) starts each step's searches mid-forward, from the op in vLLM's
    compiled graph, unless the LM was confident on every request at its last step (then it
    searches the rows the skip rule keeps after the logits), and applies the skip rule to their
    answers: the same tokens and logprobs as searching after the logits, alone and batched, and
    for prompt logprobs (searched after the forward pass either way)."""
    prompt = token_ids["a"][: len(PREFIX.split()) + 2]
    # + every row skipped; + about half its rows (the tiny model's top probabilities lie near 6e-5),
    # so that alone some of its steps are begun and dropped, and some searched after the logits
    requests = [*MIXED_REQUESTS, *({"knn_datastore": "a", "knn_lambda": 0.9, "knn_skip_threshold": t} for t in (0.0, 5.8e-5))]
    expected = served_with_knn(knn_server, lambda: [complete(knn_server, prompt, **x) for x in requests])
    expected_echo = prompt_logprobs(knn_server, token_ids["b"], knn_datastore="b", knn_lambda=0.5)
    server = fast_server
    alone = [complete(server, prompt, **x) for x in requests]
    with ThreadPoolExecutor(len(requests)) as pool:
        together = list(pool.map(lambda x: complete(server, prompt, **x), requests))
    echo = prompt_logprobs(server, token_ids["b"], knn_datastore="b", knn_lambda=0.5)
    # A request whose every row is skipped: its first step's search ran all the same, begun before
    # the logits existed, and none after it, where the server without overlap searches none of its
    # rows. (Its 6 tokens may take more rows there: drafts are rows too.)
    all_skipped = {"knn_datastore": "a", "knn_skip_threshold": 0.0}
    counted = [rows_counted(s, lambda s=s: complete(s, prompt, max_tokens=6, **all_skipped)) for s in (server, knn_server)]
    for want, *got in zip(expected, alone, together):
        for choice in got:
            assert choice.token_ids == want.token_ids
            np.testing.assert_allclose(choice.logprobs.token_logprobs, want.logprobs.token_logprobs, atol=1e-4)
    np.testing.assert_allclose(echo, expected_echo, atol=1e-4)
    (overlap_skipped, overlap_searched), (skipped, searched) = counted
    assert skipped == 6 and searched == 0
    assert overlap_searched == 1 and overlap_skipped >= 6


def test_compiled_graphs_serve_what_plain_calls_serve(knn_server, fast_server, token_ids):
    """knn.compiled_graphs: once each datastore's shards answer through their Ray Compiled Graphs
    (built in the background from a version's first search, plain calls serving meanwhile), the
    same tokens and logprobs as plain actor calls, alone and batched; knnlm_shard_answers says
    which transport answered."""
    prompt = token_ids["a"][: len(PREFIX.split()) + 2]
    expected = served_with_knn(knn_server, lambda: [complete(knn_server, prompt, **x) for x in MIXED_REQUESTS])
    server = fast_server

    def answers(transport: str) -> dict[str, float]:
        values = scrape_metrics(server.base_url)
        return {
            n: metric_total(values, rf'knnlm_shard_answers_total\{{datastore="{n}",.*transport="{transport}"') for n in ("a", "a3", "b")
        }

    # Every datastore's graphs built and answering now: a round of requests that only graphs
    # answered (graphs idle for knn.graph_idle_s are parked, and plain calls serve while they are
    # built again; the overlap test used this server before).
    deadline = time.monotonic() + 120
    while True:
        graph_before, call_before = answers("graph"), answers("call")
        for name in ("a", "a3", "b"):
            complete(server, prompt, max_tokens=2, knn_datastore=name)
        graph_after, call_after = answers("graph"), answers("call")
        if call_after == call_before and all(graph_after[n] > graph_before[n] for n in graph_after):
            break
        assert time.monotonic() < deadline, f"compiled graphs not all answering after 120 s: {graph_after}, calls {call_after}"
    graph_before, call_before = answers("graph"), answers("call")
    alone = [complete(server, prompt, **x) for x in MIXED_REQUESTS]
    with ThreadPoolExecutor(len(MIXED_REQUESTS)) as pool:
        together = list(pool.map(lambda x: complete(server, prompt, **x), MIXED_REQUESTS))
    graph_after, call_after = answers("graph"), answers("call")
    for want, *got in zip(expected, alone, together):
        for choice in got:
            assert choice.token_ids == want.token_ids
            np.testing.assert_allclose(choice.logprobs.token_logprobs, want.logprobs.token_logprobs, atol=1e-4)
    assert all(graph_after[n] > graph_before[n] for n in graph_after), (graph_before, graph_after)
    assert call_after == call_before  # no step fell back to plain calls


def test_speculative_decoding_serves_what_is_served_without_it(knn_server, fast_server, token_ids):
    """Every draft row gets its own search (or pointers, from the row before it), so vLLM verifies
    the drafts against the kNN-LM itself: the same tokens and logprobs as decoding without drafts,
    with kNN off, the defaults, λ 1, pointers and a batch mixing datastores and knobs. The prompt
    holds the memorised text, so prompt lookup has drafts to propose, and they are accepted. Prompt
    logprobs are served as without speculation."""
    prompt = token_ids["a"] + token_ids["a"][1 : len(PREFIX.split()) + 2]
    requests = [{}, *MIXED_REQUESTS, {"knn_datastore": "a", "knn_lambda": 1.0, "knn_pointers": 1}]
    expected = served_with_knn(knn_server, lambda: [complete(knn_server, prompt, **x) for x in requests])
    server = fast_server
    accepted = metric_total(scrape_metrics(server.base_url), r"vllm:spec_decode_num_accepted_tokens_total")

    def answers():  # each request alone, then all of them in one batch
        alone = [complete(server, prompt, **x) for x in requests]
        with ThreadPoolExecutor(len(requests)) as pool:
            return alone, list(pool.map(lambda x: complete(server, prompt, **x), requests))

    alone, together = served_with_knn(server, answers)
    for xargs, want, *got in zip(requests, expected, alone, together):
        for run, choice in zip(("alone", "together"), got):
            assert choice.token_ids == want.token_ids, f"{xargs} ({run})"
            np.testing.assert_allclose(choice.logprobs.token_logprobs, want.logprobs.token_logprobs, atol=1e-4, err_msg=f"{xargs} ({run})")
    drafted = metric_total(scrape_metrics(server.base_url), r"vllm:spec_decode_num_accepted_tokens_total") - accepted
    assert drafted >= len(requests)  # drafts were verified and accepted
    np.testing.assert_allclose(  # prompt logprobs (the served-perplexity path) are the mixture's too
        prompt_logprobs(server, token_ids["b"], knn_datastore="b", knn_lambda=0.5),
        prompt_logprobs(knn_server, token_ids["b"], knn_datastore="b", knn_lambda=0.5),
        atol=1e-4,
    )


def served_with_knn(server, answer):
    """`answer()`, which `server` must serve with kNN on every row: a row served LM-only (a search
    past the shard deadline) would make a comparison fail for that reason, not the one tested."""
    before = metric_total(scrape_metrics(server.base_url), "knnlm_fallbacks_total")
    result = answer()
    assert metric_total(scrape_metrics(server.base_url), "knnlm_fallbacks_total") == before, "a kNN row was served LM-only"
    return result


def rows_counted(server, send) -> tuple[float, float]:
    """Rows of datastore "a" skipped and searched while `send()` ran."""
    before = scrape_metrics(server.base_url)
    send()
    after = scrape_metrics(server.base_url)
    return tuple(
        metric_total(after, rf'knnlm_{name}_total\{{datastore="a"') - metric_total(before, rf'knnlm_{name}_total\{{datastore="a"')
        for name in ("skipped_rows", "queries")
    )
