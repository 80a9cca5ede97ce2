"""The default model is converted faithfully, model directories are validated, fingerprints."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from knnlm_core.default_model import default_gguf_path, resolve_model
from knnlm_core.errors import ModelError
from knnlm_core.model_dir import check_model_dir, model_fingerprint


def test_missing_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(ModelError, match="does not exist"):
        check_model_dir(tmp_path / "nope")


def test_directory_without_config_is_rejected(tmp_path):
    with pytest.raises(ModelError, match="no config.json"):
        check_model_dir(tmp_path)


def test_non_causal_lm_is_rejected(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertModel"]}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelError, match="not a causal language model"):
        check_model_dir(tmp_path)


def test_missing_default_cache_says_how_to_prepare(tmp_path, monkeypatch):
    monkeypatch.setenv("KNNLM_CACHE_DIR", str(tmp_path))
    with pytest.raises(ModelError, match="prepare-model"):
        resolve_model("default")


def test_fingerprint_is_stable_and_sees_weight_changes(tiny_model_dir, tmp_path):
    copy = shutil.copytree(tiny_model_dir, tmp_path / "copy")
    assert model_fingerprint(tiny_model_dir) == model_fingerprint(copy)
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-100] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert model_fingerprint(copy) != model_fingerprint(tiny_model_dir)


@pytest.mark.slow
def test_converted_model_matches_direct_gguf_load(smollm2_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = default_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    ids = tokenizer("Nearest neighbour language models retrieve", return_tensors="pt").input_ids
    with torch.no_grad():
        converted = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)(ids).logits
        direct = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)(ids).logits
    np.testing.assert_allclose(converted.numpy(), direct.numpy(), atol=1e-3)
    assert torch.equal(converted[0, -1].argmax(), direct[0, -1].argmax())
