"""kNN-LM for every supported decoder: a tiny random model of each architecture, built, served, checked.

Per architecture (README's list = this matrix): `knnlm-index build` then `knnlm-serve` reproduces a
memorised continuation at λ = 1; the builder's keys are the served keys (the served p_kNN equals a
NumPy recomputation from the builder's encoder and the same index, for both key types); and
`knn: false` is plain vLLM (without our plugin: tests/plain_vllm.py, every architecture in one
process), token for token and logprob for logprob.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from conftest import STRICT_KNN, greedy, prompt_logprobs, starting
from tiny_models import ARCHITECTURES, make_tiny_model

from index_builder.build import build_datastore
from knnlm_core.config import BuildConfig
from knnlm_core.datastore import read_manifest
from knnlm_core.keys import KeyEncoder
from knnlm_core.mixture import knn_log_prob
from knnlm_core.search import open_shards
from knnlm_serve.engine.plugin import SUPPORTED_ARCHITECTURES
from knnlm_serve.server.process import RunningServer

pytestmark = pytest.mark.slow

TEXT = (
    "The ferry to the glass island leaves at dawn from the third pier, and its captain, a woman named Ilse, "
    "sings the names of the drowned lighthouses while the engine warms."
)
SERVER = {"served_model_name": "tiny", "enforce_eager": True, "kv_cache_gib": 0.25, "max_model_len": 256}
CONTINUATION = 12
KEY_TYPES = ("ffn_input", "final")
K = 64  # more than the datastore's entries: p_kNN over every entry, so it depends on every distance


def test_the_matrix_is_the_supported_list():
    assert tuple(ARCHITECTURES) == SUPPORTED_ARCHITECTURES


@dataclass
class Served:
    architecture: str
    model: Path
    ids: list[int]
    datastores: dict[str, Path]
    server: RunningServer
    plain: Plain


@dataclass
class Built:
    model: Path
    ids: list[int]
    datastores: dict[str, Path]
    work: Path


def complete(server, prompt, **xargs):
    choice = greedy(server, prompt, CONTINUATION, **xargs)
    return {"tokens": choice.token_ids, "logprobs": np.array(choice.logprobs.token_logprobs)}


@pytest.fixture(scope="module")
def built(smollm2_dir, tmp_path_factory) -> dict[str, Built]:
    """Each architecture's tiny model and its datastore of TEXT, one per key type."""
    from transformers import AutoTokenizer

    out = {}
    for architecture in ARCHITECTURES:
        work = tmp_path_factory.mktemp(architecture)
        model = make_tiny_model(architecture, work / "model", smollm2_dir)
        (work / "text.txt").write_text(TEXT)
        datastores = {}
        for key_type in KEY_TYPES:
            config = BuildConfig(index="flat", key_type=key_type, context_length=128, stride=64)
            build_datastore([work / "text.txt"], work / key_type, model, config, progress=False)
            datastores[key_type] = work / key_type
        out[architecture] = Built(model, AutoTokenizer.from_pretrained(model)(TEXT).input_ids, datastores, work)
    return out


class Plain:
    """What plain vLLM (no plugin) answers for each architecture, all in one process
    (tests/plain_vllm.py), run beside the servers' starts: `answers()` waits for it."""

    def __init__(self, built: dict[str, Built], work: Path):
        spec = [
            {
                "model": str(b.model),
                "prompt": b.ids[: len(b.ids) - CONTINUATION],
                "ids": b.ids,
                "max_tokens": CONTINUATION,
                "max_model_len": SERVER["max_model_len"],
                "kv_cache_gib": SERVER["kv_cache_gib"],
            }
            for b in built.values()
        ]
        (work / "spec.json").write_text(json.dumps(spec))
        self.out, self.architectures = work / "out.json", list(built)
        self.log = open(work / "plain.log", "w")
        script = Path(__file__).with_name("plain_vllm.py")
        command = [sys.executable, str(script), str(work / "spec.json"), str(self.out)]
        self.run = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT)
        self._answers: dict[str, dict] | None = None

    def answers(self, architecture: str) -> dict:
        if self._answers is None:
            assert self.run.wait() == 0, Path(self.log.name).read_text()[-4000:]
            self._answers = {
                name: {
                    "completion": {"tokens": a["tokens"], "logprobs": np.array(a["logprobs"])},
                    "prompt_logprobs": np.array(a["prompt_logprobs"]),
                }
                for name, a in zip(self.architectures, json.loads(self.out.read_text()))
            }
        return self._answers[architecture]

    def close(self) -> None:
        self.run.kill()
        self.run.wait()
        self.log.close()


