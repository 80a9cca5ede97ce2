"""The step's key vectors, captured during vLLM's forward pass.

`ffn_input` is the input of the last decoder layer's feed-forward block (knnlm_core.keys's rule,
the one the index builder uses). Its pre-hook is registered when the model is built, before
vLLM compiles it, so Dynamo traces it into the graph. `final` is what `compute_logits` receives.
The model's whole output is kept too: prompt-logprob calls pass views of it.

The pre-hook also calls the `knnlm::key_ready` op: opaque to Dynamo and Inductor, so it runs as
Python at that point of every forward pass, compiled or not, and hands the FFN input to whoever
listens (KnnLogits.key_ready, which starts the step's searches there with knn.overlap). Under
CUDA graphs it is a boundary between the captured pieces (vllm_adapter.eager_at_replay), so
replays run it too.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from knnlm_core.config import KeyType
from knnlm_core.keys import ffn_module

_listener: Callable[[torch.Tensor], None] | None = None  # one model, so one listener, per worker process
KEY_READY_OP = "knnlm::key_ready"


# Declared as mutating its argument, though it only reads it: the compiler keeps an op that
# mutates and orders the FFN block after it; one without outputs or mutations would be dropped.
@torch.library.custom_op(KEY_READY_OP, mutates_args=("ffn_input",))
def key_ready(ffn_input: torch.Tensor) -> None:
    if _listener is not None:
        _listener(ffn_input)


@key_ready.register_fake
def _(ffn_input: torch.Tensor) -> None:
    return None


class KeyCapture:
    def __init__(self, model: torch.nn.Module):
        self.hidden: torch.Tensor | None = None  # the model's output: final hidden states of every token
        self._ffn_input: torch.Tensor | None = None
        ffn = ffn_module(model)
        self.has_ffn_input = ffn is not None
        if ffn is not None:
            ffn.register_forward_pre_hook(self._capture_ffn_input)
        model.register_forward_hook(self._capture_output)

    @staticmethod
    def listen(callback: Callable[[torch.Tensor], None] | None) -> None:
        """Call `callback(ffn_input)` in the middle of each forward pass, when the keys exist."""
        global _listener
        _listener = callback

    def _capture_ffn_input(self, module, args):
        self._ffn_input = args[0]
        torch.ops.knnlm.key_ready(args[0])

    def _capture_output(self, module, args, output):
        self.hidden = output if isinstance(output, torch.Tensor) else None

    def keys(self, key_type: KeyType, token_index: torch.Tensor, final_rows: torch.Tensor) -> torch.Tensor:
        """Query vectors for the rows at `token_index`; `final_rows` are those rows' final hidden states."""
        if key_type == "final":
            return final_rows
        if self._ffn_input is None or self.hidden is None or self._ffn_input.shape[0] != self.hidden.shape[0]:
            raise RuntimeError("knnlm: the last FFN block's input was not captured this step (a compiled graph without the hook?)")
        return self._ffn_input[token_index]
