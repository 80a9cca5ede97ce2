"""Shared fixtures: the real default model, a tiny random Llama that vLLM loads in seconds, servers."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_models import make_tiny_model

from knnlm_core.default_model import prepare_default_model
from knnlm_serve.server.process import RunningServer


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real SmolLM2-135M-Instruct, converted once into the user cache (about 30 s cold)."""
    return prepare_default_model()


def make_tiny_llama(out: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    return make_tiny_model("LlamaForCausalLM", out, tokenizer_dir, seed=seed)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smollm2_dir) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), smollm2_dir)


TINY_SERVER = {"served_model_name": "tiny", "enforce_eager": True, "kv_cache_gib": 0.25, "max_model_len": 512}


@pytest.fixture(scope="session")
def plain_tiny_server(tiny_model_dir, tmp_path_factory):
    """Stock vLLM behaviour: the tiny model served with no datastore."""
    with RunningServer({**TINY_SERVER, "model": str(tiny_model_dir)}, tmp_path_factory.mktemp("plain")) as server:
        yield server