@pytest.fixture(scope="module")
def plain(built, tmp_path_factory):
    plain = Plain(built, tmp_path_factory.mktemp("plain"))
    yield plain
    plain.close()


class StartedAhead:
    """Each architecture's server, started while the one before it starts and is tested (two starts
    share the suite's two cores where one would leave a core idle), and stopped once its
    architecture's tests are done."""

    def __init__(self, built: dict[str, Built]):
        self.built, self.order = built, list(built)
        self.started: dict[str, tuple[contextlib.ExitStack, Future]] = {}

    def _start(self, architecture: str) -> None:
        if architecture not in self.started:
            b = self.built[architecture]
            knn = {"datastores": {k: str(v) for k, v in b.datastores.items()}, "backend": "local", "k": K, "max_k": K, **STRICT_KNN}
            stack = contextlib.ExitStack()
            start = stack.enter_context(starting(RunningServer({**SERVER, "model": str(b.model), "knn": knn}, b.work)))
            self.started[architecture] = (stack, start)

    def server(self, architecture: str) -> RunningServer:
        self._start(architecture)
        after = self.order[self.order.index(architecture) + 1 :]
        if after:
            self._start(after[0])
        return self.started[architecture][1].result()

    def stop(self, architecture: str) -> None:
        self.started.pop(architecture)[0].close()

    def close(self) -> None:
        for architecture in list(self.started):
            self.stop(architecture)


@pytest.fixture(scope="module")
def servers(built):
    ahead = StartedAhead(built)
    yield ahead
    ahead.close()


@pytest.fixture(scope="module", params=ARCHITECTURES)
def served(request, built, plain, servers):
    architecture = request.param
    b = built[architecture]
    yield Served(architecture, b.model, b.ids, b.datastores, servers.server(architecture), plain)
    servers.stop(architecture)


@pytest.mark.parametrize("key_type", KEY_TYPES)
def test_lambda_one_reproduces_the_memorised_continuation(served, key_type):
    n = len(served.ids) - CONTINUATION
    out = complete(served.server, served.ids[:n], knn_datastore=key_type, knn_lambda=1.0)
    assert out["tokens"] == served.ids[n:], served.architecture


@pytest.mark.parametrize("key_type", KEY_TYPES)
def test_the_builders_keys_are_the_served_keys(served, key_type):
    """λ = 1: the served log p is log p_kNN alone, a function of the distances from the served key to
    every stored key; recompute it from the builder's own encoder on the same text and compare."""
    ids = np.array(served.ids)
    keys = KeyEncoder(served.model, key_type, "float32").encode([ids[:-1]])[0]
    root = served.datastores[key_type]
    (searcher,) = open_shards(root, read_manifest(root))
    distances, found = searcher.index.search(keys, searcher.ntotal)
    tau = float(np.median(distances))  # a temperature at the distances' own scale: every distance counts
    expected = knn_log_prob(distances, searcher.values[found] == ids[1:, None], searcher.ntotal, tau)
    served_lp = prompt_logprobs(served.server, served.ids, knn_datastore=key_type, knn_lambda=1.0, knn_temperature=tau)
    np.testing.assert_allclose(served_lp, expected, atol=2e-3, err_msg=served.architecture)


def test_knn_off_is_plain_vllm(served):
    n = len(served.ids) - CONTINUATION
    off = complete(served.server, served.ids[:n], knn=False)
    plain = served.plain.answers(served.architecture)
    assert off["tokens"] == plain["completion"]["tokens"], served.architecture
    np.testing.assert_allclose(off["logprobs"], plain["completion"]["logprobs"], atol=1e-5)
    np.testing.assert_allclose(prompt_logprobs(served.server, served.ids, knn=False), plain["prompt_logprobs"], atol=1e-5)
