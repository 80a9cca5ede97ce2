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
