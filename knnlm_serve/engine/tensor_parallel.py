"""kNN search on the first tensor-parallel rank only, its answer shared with the other ranks.

Every rank computes the same logits rows; one search per step is enough, and ranks that searched
separately could disagree (a shard timing out for one of them) and sample different tokens."""

from __future__ import annotations

import logging
import time

from knnlm_serve import metrics

logger = logging.getLogger("knnlm_serve")


class FirstRank:
    def __init__(self) -> None:
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        self.rank, self.size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()

    def run(self, search, *args):
        """`search(*args)` on rank 0; every rank gets its result, or raises its error (the others
        would otherwise wait for the broadcast forever)."""
        if self.size == 1:
            return search(*args)
        from vllm.distributed import get_tp_group

        result = None
        if self.rank == 0:
            try:
                result = search(*args)
            except Exception as e:  # noqa: BLE001 - re-raised below, on every rank
                logger.debug("knnlm: kNN search on tensor-parallel rank 0 failed", exc_info=True)
                result = _Failed(f"{type(e).__name__}: {e}")
        started = time.perf_counter()
        result = get_tp_group().broadcast_object(result, src=0)
        rank = str(self.rank)
        metrics.BROADCAST_SECONDS.labels(rank).inc(time.perf_counter() - started)
        metrics.BROADCASTS.labels(rank).inc()
        if isinstance(result, _Failed):
            raise RuntimeError(f"kNN search on tensor-parallel rank 0 failed: {result.error}")
        return result


class _Failed:
    def __init__(self, error: str):
        self.error = error
