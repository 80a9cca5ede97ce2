"""`knnlm-serve` answers OpenAI requests from the official client (real vLLM engine, real HTTP)."""

from __future__ import annotations

import pytest

from conftest import RunningServer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_server(tiny_model_dir, tmp_path_factory):
    config = {"model": str(tiny_model_dir), "served_model_name": "tiny", "enforce_eager": True,
              "kv_cache_gib": 0.25, "max_model_len": 512}
    with RunningServer(config, tmp_path_factory.mktemp("serve")) as server:
        yield server


def test_completion_through_openai_client(tiny_server):
    client = tiny_server.openai_client()
    result = client.completions.create(model="tiny", prompt="Hello, my name is", max_tokens=5, temperature=0)
    assert result.usage.completion_tokens == 5
    again = client.completions.create(model="tiny", prompt="Hello, my name is", max_tokens=5, temperature=0)
    assert again.choices[0].text == result.choices[0].text  # greedy is deterministic
