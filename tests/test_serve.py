"""`knnlm-serve` answers OpenAI requests from the official client (real vLLM engine, real HTTP)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


def test_completion_through_openai_client(plain_tiny_server):
    client = plain_tiny_server.openai_client()
    result = client.completions.create(model="tiny", prompt="Hello, my name is", max_tokens=5, temperature=0)
    assert result.usage.completion_tokens == 5
    again = client.completions.create(model="tiny", prompt="Hello, my name is", max_tokens=5, temperature=0)
    assert again.choices[0].text == result.choices[0].text  # greedy is deterministic


def test_a_server_without_datastores_says_it_serves_the_plain_lm(plain_tiny_server):
    log = plain_tiny_server.log_path.read_text()
    assert "no knn.datastores configured: serving the plain LM, without kNN or the admin API" in log
    assert "knnlm-serve --config configs/default.yaml" in log
