"""kNN-LM for every supported decoder: a tiny random model of each architecture, built, served, checked.

Per architecture (README's list = this matrix): `knnlm-index build` then `knnlm-serve` reproduces a
memorised continuation at λ = 1; the builder's keys are the served keys (the served p_kNN equals a
NumPy recomputation from the builder's encoder and the same index, for both key types); and
`knn: false` is plain vLLM, token for token and logprob for logprob.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from conftest import STRICT_KNN, greedy, prompt_logprobs
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
    plain: dict


def complete(server, prompt, **xargs):
    choice = greedy(server, prompt, CONTINUATION, **xargs)
    return {"tokens": choice.token_ids, "logprobs": np.array(choice.logprobs.token_logprobs)}


@pytest.fixture(scope="module", params=ARCHITECTURES)
def served(request, smollm2_dir, tmp_path_factory):
    architecture = request.param
    work = tmp_path_factory.mktemp(architecture)
    model = make_tiny_model(architecture, work / "model", smollm2_dir)
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model)(TEXT).input_ids
    (work / "text.txt").write_text(TEXT)
    datastores = {}
    for key_type in KEY_TYPES:
        config = BuildConfig(index="flat", key_type=key_type, context_length=128, stride=64)
        build_datastore([work / "text.txt"], work / key_type, model, config, progress=False)
        datastores[key_type] = work / key_type
    prompt = ids[: len(ids) - CONTINUATION]
    (work / "plain").mkdir()
    with RunningServer({**SERVER, "model": str(model)}, work / "plain") as plain:
        reference = {"completion": complete(plain, prompt), "prompt_logprobs": prompt_logprobs(plain, ids)}
    knn = {"datastores": {k: str(v) for k, v in datastores.items()}, "backend": "local", "k": K, "max_k": K, **STRICT_KNN}
    with RunningServer({**SERVER, "model": str(model), "knn": knn}, work) as server:
        yield Served(architecture, model, ids, datastores, server, reference)


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
    assert off["tokens"] == served.plain["completion"]["tokens"], served.architecture
    np.testing.assert_allclose(off["logprobs"], served.plain["completion"]["logprobs"], atol=1e-5)
    np.testing.assert_allclose(prompt_logprobs(served.server, served.ids, knn=False), served.plain["prompt_logprobs"], atol=1e-5)
