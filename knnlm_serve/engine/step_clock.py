"""Where one step's kNN time goes: laps of the work on the step's path, observed once per step.

A step's kNN work starts mid-forward (knn.overlap: planning and sending the search at the last
layer's FFN input) and ends in `compute_logits`; the forward pass between the two is not kNN's
and is not counted. Each lap is charged to the part named when it ends, so the parts add up to
`knnlm_step_seconds`, and `knnlm_step_part_seconds{part}` shows which part to cut.
"""

from __future__ import annotations

import time
from enum import IntEnum

from knnlm_serve import metrics


class Part(IntEnum):
    PLAN = 0  # the step's rows resolved to requests and grouped by datastore version
    KEYS = 1  # the rows' query vectors to the host, and their pointer candidates
    SEND = 2  # the search sent to the shards
    CONFIDENCE = 3  # the LM's log-softmax for the skip rule and the mix
    WAIT = 4  # waiting for the shards' answers and merging them
    NEIGHBOURS = 5  # the answers made into each row's neighbours, λ and τ
    MIX = 6  # p_kNN mixed into the logits
    RECORD = 7  # neighbours kept for the next step, explanations, metrics


PARTS = tuple(part.name.lower() for part in Part)  # the metric's `part` labels, in order


class StepClock:
    __slots__ = ("seconds", "_last")

    def __init__(self):
        self.seconds = [0.0] * len(Part)
        self._last = time.perf_counter()

    def lap(self, part: Part) -> None:
        """Charge the time since the last lap (or resume) to `part`."""
        now = time.perf_counter()
        self.seconds[part] += now - self._last
        self._last = now

    def resume(self) -> None:
        """Start counting again after time that was not kNN's (the rest of the forward pass)."""
        self._last = time.perf_counter()

    def total(self) -> float:
        return sum(self.seconds)

    def observe(self) -> None:
        metrics.STEP_SECONDS.observe(self.total())
        for part, seconds in zip(PARTS, self.seconds):
            metrics.child(metrics.STEP_PART_SECONDS, part).inc(seconds)
