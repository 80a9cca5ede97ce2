"""`knnlm-serve` answers OpenAI requests from the official client (real vLLM engine, real HTTP)."""

from __future__ import annotations

import subprocess
import sys

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


@pytest.mark.parametrize(
    "text, where, problem",
    [
        ("knn:\n\tlambda: 1\n", "line 2, column 1", "found character '\\t' that cannot start any token"),
        ("port: 8000\n: : :\n", "line 2, column 1", "expected <block end>, but found ':'"),
    ],
    ids=["tab-indent", "stray-colons"],
)
def test_a_config_file_that_is_not_yaml_is_one_line_naming_the_file_the_place_and_the_problem(tmp_path, text, where, problem):
    (config := tmp_path / "server.yaml").write_text(text)
    result = subprocess.run([sys.executable, "-m", "knnlm_serve.server.launcher", "--config", str(config)], capture_output=True, text=True)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == f"knnlm-serve: error: {config}: not valid YAML at {where}: {problem}"
