"""A served model's directory: is it a causal LM vLLM can load, what is it, and its fingerprint.

The fingerprint ties a datastore to the model whose hidden states are its keys: `knnlm-index`
stamps it into the manifest and the server refuses a datastore whose stamp differs.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from knnlm_core.errors import ModelError

_WEIGHT_SUFFIXES = (".safetensors", ".bin")


def cache_dir() -> Path:
    return Path(os.environ.get("KNNLM_CACHE_DIR", Path.home() / ".cache" / "knnlm-serve"))


def model_config(model_dir: str | os.PathLike) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text())


def hidden_size_of(model_dir: str | os.PathLike) -> int:
    """The width of the model's hidden states, whatever its config calls it (GPT-2: n_embd)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir).hidden_size


def architecture_of(model_dir: str | os.PathLike) -> str:
    """The model's (first) architecture name, as vLLM resolves it."""
    return (model_config(model_dir).get("architectures") or ["?"])[0]


def check_model_dir(path: str | os.PathLike) -> Path:
    """Return `path` if it is an HF causal-LM directory vLLM can load, else raise a ModelError."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise ModelError(f"model path {path} does not exist or is not a directory; pass an HF model directory")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelError(f"{path} has no config.json, so it is not a Hugging Face model directory")
    architectures = json.loads(config_file.read_text()).get("architectures") or []
    if not any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in architectures):
        raise ModelError(f"{path} is not a causal language model (architectures={architectures}); kNN-LM needs a *ForCausalLM model")
    if not any(p.suffix in _WEIGHT_SUFFIXES for p in path.iterdir()):
        raise ModelError(f"{path} has no weight files (*.safetensors or *.bin)")
    return path


def model_fingerprint(model_dir: str | os.PathLike) -> str:
    """A short stable hash of what decides the key vectors: config, tokenizer and weights.

    Weight files are hashed by size plus 16 evenly spaced 1 MiB blocks, so fingerprinting a
    multi-GB model takes milliseconds while any re-quantisation or fine-tune still changes it.
    """
    model_dir = check_model_dir(model_dir)
    h = hashlib.sha256()
    config = json.loads((model_dir / "config.json").read_text())
    for volatile in ("_name_or_path", "name_or_path", "transformers_version", "torch_dtype", "dtype"):
        config.pop(volatile, None)
    h.update(json.dumps(config, sort_keys=True).encode())
    for name in ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt"):
        if (model_dir / name).is_file():
            h.update(name.encode())
            h.update(hashlib.sha256((model_dir / name).read_bytes()).digest())
    for weights in sorted(p for p in model_dir.iterdir() if p.suffix in _WEIGHT_SUFFIXES):
        h.update(weights.name.encode())
        h.update(_sampled_file_hash(weights))
    return h.hexdigest()[:16]


def _sampled_file_hash(path: Path, blocks: int = 16, block_size: int = 1 << 20) -> bytes:
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        for i in range(blocks):
            f.seek(max(0, (size - block_size) * i // max(1, blocks - 1)))
            h.update(f.read(block_size))
    return h.digest()
