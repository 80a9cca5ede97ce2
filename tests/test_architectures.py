"""kNN-LM for every supported decoder: a tiny random model of each architecture, built, served, checked.

Per architecture (README's list = this matrix): `knnlm-index build`, then vLLM's engine with our
plugin (the engine knnlm-eval opens, every architecture in one process: tests/offline_vllm.py)
reproduces a memorised continuation at λ = 1; the builder's keys are the served keys (the served
p_kNN equals a NumPy recomputation from the builder's encoder and the same index, for both key
types); and `knn: false` is plain vLLM (without our plugin, every architecture in a second
process), token for token and logprob for logprob. The serving path above the engine (HTTP,
admission, the registry) does not depend on the architecture: the other modules serve it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from tiny_models import ARCHITECTURES, make_tiny_model

from index_builder.build import build_datastore
from knnlm_core.config import BuildConfig
from knnlm_core.datastore import read_manifest
from knnlm_core.keys import KeyEncoder
from knnlm_core.mixture import knn_log_prob
from knnlm_core.search import open_shards
from knnlm_serve.engine.plugin import SUPPORTED_ARCHITECTURES

pytestmark = pytest.mark.slow

TEXT = (
    "The ferry to the glass island leaves at dawn from the third pier, and its captain, a woman named Ilse, "
    "sings the names of the drowned lighthouses while the engine warms."
)
MAX_MODEL_LEN, KV_CACHE_GIB = 256, 0.25
CONTINUATION = 12
KEY_TYPES = ("ffn_input", "final")
K = 64  # more than the datastore's entries: p_kNN over every entry, so it depends on every distance


def test_the_matrix_is_the_supported_list():
    assert tuple(ARCHITECTURES) == SUPPORTED_ARCHITECTURES


@dataclass
class Built:
    model: Path
    ids: list[int]
    datastores: dict[str, Path]
    work: Path


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


class Offline:
    """tests/offline_vllm.py on `spec`, running beside this process until `answers()` waits for it."""

    def __init__(self, spec: list[dict], work: Path, *mode: str):
        (work / "spec.json").write_text(json.dumps(spec))
        self.out = work / "out.json"
        self.log = open(work / "offline.log", "w")
        script = Path(__file__).with_name("offline_vllm.py")
        self.run = subprocess.Popen(
            [sys.executable, str(script), str(work / "spec.json"), str(self.out), *mode], stdout=self.log, stderr=subprocess.STDOUT
        )

    def answers(self) -> list[list[dict]]:
        assert self.run.wait() == 0, Path(self.log.name).read_text()[-4000:]
        return json.loads(self.out.read_text())

    def close(self) -> None:
        self.run.kill()
        self.run.wait()
        self.log.close()


def keys_check(b: Built, key_type: str) -> tuple[float, np.ndarray]:
    """At λ = 1 the served log p is log p_kNN alone, a function of the distances from the served key
    to every stored key: recompute it from the builder's own encoder on the same text. Returns a
    temperature at the distances' own scale (every distance counts) and the expected log p."""
    ids = np.array(b.ids)
    keys = KeyEncoder(b.model, key_type, "float32").encode([ids[:-1]])[0]
    root = b.datastores[key_type]
    (searcher,) = open_shards(root, read_manifest(root))
    distances, found = searcher.index.search(keys, searcher.ntotal)
    tau = float(np.median(distances))
    return tau, knn_log_prob(distances, searcher.values[found] == ids[1:, None], searcher.ntotal, tau)


@dataclass
class Answers:
    """Per architecture: the kNN engine's answers by check, plain vLLM's, and the expected p_kNN."""

    knn: dict[str, dict[tuple, dict]]
    plain: dict[str, dict[str, dict]]
    expected: dict[str, dict[str, np.ndarray]]


@pytest.fixture(scope="module")
def answers(built, tmp_path_factory) -> Answers:
    """Both engines' answers: plain vLLM starts first and runs while the expected values are
    computed here and the kNN engine runs (two processes for two cores)."""
    n = {a: len(b.ids) - CONTINUATION for a, b in built.items()}
    engine = {"max_model_len": MAX_MODEL_LEN, "kv_cache_gib": KV_CACHE_GIB}

    def completion(a, **xargs):
        return {"prompt": built[a].ids[: n[a]], "max_tokens": CONTINUATION, "xargs": xargs}

    def scored(a, **xargs):
        return {"prompt": built[a].ids, "max_tokens": 1, "xargs": xargs}

    plain = Offline(
        [{"model": str(b.model), **engine, "requests": [completion(a), scored(a)]} for a, b in built.items()],
        tmp_path_factory.mktemp("plain"),
    )
    try:
        expected, checks, spec = {}, {}, []
        for a, b in built.items():
            expected[a], checks[a], requests = {}, [], []
            for key_type in KEY_TYPES:
                tau, expected[a][key_type] = keys_check(b, key_type)
                checks[a] += [("memorised", key_type), ("keys", key_type)]
                requests += [
                    completion(a, knn_datastore=key_type, knn_lambda=1.0),
                    scored(a, knn_datastore=key_type, knn_lambda=1.0, knn_temperature=tau),
                ]
            checks[a] += [("off", "completion"), ("off", "scored")]
            requests += [completion(a, knn=False), scored(a, knn=False)]
            datastores = {k: str(v) for k, v in b.datastores.items()}
            spec.append({"model": str(b.model), **engine, "k": K, "datastores": datastores, "requests": requests})
        knn = Offline(spec, tmp_path_factory.mktemp("knn"), "--knn")
        try:
            knn_answers = knn.answers()
        finally:
            knn.close()
        plain_answers = plain.answers()
    finally:
        plain.close()
    return Answers(
        knn={a: dict(zip(checks[a], got)) for a, got in zip(built, knn_answers)},
        plain={a: {"completion": got[0], "scored": got[1]} for a, got in zip(built, plain_answers)},
        expected=expected,
    )


@pytest.mark.parametrize("architecture", ARCHITECTURES)
@pytest.mark.parametrize("key_type", KEY_TYPES)
def test_lambda_one_reproduces_the_memorised_continuation(answers, built, architecture, key_type):
    ids = built[architecture].ids
    assert answers.knn[architecture]["memorised", key_type]["tokens"] == ids[len(ids) - CONTINUATION :]


@pytest.mark.parametrize("architecture", ARCHITECTURES)
@pytest.mark.parametrize("key_type", KEY_TYPES)
def test_the_builders_keys_are_the_served_keys(answers, architecture, key_type):
    served = np.array(answers.knn[architecture]["keys", key_type]["prompt_logprobs"])
    np.testing.assert_allclose(served, answers.expected[architecture][key_type], atol=2e-3)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_knn_off_is_plain_vllm(answers, architecture):
    off, plain = answers.knn[architecture], answers.plain[architecture]
    assert off["off", "completion"]["tokens"] == plain["completion"]["tokens"]
    np.testing.assert_allclose(off["off", "completion"]["logprobs"], plain["completion"]["logprobs"], atol=1e-5)
    np.testing.assert_allclose(off["off", "scored"]["prompt_logprobs"], plain["scored"]["prompt_logprobs"], atol=1e-5)
