"""Tokens -> windows -> key vectors: the offline half of the (key, next token) pairs.

Every position p of a document (except its last token) becomes one entry: key = the model's
vector at p (`final` or `ffn_input`), value = token p+1. Positions are keyed in groups of
`stride`; each group is encoded with up to `context_length - stride` tokens of left context from
its own document, so every position is keyed exactly once and never sees another document.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from knnlm_serve.config import KeyType


@dataclass(frozen=True)
class WindowPlan:
    """windows[i] = (feed_start, key_start, key_end) in global token coordinates."""

    windows: np.ndarray  # int64 [W, 3]
    entry_offsets: np.ndarray  # int64 [W + 1], where window i's entries start in the datastore

    @property
    def entries(self) -> int:
        return int(self.entry_offsets[-1])


def plan_windows(doc_offsets: np.ndarray, context_length: int, stride: int) -> WindowPlan:
    if stride > context_length - 1:
        raise ValueError(f"stride ({stride}) must be below context_length ({context_length})")
    rows = []
    for doc_start, doc_end in zip(doc_offsets[:-1].tolist(), doc_offsets[1:].tolist()):
        for key_start in range(doc_start, doc_end - 1, stride):
            key_end = min(key_start + stride, doc_end - 1)
            rows.append((max(doc_start, key_end - context_length), key_start, key_end))
    windows = np.array(rows, dtype=np.int64).reshape(-1, 3)
    offsets = np.zeros(len(windows) + 1, dtype=np.int64)
    np.cumsum(windows[:, 2] - windows[:, 1], out=offsets[1:])
    return WindowPlan(windows, offsets)


def window_values(tokens: np.ndarray, plan: WindowPlan) -> np.ndarray:
    """The value (next token) of every entry, in datastore order."""
    return np.concatenate([tokens[k0 + 1 : k1 + 1] for _, k0, k1 in plan.windows]).astype(np.int32)


class _Captured(Exception):
    """Raised by the capture hook to stop the forward pass once the key vector exists."""


def key_module(model: torch.nn.Module, key_type: KeyType) -> torch.nn.Module:
    """The module whose *input* is the key: the LM head (`final`) or the last layer's MLP."""
    if key_type == "final":
        return model.get_output_embeddings()
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or not hasattr(layers[-1], "mlp"):
        raise ValueError(
            f"key type ffn_input needs a Llama-style model (model.layers[-1].mlp); "
            f"{type(model).__name__} has none: use --key-type final"
        )
    return layers[-1].mlp


class KeyEncoder:
    """Runs the HF model over padded windows and returns the key vectors; stops the forward
    pass at the key (skipping the rest of the network and the LM head)."""

    def __init__(self, model_dir: Path, key_type: KeyType, dtype: str, device: str | None = None):
        from transformers import AutoModelForCausalLM

        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(self.device).eval()
        self.module = key_module(self.model, key_type)
        self.dim = self.model.config.hidden_size
        self._captured: torch.Tensor | None = None
        self.module.register_forward_pre_hook(self._capture)

    def _capture(self, module, args):
        self._captured = args[0]
        raise _Captured

    @torch.inference_mode()
    def encode(self, token_batches: list[np.ndarray]) -> list[np.ndarray]:
        """Key vectors [len(tokens), dim] (float32) for each right-padded sequence of the batch."""
        ids, lengths = pad_right(token_batches)
        try:
            # Causal attention: right padding never reaches the real positions, so no mask.
            self.model(input_ids=ids.to(self.device), use_cache=False)
        except _Captured:
            pass
        keys = self._captured.float().cpu().numpy()
        return [keys[i, :n] for i, n in enumerate(lengths)]


def pad_right(token_batches: list[np.ndarray]) -> tuple[torch.Tensor, list[int]]:
    lengths = [len(t) for t in token_batches]
    ids = torch.zeros(len(token_batches), max(lengths), dtype=torch.long)
    for i, tokens in enumerate(token_batches):
        ids[i, : lengths[i]] = torch.from_numpy(tokens.astype(np.int64))
    return ids, lengths
