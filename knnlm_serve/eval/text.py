"""The held-out text, windowed exactly as the index builder windows a corpus (each token scored once)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from knnlm_core.config import EvalConfig
from knnlm_core.corpus import find_files, skipped_reason, tokenize_files
from knnlm_core.errors import KnnlmError
from knnlm_core.windows import WindowPlan, plan_windows, window_values


class EvalError(KnnlmError):
    """An evaluation that cannot run as asked; the message names the input and the fix."""


@dataclass(frozen=True)
class EvalText:
    """The tokenized text, its windows, and the scored positions: position p predicts tokens[p+1]."""

    tokens: np.ndarray  # int32 [N]
    documents: int
    plan: WindowPlan
    targets: np.ndarray  # int32 [T], in window order
    tune: np.ndarray  # bool [T]: the tuning part (the first tune_fraction of targets)


def load_eval_text(inputs: list[str | Path], model_dir: Path, config: EvalConfig) -> EvalText:
    """Read the text like the index builder does (same formats, same tokenizer call)."""
    skipped: list[str] = []
    tokens, offsets = tokenize_files(find_files(inputs), model_dir, text_field=config.text_field, skipped=skipped)
    where = ", ".join(map(str, inputs))
    if offsets[-1] == 0:
        raise EvalError(f"the eval text ({where}) is empty" + (f": {skipped_reason(skipped)}" if skipped else ""))
    if offsets[-1] < config.context_length:
        raise EvalError(
            f"the eval text ({where}) has {offsets[-1]} tokens, fewer than one window of --context-length "
            f"{config.context_length}; pass a longer text or a smaller --context-length"
        )
    plan = plan_windows(offsets, config.context_length, config.stride)
    targets = window_values(tokens, plan)
    tune = np.arange(len(targets)) < max(1, round(config.tune_fraction * len(targets)))
    return EvalText(tokens, len(offsets) - 1, plan, targets, tune)
