"""test_knn_serving's two servers over the same three datastores (conftest's `knn_serving_starts`,
started ahead from the module before it): the reference server, and the fast server with each of
the reference's references turned on. One fast server for its three comparisons: an engine start is
the suite's largest cost."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

from conftest import STRICT_KNN, TINY_SERVER, in_a_process, starting

from index_builder.build import build_datastore
from knnlm_core.config import BuildConfig
from knnlm_serve.server.process import RunningServer

# Two texts that continue the same prefix differently, each memorised by its own datastore.
PREFIX = "The archive of the northern observatory records that on the first night of winter"
TEXT_A = PREFIX + " the astronomers saw a green comet pass slowly below the pole star, and they wrote its path in red ink."
TEXT_B = PREFIX + " a storm broke every window of the east tower, and the great brass telescope was never used again."
K = 8
DATASTORES = (("a", TEXT_A, 1), ("a3", TEXT_A, 3), ("b", TEXT_B, 1))  # name, text, shards


def build(work: Path, model: Path) -> None:
    config = BuildConfig(index="flat", context_length=128, stride=64)
    for name, text, shards in DATASTORES:
        (work / f"{name}.txt").write_text(text)
        build_datastore([work / f"{name}.txt"], work / name, model, config.model_copy(update={"shards": shards}), progress=False)


def reference_knn(work: Path) -> dict:
    """The reference server's kNN settings, over the datastores `build` makes in `work`."""
    return {
        "datastores": {name: str(work / name) for name, _, _ in DATASTORES},
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


def fast_config(work: Path, model: Path) -> dict:
    """Searches started mid-forward (knn.overlap, under vLLM's compiled graph), shards reached
    through Ray Compiled Graphs, and vLLM's prompt-lookup (`ngram`) speculative decoding."""
    drafts = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    return {
        **TINY_SERVER,
        "enforce_eager": False,
        "model": str(model),
        "knn": {**reference_knn(work), "overlap": True, "compiled_graphs": True},
        "vllm_args": ["--speculative-config", json.dumps(drafts)],
    }


@dataclass
class Starts:
    """The two servers' starts (`starting`'s futures)."""

    reference: Future
    fast: Future


@contextlib.contextmanager
def starting_both(work: Path, fast_dir: Path, model: Path) -> Iterator[Starts]:
    """Both servers starting in the background once the datastores are built in `work`."""
    built = in_a_process(build, work, model)
    reference = RunningServer({**TINY_SERVER, "model": str(model), "knn": reference_knn(work)}, work)
    with (
        starting(reference, prepare=built.result) as reference_start,
        starting(RunningServer(fast_config(work, model), fast_dir), prepare=built.result) as fast_start,
    ):
        yield Starts(reference_start, fast_start)
