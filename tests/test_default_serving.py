"""The README's main job on the real model: SmolLM2 + the embedded datastore, as `make serve` runs it."""

from __future__ import annotations

import heapq
import inspect

import pytest
import yaml

from knnlm_serve.server.process import RunningServer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def default_server(tmp_path_factory):
    config = yaml.safe_load(open("configs/default.yaml"))
    with RunningServer({**config, "kv_cache_gib": 0.5}, tmp_path_factory.mktemp("default"), startup_timeout=900) as server:
        yield server


def test_default_datastore_pulls_completions_onto_the_documentation(default_server):
    client = default_server.openai_client()

    def complete(xargs):
        result = client.completions.create(
            model="smollm2", prompt="heapq.heappush\n\n", max_tokens=24, temperature=0, extra_body={"vllm_xargs": xargs}
        )
        return result.choices[0].text.strip()

    plain, knn = complete({"knn": False}), complete({"knn_lambda": 0.9})
    docs = " ".join(inspect.getdoc(heapq).split())
    assert " ".join(knn.split())[:40] in docs, f"kNN answer {knn!r} is not the datastore's text"
    assert " ".join(plain.split())[:40] not in docs and plain != knn
