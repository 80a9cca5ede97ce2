"""Tiny random-weight decoders of every supported architecture, with SmolLM2's real tokenizer.

Why: we cannot download a real checkpoint of each architecture (no network, no budget), yet every
supported architecture must be served through vLLM for real, on CPU. A 2-layer decoder of hidden
size 64 is built by transformers in about a second and started by vLLM in seconds. Head size is 32
because vLLM's CPU attention rejects 16. SmolLM2's tokenizer (vocabulary 49152, bos 1, eos 2) is
copied next to the weights so prompts tokenize as with the default model.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

log = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
# Shared by all: SmolLM2's vocabulary and special ids, and tied input/output embeddings.
COMMON = {"vocab_size": 49152, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "tie_word_embeddings": True}
# Llama naming, used by most: hidden 64, 2 layers, 2 heads of 32 (2 KV heads), MLP 128, 2048 positions.
LLAMA_SHAPED = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 2048,
}
# architecture -> (transformers model_type, config kwargs on top of COMMON)
CONFIGS: dict[str, tuple[str, dict]] = {
    "LlamaForCausalLM": ("llama", LLAMA_SHAPED),
    "Qwen2ForCausalLM": ("qwen2", LLAMA_SHAPED),
    "Qwen3ForCausalLM": ("qwen3", LLAMA_SHAPED),
    "MistralForCausalLM": ("mistral", LLAMA_SHAPED),
    "Gemma2ForCausalLM": ("gemma2", {**LLAMA_SHAPED, "query_pre_attn_scalar": 32}),  # keeps its logit soft-caps
    "Phi3ForCausalLM": ("phi3", LLAMA_SHAPED),
    "GPT2LMHeadModel": ("gpt2", {"n_embd": 64, "n_inner": 128, "n_layer": 2, "n_head": 2, "n_positions": 2048}),
    "OPTForCausalLM": (
        "opt",
        {
            "hidden_size": 64,
            "word_embed_proj_dim": 64,
            "ffn_dim": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "max_position_embeddings": 2048,
        },
    ),
    "Qwen2MoeForCausalLM": (
        "qwen2_moe",
        {
            **LLAMA_SHAPED,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "shared_expert_intermediate_size": 64,
        },
    ),
    "MixtralForCausalLM": ("mixtral", {**LLAMA_SHAPED, "intermediate_size": 64, "num_local_experts": 4, "num_experts_per_tok": 2}),
}
ARCHITECTURES: tuple[str, ...] = tuple(CONFIGS)


def make_tiny_model(architecture: str, out: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """Write a random tiny `architecture` model (seeded) and the tokenizer files of `tokenizer_dir` into `out`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out, tokenizer_dir = Path(out), Path(tokenizer_dir)
    model_type, kwargs = CONFIGS[architecture]
    config = AutoConfig.for_model(model_type, **COMMON, **kwargs)
    config.architectures = [architecture]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    if type(model).__name__ != architecture:
        raise TypeError(f"{model_type} config built {type(model).__name__}, not {architecture}")
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out / name)
    log.info("tiny %s (%d parameters, seed %d) written to %s", architecture, model.num_parameters(), seed, out)
    return out
