"""Exact L2 search as one torch matmul and `torch.topk`, for flat shards and IVF coarse steps.

At kNN-LM's k, FAISS's flat search spends its time selecting the top k; a matmul plus top-k is
faster from a modest amount of work on (`torch_is_faster`, from the search-backend benchmark in
benchmarks/results/). On a CPU with native bf16, candidates come from a bf16 matmul and are then
re-scored exactly in fp32 (`preselect`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

import faiss
import numpy as np

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class FlatKeys:
    """An exact L2 index's keys [N, d] and squared norms [N] as torch tensors, for `torch_search`.
    `low`: a bf16 copy of the keys where the CPU multiplies bf16 natively, for `preselect`."""

    keys: torch.Tensor
    norms: torch.Tensor
    low: torch.Tensor | None = None


def flat_keys(index, on_gpu: bool, bf16: bool = True) -> FlatKeys | None:
    """An exact L2 index's keys for `torch_search`; None for other indexes (IVF, PQ, HNSW, a PCA
    transform in front).

    On CPU the keys are a view of the index's own storage, so they cost no memory but are only valid
    while the index lives (callers keep both); a CPU with native bf16 gets a bf16 copy beside them
    (half the keys' size) unless `bf16` is False. With `on_gpu` and a GPU torch sees, they are
    copied there once (the CPU index stays, for `ShardSearcher.lookup` and the FAISS path)."""
    import torch

    if not isinstance(index, faiss.IndexFlat) or index.metric_type != faiss.METRIC_L2 or index.ntotal == 0:
        return None
    keys = torch.from_numpy(faiss.rev_swig_ptr(index.get_xb(), index.ntotal * index.d).reshape(index.ntotal, index.d))
    keys = keys.to("cuda" if on_gpu and torch.cuda.is_available() else "cpu")
    norms = torch.linalg.vector_norm(keys, dim=1).square_()  # no [N, d] temporary, unlike (keys * keys).sum
    return FlatKeys(keys, norms, keys.bfloat16() if bf16 and keys.device.type == "cpu" and cpu_has_bf16() else None)


@cache
def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX): emulated bf16 is slower than fp32."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


DISTANCE_BLOCK = 1 << 26  # entries of one [queries, keys] distance block (256 MiB): bounds offline batches' memory
# Below this many queries the matmul runs as keys @ queriesᵀ: MKL then streams the keys once
# instead of packing them (faster at small batches, even at 16, slower at 32). A single query is
# padded to two rows: MKL's 2-row matmul beats its matrix-vector product.
KEYS_MAJOR_BELOW = 16
# bf16 matmuls run keys-major below this many queries (faster at 32, even at 64).
BF16_KEYS_MAJOR_BELOW = 64
# `preselect` for k up to this: its exact re-scoring gathers PRESELECT_CANDIDATES(k) keys a query.
PRESELECT_MAX_K = 256


def preselect_candidates(k: int) -> int:
    """Candidates the bf16 pass keeps for re-scoring: twice k, and at least 32 more than k."""
    return k + max(k, 32)


def torch_search(exact: FlatKeys, queries: np.ndarray, k: int, keep: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(squared L2 distances, ids) [n, min(k, N)], nearest first, as IndexFlatL2 answers: one matmul
    |K|² - 2 q·Kᵀ and `torch.topk`, then + |q|² and clamped at 0 like FAISS's own BLAS path, so
    distances match FAISS's to fp32 rounding. At kNN-LM's k FAISS's flat search spends most of its
    time selecting the top k; `torch_is_faster` says when this wins. Entries `keep` (bool per entry)
    leaves out lie at +inf: past the kept ones a row holds (+inf, -1). With a bf16 copy of the keys
    and k up to PRESELECT_MAX_K, candidates come from `preselect` and are re-scored exactly."""
    import torch

    norms = exact.norms
    if keep is not None:
        norms = norms.masked_fill(~torch.from_numpy(np.asarray(keep, dtype=bool)).to(norms.device), float("inf"))
    q = torch.from_numpy(np.ascontiguousarray(queries, dtype=np.float32)).to(exact.keys.device)
    width = min(k, len(exact.keys))
    if exact.low is not None and k <= PRESELECT_MAX_K and preselect_candidates(k) < len(exact.keys):
        candidates = preselect(exact.low, norms, q, preselect_candidates(k))
        distances = (exact.keys[candidates] - q[:, None, :]).square_().sum(dim=2)  # exact fp32, as FAISS's
        distances.masked_fill_(~torch.isfinite(norms[candidates]), float("inf"))
        values, order = torch.topk(distances, width, dim=1, largest=False, sorted=True)
        distances, ids = values.numpy(), candidates.gather(1, order).numpy()
        return distances, np.where(np.isfinite(distances), ids, -1)
    parts = []
    for block in q.split(max(1, DISTANCE_BLOCK // len(exact.keys))):
        rows = block.repeat(2, 1) if len(block) == 1 else block  # a 2-row matmul beats MKL's matrix-vector product
        if len(rows) < KEYS_MAJOR_BELOW:
            scores = torch.addmm(norms[:, None], exact.keys, rows.T, alpha=-2).T
        else:
            scores = torch.addmm(norms, rows, exact.keys.T, alpha=-2)
        values, ids = torch.topk(scores[: len(block)], width, dim=1, largest=False, sorted=True)
        parts.append((values.add_((block * block).sum(dim=1, keepdim=True)).clamp_(min=0), ids))
    distances = torch.cat([d for d, _ in parts]).cpu().numpy()
    ids = torch.cat([i for _, i in parts]).cpu().numpy()
    return distances, np.where(np.isfinite(distances), ids, -1)


def preselect(low: torch.Tensor, norms: torch.Tensor, queries: torch.Tensor, candidates: int) -> torch.Tensor:
    """The `candidates` nearest entry ids per query [n, candidates] by |K|² - 2 q·Kᵀ with the dot
    products taken in bf16 (fp32 accumulation): at a decode step's batch the fp32 matmul is bound by
    reading the keys, and the bf16 copy is half their bytes. Its rounding (~0.4% of a dot product)
    can only swap entries near the edge of the candidates, which are twice k."""
    import torch

    rows = queries.bfloat16()
    if len(rows) < BF16_KEYS_MAJOR_BELOW:
        dots = torch.mm(low, (rows.repeat(2, 1) if len(rows) == 1 else rows).T).T[: len(rows)]
    else:
        dots = torch.mm(rows, low.T)
    return torch.topk(norms - 2 * dots.float(), candidates, dim=1, largest=False, sorted=False).indices


def torch_is_faster(batch: int, entries: int, device: str) -> bool:
    """Whether `torch_search` beats FAISS's flat search for `batch` queries over `entries` keys.

    From benchmarks/results/search_backends.json (its JSON has the per-cell times): FAISS's scan
    wins on little work, torch's matmul + top-k from about 32k query-key pairs on. A single query
    is the exception: FAISS splits its scan across threads and loses from 10k keys, though
    single-threaded it is as fast. On a GPU torch always wins."""
    if device == "cuda":
        return True
    if batch == 1 and faiss.omp_get_max_threads() > 1:
        return entries >= 10_000
    return batch * entries >= 32_768
