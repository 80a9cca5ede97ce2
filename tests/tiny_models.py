"""Tiny random-weight decoders of every supported architecture, with SmolLM2's real tokenizer.

Architectures we cannot download are still served for real: a 2-layer model of hidden size 64
(head size 32: vLLM's CPU attention rejects 16) builds in a second and starts in vLLM in seconds.
"""

from __future__ import annotations

import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
COMMON = {"vocab_size": 49152, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": True}
LLAMA_SHAPED = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 2048,
}
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64}
# architecture -> (transformers config class, its keyword arguments)
CONFIGS = {
    "LlamaForCausalLM": ("LlamaConfig", LLAMA_SHAPED),
    "Qwen2ForCausalLM": ("Qwen2Config", LLAMA_SHAPED),
    "Qwen3ForCausalLM": ("Qwen3Config", LLAMA_SHAPED),
    "MistralForCausalLM": ("MistralConfig", LLAMA_SHAPED),
    "Gemma2ForCausalLM": ("Gemma2Config", {**LLAMA_SHAPED, "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0}),
    "Phi3ForCausalLM": ("Phi3Config", {**LLAMA_SHAPED, "pad_token_id": 0}),
    "GPT2LMHeadModel": ("GPT2Config", {"n_embd": 64, "n_layer": 2, "n_head": 2, "n_positions": 2048}),
    "OPTForCausalLM": ("OPTConfig", {"hidden_size": 64, "ffn_dim": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
                                     "max_position_embeddings": 2048, "word_embed_proj_dim": 64, "pad_token_id": 0}),
    "Qwen2MoeForCausalLM": ("Qwen2MoeConfig", {**LLAMA_SHAPED, **MOE}),
    "MixtralForCausalLM": ("MixtralConfig", {**LLAMA_SHAPED, "num_local_experts": 4, "num_experts_per_tok": 2}),
}
ARCHITECTURES = tuple(CONFIGS)


def make_tiny_model(architecture: str, out: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    import torch
    import transformers

    config_class, kwargs = CONFIGS[architecture]
    config = getattr(transformers, config_class)(**COMMON, **kwargs)
    config.architectures = [architecture]
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out / name)
    return out
