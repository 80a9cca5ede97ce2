"""For a group of logits rows of one datastore version: drop the rows the LM is confident on
(adaptive retrieval), find the rest's neighbours (a search, or the successors of the last step's
neighbours: pointer following), mix p_kNN into those rows, record metrics. A search is started
(`start`) and collected (`finish`) separately, so that it can run while the forward pass ends."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from knnlm_core.datastore import EntryValues, load_document_starts, read_manifest
from knnlm_core.mixture import adaptive_lambda, compile_mix, interpolate
from knnlm_core.pointers import RowLinks, linked_candidates, pointer_matrix
from knnlm_serve import metrics
from knnlm_serve.engine.request_params import KnnParams
from knnlm_serve.engine.step_clock import Part, StepClock
from knnlm_serve.retrieval import RetrievalError
from knnlm_serve.runtime import DatastoreInfo, Runtime

logger = logging.getLogger("knnlm_serve")


@dataclass
class Neighbours:
    """What the mix needs per row: the k nearest (padded with +inf / -1 beyond each row's k), λ and τ."""

    distances: np.ndarray  # float32 [n, k_max]
    tokens: np.ndarray  # int32 [n, k_max]
    ids: np.ndarray  # int64 [n, k_max] global entry ids
    lambdas: np.ndarray  # float32 [n]
    temperatures: np.ndarray  # float32 [n]
    followed: np.ndarray  # bool [n]: the row's neighbours are its pointers' successors, not a search


@dataclass
class PendingRows:
    """A group's search in flight: what `KnnMixer.finish` needs to turn its answer into Neighbours."""

    info: DatastoreInfo
    params: list[KnnParams]
    ks: np.ndarray
    follow: np.ndarray  # bool [n]: the row follows pointers (of its own; linked rows are known once answered)
    links: RowLinks | None
    started: float
    sending: float  # seconds that sending the search held the step
    pending: object  # the retriever's pending search, or the RetrievalError that starting it raised


class KnnMixer:
    def __init__(self, retriever):
        self.retriever = retriever
        try:
            compile_mix()
        except Exception:  # noqa: BLE001 - fail open: the first step compiles it, or serves its rows LM-only
            logger.warning("knnlm: the mix's loop did not compile ahead of the first step", exc_info=True)
        self._document_starts: dict[tuple[str, int], np.ndarray | None] = {}
        self._values: dict[tuple[str, int], EntryValues] = {}
        self._scratch = ScratchRows()

    def document_starts(self, info: DatastoreInfo) -> np.ndarray | None:
        """The version's documents.npy (None: not recorded, no pointer following), loaded once."""
        if info.key not in self._document_starts:
            self._document_starts[info.key] = load_document_starts(Path(info.path), read_manifest(info.path))
        return self._document_starts[info.key]

    def values(self, info: DatastoreInfo) -> EntryValues:
        """The version's entries' values (for datastore drafts), memory-mapped once."""
        if info.key not in self._values:
            self._values[info.key] = EntryValues.open(Path(info.path), read_manifest(info.path))
        return self._values[info.key]

    def release(self, keep: set[tuple[str, int]]) -> None:
        self.retriever.release(keep)
        self._document_starts = {key: v for key, v in self._document_starts.items() if key in keep}
        self._values = {key: v for key, v in self._values.items() if key in keep}

    def lm_confidence(self, logits: torch.Tensor, rows: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """(log normaliser, top probability) of the LM at `rows`, each [len(rows)] on the host: from
        one pass a row, for the skip rule and the mix together. Host fp32 logits are reduced by numpy
        on this thread, in the mixer's scratch rows: torch's reductions wake its intra-op threads
        for every operation, a cost that a row or a few rows a step does not repay."""
        if logits.device.type == "cpu" and logits.dtype == torch.float32:
            scratch = self._scratch.rows(len(rows), logits.shape[-1])
            if rows == list(range(len(logits))):
                values = logits.numpy()
            else:
                values = torch.index_select(logits, 0, torch.as_tensor(rows), out=torch.from_numpy(scratch)).numpy()
            largest = values.max(axis=-1)
            np.subtract(values, largest[:, None], out=scratch)
            total = np.exp(scratch, out=scratch).sum(axis=-1)
            return largest + np.log(total), 1 / total  # the top probability is exp(largest - log_z)
        taken = take_rows(logits, rows)
        top = torch.log_softmax(taken, dim=-1).amax(dim=-1)  # amax, not max: the argmax would cost as much as the softmax
        log_z, top = torch.stack((taken.amax(dim=-1) - top, top)).cpu().numpy()  # one copy to the host
        return log_z, np.exp(top)

    @staticmethod
    def rows_to_search(top: np.ndarray, params: list[KnnParams], datastore: str) -> list[int]:
        """Positions of the rows whose LM top probability (`top`) does not exceed their skip
        threshold; the others keep p_LM (adaptive retrieval)."""
        thresholds = np.array([p.skip_threshold for p in params], dtype=np.float32)
        if bool((thresholds >= 1).all()):
            return list(range(len(params)))
        kept = np.flatnonzero(top <= thresholds).tolist()
        metrics.count(metrics.SKIPPED_ROWS, len(params) - len(kept), metrics.datastore_label(datastore))
        return kept

    def start(
        self,
        info: DatastoreInfo,
        keys: np.ndarray,
        params: list[KnnParams],
        runtime: Runtime,
        candidates: list[np.ndarray | None],
        links: RowLinks | None = None,
    ) -> PendingRows:
        """Send the rows' search to the shards; `finish` collects it. A row with at least its
        `min_pointers` candidates (pointer following) is scored against those entries only; the
        others are searched. `links`: rows that may follow an earlier row of this call (the
        retriever's `links_rows`)."""
        ks = np.array([p.k for p in params])
        follow = np.array([c is not None and 0 < p.min_pointers <= len(c) for c, p in zip(candidates, params)], dtype=bool)
        pointers = pointer_matrix([c if f else None for c, f in zip(candidates, follow)])
        started = time.perf_counter()
        try:
            pending = self.retriever.start(info, keys, int(ks.max()), runtime.knn.nprobe or info.nprobe, pointers, links)
        except RetrievalError as e:
            pending = e
        return PendingRows(info, params, ks, follow, links, started, time.perf_counter() - started, pending)

    def finish(self, rows: PendingRows, keep: list[int] | None = None, clock: StepClock | None = None) -> Neighbours | None:
        """The neighbours of a started search's rows (only the rows at positions `keep`, when
        given), or None when no shard answered (the rows are then served LM-only); `clock`: the
        step's, charged the wait, the metrics and the rest."""
        info, params, ks = rows.info, rows.params, rows.ks
        label = metrics.datastore_label(info.name)
        served = len(params) if keep is None else len(keep)
        waiting = time.perf_counter()
        try:
            if isinstance(rows.pending, RetrievalError):
                raise rows.pending
            result = self.retriever.result(rows.pending)
        except RetrievalError as e:
            result = e
        if clock is not None:
            clock.lap(Part.WAIT)
        metrics.child(metrics.RETRIEVAL_WAIT_SECONDS, label).observe(rows.sending + time.perf_counter() - waiting)
        if isinstance(result, RetrievalError):
            metrics.child(metrics.FALLBACKS, label, result.reason).inc(served)
            if served:
                logger.warning("serving %d row(s) LM-only: %s", served, result)
            return None
        metrics.child(metrics.RETRIEVAL_SECONDS, label).observe(time.perf_counter() - rows.started)
        for shard, seconds in result.shard_seconds.items():
            metrics.child(metrics.SHARD_SEARCH_SECONDS, label, shard).observe(seconds)
        for shard, transport in result.transports.items():
            metrics.child(metrics.SHARD_ANSWERS, label, shard, transport).inc()
        if result.shard_seconds:
            metrics.child(metrics.SLOWEST_SHARD_SECONDS, label).observe(max(result.shard_seconds.values()))
        for reason in result.failed_shards.values():
            metrics.child(metrics.FALLBACKS, label, reason).inc(served)
        follow = rows.follow
        if rows.links is not None:  # the linked rows that followed their previous row's pointers, as the shard did
            starts = self.document_starts(info)
            linked = [linked_candidates(rows.links, r, result.ids, result.tokens, starts) is not None for r in range(len(params))]
            follow = follow | np.array(linked, dtype=bool)
        metrics.child(metrics.RETRIEVAL_STEPS, label).inc()
        followed = int(follow.sum())
        metrics.count(metrics.QUERIES, len(follow) - followed, label)  # with overlap, rows the skip rule then dropped too
        metrics.count(metrics.POINTER_ROWS, followed, label)
        metrics.child(metrics.NEIGHBOURS, label).inc(int(ks.sum()))
        if clock is not None:
            clock.lap(Part.RECORD)
        distances, tokens, ids = result.distances, result.tokens, result.ids
        if keep is not None:
            params, ks, follow = [params[i] for i in keep], ks[keep], follow[keep]
            distances, tokens, ids = distances[keep], tokens[keep], ids[keep]
        # Rows that asked for fewer neighbours are padded (new arrays: Ray's answers are read-only views).
        if (ks < distances.shape[1]).any():
            beyond_k = np.arange(distances.shape[1])[None, :] >= ks[:, None]
            distances = np.where(beyond_k, np.float32(np.inf), distances)
            tokens, ids = np.where(beyond_k, -1, tokens), np.where(beyond_k, -1, ids)
        found = Neighbours(
            distances,
            tokens,
            ids,
            self._lambdas(params, distances[:, 0]),
            np.array([p.temperature for p in params], dtype=np.float32),
            follow,
        )
        if clock is not None:
            clock.lap(Part.NEIGHBOURS)
        return found

    @staticmethod
    def _lambdas(params: list[KnnParams], nearest: np.ndarray) -> np.ndarray:
        """Each row's λ: fixed, or adaptive from its nearest neighbour's distance."""
        return np.array(
            [
                p.lambda_
                if p.lambda_ is not None
                else adaptive_lambda(d, p.adaptive_lambda.lambda_max, p.adaptive_lambda.slope, p.adaptive_lambda.center)
                for p, d in zip(params, nearest)
            ],
            dtype=np.float32,
        )

    @staticmethod
    def mix(logits: torch.Tensor, rows: list[int], log_z: np.ndarray, found: Neighbours, datastore: str) -> None:
        """Mix p_kNN into `logits[rows]` in place, given those rows' LM log normalisers."""
        start = time.perf_counter()
        interpolate(logits, np.asarray(rows), log_z, found.distances, found.tokens, found.lambdas, found.temperatures)
        metrics.child(metrics.INTERPOLATION_SECONDS, metrics.datastore_label(datastore)).observe(time.perf_counter() - start)


class ScratchRows:
    """A float32 array kept from step to step for a step's row-sized temporaries. A new one each
    step would be new pages each step: vLLM's processes run with a fixed malloc mmap threshold
    (`SERVING_PROCESS_ENV`), which maps every large buffer afresh. It keeps the largest size asked."""

    def __init__(self):
        self._flat = np.empty(0, dtype=np.float32)

    def rows(self, n: int, width: int) -> np.ndarray:
        """A [n, width] view of the array, grown first if needed; its contents are left over."""
        if self._flat.size < n * width:
            self._flat = np.empty(n * width, dtype=np.float32)
        return self._flat[: n * width].reshape(n, width)


def take_rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """`t[rows]`: `t` itself when `rows` are all of its rows, else through index_select (indexing
    with a list is several times slower)."""
    if rows == list(range(len(t))):
        return t
    return t.index_select(0, torch.as_tensor(rows, device=t.device))
