"""Shared fixtures: the real default model, a tiny random Llama that vLLM loads in seconds."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from knnlm_serve.model import prepare_default_model

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real SmolLM2-135M-Instruct, converted once into the user cache (about 30 s cold)."""
    return prepare_default_model()


def make_tiny_llama(out: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """A random 2-layer Llama (hidden 64) with the default model's real tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,  # vLLM's CPU attention supports head sizes 32, 64, 80, ...
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out / name)
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smollm2_dir) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), smollm2_dir)


TINY_SERVER = {"served_model_name": "tiny", "enforce_eager": True, "kv_cache_gib": 0.25, "max_model_len": 512}


@pytest.fixture(scope="session")
def plain_tiny_server(tiny_model_dir, tmp_path_factory):
    """Stock vLLM behaviour: the tiny model served with no datastore."""
    with RunningServer({**TINY_SERVER, "model": str(tiny_model_dir)}, tmp_path_factory.mktemp("plain")) as server:
        yield server


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RunningServer:
    """A `knnlm-serve` subprocess on a free port; stopped (process group) on exit."""

    def __init__(self, config: dict, workdir: Path, startup_timeout: float = 300):
        import yaml

        self.port = free_port()
        self.config_path = workdir / "serve.yaml"
        self.config_path.write_text(yaml.safe_dump({**config, "port": self.port, "host": "127.0.0.1"}))
        self.log_path = workdir / "serve.log"
        self.startup_timeout = startup_timeout
        self.base_url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "RunningServer":
        import os
        import subprocess
        import sys
        import time
        import urllib.request

        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "knnlm_serve.cli", "--config", str(self.config_path)],
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True, env=os.environ.copy(),
        )
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                urllib.request.urlopen(f"{self.base_url}/v1/models", timeout=2)
                return self
            except OSError:
                time.sleep(1)
        self.__exit__(None, None, None)
        raise TimeoutError(f"server did not start in {self.startup_timeout}s:\n{self.log_tail()}")

    def __exit__(self, *exc) -> None:
        import os
        import signal

        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=30)
        except (ProcessLookupError, TimeoutError, Exception):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._log.close()

    def log_tail(self, n: int = 4000) -> str:
        return self.log_path.read_text()[-n:]

    def openai_client(self):
        import openai

        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key="unused")
