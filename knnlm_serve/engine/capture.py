"""The step's key vectors, captured during vLLM's forward pass.

`ffn_input` is the input of the last decoder layer's feed-forward block (knnlm_core.keys's rule,
the one the index builder uses). Its pre-hook is registered when the model is built, before
vLLM compiles it, so Dynamo traces it into the graph. `final` is what `compute_logits` receives.
The model's whole output is kept too: prompt-logprob calls pass views of it.
"""

from __future__ import annotations

import torch

from knnlm_core.config import KeyType
from knnlm_core.keys import ffn_module


class KeyCapture:
    def __init__(self, model: torch.nn.Module):
        self.hidden: torch.Tensor | None = None  # the model's output: final hidden states of every token
        self._ffn_input: torch.Tensor | None = None
        ffn = ffn_module(model)
        self.has_ffn_input = ffn is not None
        if ffn is not None:
            ffn.register_forward_pre_hook(self._capture_ffn_input)
        model.register_forward_hook(self._capture_output)

    def _capture_ffn_input(self, module, args):
        self._ffn_input = args[0]

    def _capture_output(self, module, args, output):
        self.hidden = output if isinstance(output, torch.Tensor) else None

    def keys(self, key_type: KeyType, token_index: torch.Tensor, final_rows: torch.Tensor) -> torch.Tensor:
        """Query vectors for the rows at `token_index`; `final_rows` are those rows' final hidden states."""
        if key_type == "final":
            return final_rows
        if self._ffn_input is None or self.hidden is None or self._ffn_input.shape[0] != self.hidden.shape[0]:
            raise RuntimeError("knnlm: the last FFN block's input was not captured this step (a compiled graph without the hook?)")
        return self._ffn_input[token_index]
