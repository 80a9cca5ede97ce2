"""Key vectors: which module's input is the key, and the HF encoder that computes them offline.

One rule decides where a key comes from, for transformers' models (`knnlm-index`, `knnlm-eval`)
and for vLLM's (the server's capture hook), so the keys stored are the keys queried:
  * `final`: the hidden state the LM head receives (vLLM: what `compute_logits` receives);
  * `ffn_input`: the input of the last decoder layer's feed-forward block. The decoder layers are
    the first `nn.ModuleList` in the module tree (pre-order: it comes before any experts list
    inside it); the block is the last layer's first child named in `FFN_NAMES` (MoE blocks
    included; `fc1` is OPT-style layers' first FFN projection, after their FFN norm).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from knnlm_core.config import KeyType
from knnlm_core.errors import ModelError
from knnlm_core.windows import WindowPlan, fed_tokens

FFN_NAMES = ("mlp", "feed_forward", "ffn", "block_sparse_moe", "fc1")


def ffn_module(model: torch.nn.Module) -> torch.nn.Module | None:
    """The last decoder layer's feed-forward block, or None when the architecture has none."""
    layers = next((m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 0), None)
    if layers is None:
        return None
    last = layers[len(layers) - 1]
    return next((getattr(last, name) for name in FFN_NAMES if isinstance(getattr(last, name, None), torch.nn.Module)), None)


def no_ffn_input_error(architecture: str) -> ModelError:
    return ModelError(
        f"key type ffn_input is not available for {architecture}: its last decoder layer has no feed-forward "
        f"block named one of {FFN_NAMES}; use key type final (--key-type final)"
    )


def key_module(model: torch.nn.Module, key_type: KeyType, architecture: str) -> torch.nn.Module:
    """The module whose *input* is the key in a transformers model."""
    if key_type == "final":
        return model.get_output_embeddings()
    module = ffn_module(model)
    if module is None:
        raise no_ffn_input_error(architecture)
    return module


def supports_ffn_input(model_dir: Path) -> bool:
    """Whether the rule finds an FFN block, from the model's skeleton on the meta device (no weights)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return ffn_module(model) is not None


def model_shape(model_dir: Path, key_type: KeyType) -> tuple[int, int]:
    """(key dimension, vocabulary size) from the model's config, without loading its weights; a
    key type the architecture has not is refused."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    if key_type == "ffn_input" and not supports_ffn_input(model_dir):
        raise no_ffn_input_error((config.architectures or [config.model_type])[0])
    return config.hidden_size, config.vocab_size


class _Captured(Exception):
    """Raised by the capture hook to stop the forward pass once the key vector exists."""


class KeyEncoder:
    """Runs the HF model over right-padded windows and returns the key vectors. Without targets it
    stops the forward pass at the key (skipping the rest of the network and the LM head); with
    targets (calibration) it runs to the end and also scores log p_LM(target) at every position."""

    def __init__(self, model_dir: Path, key_type: KeyType, dtype: str, device: str | None = None):
        from transformers import AutoModelForCausalLM

        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(self.device).eval()
        architecture = (self.model.config.architectures or [type(self.model).__name__])[0]
        self.module = key_module(self.model, key_type, architecture)
        self.dim = self.model.config.hidden_size
        self._captured: torch.Tensor | None = None
        self._stop_at_key = True
        self.module.register_forward_pre_hook(self._capture)

    def _capture(self, module, args):
        self._captured = args[0]
        if self._stop_at_key:
            raise _Captured

    @torch.inference_mode()
    def encode(self, token_batches: list[np.ndarray]) -> list[np.ndarray]:
        """Key vectors [len(tokens), dim] (float32) for each right-padded sequence of the batch."""
        return self._run(token_batches, None)[0]

    @torch.inference_mode()
    def encode_and_score(self, token_batches: list[np.ndarray], targets: list[np.ndarray]) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Key vectors and scores [len(tokens), 2] for each sequence (targets[i][j] follows position j):
        log p_LM(target) and log p_LM of the LM's own top token (the confidence adaptive retrieval skips on)."""
        return self._run(token_batches, targets)

    def _run(self, token_batches, targets):
        ids, lengths = pad_right(token_batches)
        self._stop_at_key = targets is None
        try:
            # Causal attention: right padding never reaches the real positions, so no mask.
            out = self.model(input_ids=ids.to(self.device), use_cache=False)
        except _Captured:
            out = None
        # [batch, length, dim]; some blocks (OPT's fc1) see the batch flattened to [batch * length, dim]
        keys = self._captured.reshape(ids.shape[0], ids.shape[1], -1).float().cpu().numpy()
        scores = []
        if targets is not None:
            for i, (n, target) in enumerate(zip(lengths, targets)):
                log_p = torch.log_softmax(out.logits[i, :n].float(), dim=-1)
                target = torch.tensor(target, device=log_p.device).long()  # a copy: targets may be a read-only memmap
                of_target = log_p.gather(1, target[:, None])[:, 0]
                scores.append(torch.stack([of_target, log_p.max(dim=1).values], dim=1).cpu().numpy())
        return [keys[i, :n] for i, n in enumerate(lengths)], scores


def encode_windows(
    encoder: KeyEncoder,
    tokens: np.ndarray,
    plan: WindowPlan,
    out: np.ndarray,
    batch_size: int,
    *,
    log_p_out: np.ndarray | None = None,
    top_log_p_out: np.ndarray | None = None,
    first_batch: int = 0,
    after_batch: Callable[[int], None] | None = None,
    progress: bool = True,
    desc: str = "encode",
) -> float:
    """Write every entry's key into `out` [entries, dim] in plan order, batch by batch from
    `first_batch` (to resume); `after_batch(b)` runs once batch b is in `out`. With `log_p_out`
    and `top_log_p_out` [entries], also log p_LM of each entry's value and of the LM's top token at
    that position. Returns tokens/s fed."""
    import time

    windows, offsets = plan.windows, plan.entry_offsets
    starts = range(0, len(windows), batch_size)
    bar = tqdm(total=fed_tokens(plan), unit="tok", unit_scale=True, desc=desc, disable=not progress)
    bar.update(fed_tokens(plan, 0, min(first_batch * batch_size, len(windows))))
    t0, fed = time.monotonic(), 0
    for b in range(first_batch, len(starts)):
        i, j = starts[b], min(starts[b] + batch_size, len(windows))
        batch = [tokens[f:k1] for f, _, k1 in windows[i:j]]
        if log_p_out is None:
            vectors = encoder.encode(batch)
        else:
            vectors, scores = encoder.encode_and_score(batch, [tokens[f + 1 : k1 + 1] for f, _, k1 in windows[i:j]])
            for w, (f, k0, k1), score in zip(range(i, j), windows[i:j], scores):
                log_p_out[offsets[w] : offsets[w + 1]] = score[k0 - f : k1 - f, 0]
                if top_log_p_out is not None:
                    top_log_p_out[offsets[w] : offsets[w + 1]] = score[k0 - f : k1 - f, 1]
        for w, (f, k0, k1), v in zip(range(i, j), windows[i:j], vectors):
            out[offsets[w] : offsets[w + 1]] = v[k0 - f : k1 - f]
        if after_batch is not None:
            after_batch(b)
        fed += fed_tokens(plan, i, j)
        bar.update(fed_tokens(plan, i, j))
    bar.close()
    return fed / max(time.monotonic() - t0, 1e-9)


def pad_right(token_batches: list[np.ndarray]) -> tuple[torch.Tensor, list[int]]:
    lengths = [len(t) for t in token_batches]
    ids = torch.zeros(len(token_batches), max(lengths), dtype=torch.long)
    for i, tokens in enumerate(token_batches):
        ids[i, : lengths[i]] = torch.from_numpy(tokens.astype(np.int64))
    return ids, lengths
