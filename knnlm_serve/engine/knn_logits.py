"""kNN-LM in a vLLM worker: from one `compute_logits` call to the mixed logits, top to bottom.

Per call (one per step for the sampling rows, more for prompt-logprob rows):
  1. rows: each logits row's token in the step and its request's batch slot (the runner's adapter); under
     speculative decoding a request has a sampling row per draft token and one more;
  2. plan: each row's kNN settings and pinned datastore version (batch_requests), and the rows of
     active requests grouped by pinned version;
  3. per group: the rows the LM is not confident on (knn_mixer.rows_to_search; the others keep
     p_LM), their keys (capture), their neighbours and λ, τ (knn_mixer.start/finish, on the first
     tensor-parallel rank only, shared with the others): the k nearest from that version's
     shards, or for a sampling row whose previous row's neighbours predicted the token it was fed,
     those neighbours' successors (pointer following); then p_kNN mixed into those rows'
     logits in place, at their neighbours' tokens only, so that their softmax is
     λ·p_kNN + (1−λ)·p_LM (knn_mixer.mix). Sampling rows keep their neighbours for the next step.
A request's previous row is its row before in this step (the draft before), or the row of its
last step it sampled its newest token from: rows that may follow pointers are served in rounds,
one draft position at a time, so each row sees what decoding without drafts would have shown it,
and vLLM's rejection sampler verifies the drafts against the kNN-LM's own distribution. Where
one shard actor (or this process) holds the version, the rounds run there, in one call (RowLinks).
With knn.overlap, steps 1-2 and the start of the search happen earlier, mid-forward (key_ready),
for the first round's active sampling rows, unless the LM was confident on every one of their
requests at its last sampling row (the skip rule, predicted: the call then searches the rows the
rule keeps); the call then applies the skip rule and collects the answers. vLLM computes sample
and prompt logprobs from what this returns, so clients see the mixture.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from knnlm_core.pointers import successors
from knnlm_serve import metrics
from knnlm_serve.engine.batch_requests import BatchRequest, BatchRequests, LastNeighbours
from knnlm_serve.engine.capture import KeyCapture
from knnlm_serve.engine.explanations import Evidence, ExplanationLog
from knnlm_serve.engine.faults import Faults
from knnlm_serve.engine.knn_mixer import KnnMixer, Neighbours, PendingRows
from knnlm_serve.engine.request_params import KnnParams
from knnlm_serve.engine.rows import LogitsRows
from knnlm_serve.engine.search_rounds import row_links, search_calls, search_rounds
from knnlm_serve.engine.step_clock import Part, StepClock
from knnlm_serve.engine.tensor_parallel import FirstRank
from knnlm_serve.retrieval import make_retriever
from knnlm_serve.runtime import DatastoreInfo, Runtime

logger = logging.getLogger("knnlm_serve")


@dataclass
class StepPlan:
    """One `compute_logits` call's rows resolved to requests, and the rows of active requests
    grouped by pinned datastore version (the order of the groups is the order they are served)."""

    rows: LogitsRows
    params: list[KnnParams]
    requests: list[BatchRequest]
    last: list[LastNeighbours | None]  # each sampling row's previous row's neighbours (filled round by round)
    fed: list[int | None]  # each sampling row's newest context token, which `last` may have predicted
    groups: dict[tuple[str, int], list[int]]
    versions: dict[tuple[str, int], DatastoreInfo]
    clock: StepClock  # the kNN work on the step's path, from mid-forward (key_ready) on
    started: dict[tuple[str, int], PendingRows | None] = field(default_factory=dict)  # searches begun mid-forward


class KnnLogits:
    def __init__(self, runtime: Runtime, capture: KeyCapture, step):
        self.runtime = runtime
        self.step = step  # the runner's view of this step (vllm_adapter.StepView, vllm_adapter_v2.StepView)
        self.first_rank = FirstRank()
        self.batch = BatchRequests(step.running)
        self.faults = Faults()  # errors here serve rows LM-only (engine/faults.py)
        self.faults.fail_open = runtime.knn.fail_open
        self.capture = capture
        self.mixer = KnnMixer(make_retriever(runtime.knn, runtime.ray_address))
        self.explanations = ExplanationLog()
        self._begun: StepPlan | None = None  # this step's sampling rows, planned and searching since key_ready
        capture.listen(self.key_ready)

    def set_runtime(self, runtime: Runtime) -> None:
        """A new serving set from the registry; versions no running request is pinned to are released."""
        self.runtime = runtime
        self.faults.fail_open = runtime.knn.fail_open
        keep = self.batch.pinned_versions() | {i.key for i in runtime.datastores.values()}
        self.mixer.release(keep)
        self.faults.release(keep)

    def key_ready(self, ffn_input: torch.Tensor) -> None:
        """Mid-forward, once the last layer's FFN input exists (capture's `knnlm::key_ready`): with
        knn.overlap, start the sampling rows' searches now, so the shards search while the last MLP,
        the final norm and the LM head run; `__call__` collects them. The skip rule needs the
        logits, so it is predicted from each request's last sampling row: where the LM was
        confident on every request then, the call searches only the rows the rule keeps. Else
        every row is begun, in one search (a second one after the logits would wait on the first)."""
        self._begun = None
        if not self.runtime.knn.overlap:
            return
        try:
            self._begin(ffn_input)
        except Exception as e:  # noqa: BLE001 - fail open: `__call__` plans the step again
            self.faults.failed("key_ready", e, rows=0)

    def _begin(self, ffn_input: torch.Tensor) -> None:
        clock = StepClock()
        rows = self.step.sampling_rows()
        if rows is None:
            return
        plan = self._plan(rows, clock)
        clock.lap(Part.PLAN)
        for key, group in plan.groups.items():
            info = plan.versions[key]
            if info.key_type != "ffn_input" or key in self.faults.unhealthy:  # a `final` key does not exist yet
                continue
            try:
                first = search_rounds(rows.draft, plan.params, group)[0]
                if all(plan.requests[r].confident for r in first):
                    continue
                keys = ffn_input[torch.as_tensor(rows.token_index[first], device=ffn_input.device)]
                plan.started[key] = self._start(plan, first, info, keys) if self.first_rank.rank == 0 else None
            except Exception as e:  # noqa: BLE001 - fail open: these rows are served LM-only
                plan.started[key] = e
                if self.first_rank.size == 1:  # with tensor parallelism it is raised on every rank alike, in `_collect`
                    self.faults.failed("key_ready", e, len(group), key)
        self._begun = plan

    def __call__(self, logits: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """The step's logits with p_kNN mixed into the rows of active requests. A failure serves
        the rows it concerned as the LM's (engine/faults.py)."""
        begun, self._begun = self._begun, None
        if begun is not None:
            begun.clock.resume()
        clock = begun.clock if begun is not None else StepClock()
        try:
            return self._mixed(logits, hidden_states, begun, clock)
        except Exception as e:  # noqa: BLE001 - fail open: the step's logits as the LM made them
            if begun is not None:
                self._drain(begun)
            self.faults.failed("compute_logits", e, len(logits))
            return logits

    def _mixed(self, logits: torch.Tensor, hidden_states: torch.Tensor, begun: StepPlan | None, clock: StepClock) -> torch.Tensor:
        rows = self.step.rows_of(hidden_states, self.capture.hidden, begun.rows if begun is not None else None)
        if rows is None:  # vLLM's warm-up and profiling calls
            return logits
        if begun is not None and rows is not begun.rows:
            self._drain(begun)  # not the sampling call (cannot happen with vLLM 0.32's runner): plan anew
            logger.warning("knnlm: searches begun mid-forward were not for this step's sampling rows; searched again")
            begun = None
        plan = begun if begun is not None else self._plan(rows, clock)
        if not plan.groups:
            return logits
        logits = logits.float()
        explained = [r for members in plan.groups.values() for r in members if plan.params[r].explain_id is not None]
        evidence = Evidence(self.step.positions(rows), rows.sampling, logits, explained) if explained else None
        clock.lap(Part.PLAN)
        for key, group in plan.groups.items():
            info = plan.versions[key]
            failed = isinstance(plan.started.get(key), Exception) and self.first_rank.size == 1  # begun, failed (and counted)
            if not failed and key in self.faults.unhealthy:
                metrics.child(metrics.FALLBACKS, metrics.datastore_label(info.name), "unhealthy").inc(len(group))
                failed = True
            if not failed:
                try:
                    self._serve(plan, key, group, logits, hidden_states, evidence)
                    self.faults.succeeded(key)
                    continue
                except Exception as e:  # noqa: BLE001 - fail open: this group's rows keep the LM's logits
                    self._drain(plan, key)
                    self.faults.failed("compute_logits", e, len(group), key)
            if evidence:
                evidence.found(group, info, None)
        if evidence:
            evidence.record(self.explanations, plan.requests)
        clock.lap(Part.RECORD)
        clock.observe()
        return logits

    def _serve(self, plan: StepPlan, key, group: list[int], logits: torch.Tensor, hidden_states: torch.Tensor, evidence) -> None:
        """One datastore version's rows: the skip rule, their neighbours round by round (the first
        collected if begun mid-forward, else searched now), and the mix into `logits` in place."""
        info, params, rows = plan.versions[key], plan.params, plan.rows
        if evidence:
            evidence.skipped(group, info)
        log_z, top = self.mixer.lm_confidence(logits, group)
        kept = self.mixer.rows_to_search(top, [params[r] for r in group], info.name)
        plan.clock.lap(Part.CONFIDENCE)
        at = {r: i for i, r in enumerate(group)}
        to_search = {group[i] for i in kept}
        if rows.sampling:
            for r in group:
                plan.requests[r].confident = r not in to_search
        rounds, begun, links = search_rounds(rows.draft, params, group), key in plan.started, self.mixer.retriever.links_rows(info)
        calls = [rounds[0], *search_calls(rounds[1:], links)] if begun else search_calls(rounds, links)
        for i, members in enumerate(calls):
            searched = [r for r in members if r in to_search]
            if begun and i == 0:  # begun mid-forward: collected even if every row was skipped
                found = self.first_rank.run(self._collect, plan.started.pop(key), [members.index(r) for r in searched], plan.clock)
            elif searched:
                token_index = torch.as_tensor(rows.token_index[searched], device=hidden_states.device)
                keys = self.capture.keys(info.key_type, token_index, hidden_states[searched])
                found = self.first_rank.run(self._search, plan, searched, info, keys)
            if not searched:
                continue
            if evidence:
                evidence.found(searched, info, found)
            if found is None:
                continue
            self.mixer.mix(logits, searched, log_z[[at[r] for r in searched]], found, info.name)
            plan.clock.lap(Part.MIX)
            if rows.sampling:
                self._remember(plan, searched, found)
            plan.clock.lap(Part.RECORD)

    def _collect(self, started, keep: list[int], clock: StepClock) -> Neighbours | None:
        """A search begun mid-forward, collected; one that failed to begin raises here, inside the
        tensor-parallel broadcast, so that every rank fails it alike (none waits on the others)."""
        if isinstance(started, Exception):
            raise started
        return self.mixer.finish(started, keep, clock)

    def _remember(self, plan: StepPlan, searched: list[int], found: Neighbours) -> None:
        """Keep the sampling rows' neighbours: for the request's next step, and for its next row in this one."""
        draft, slot = plan.rows.draft, plan.rows.slot
        for i, r in enumerate(searched):
            request, fed = plan.requests[r], tuple(self.step.drafts(int(slot[r]))[: draft[r]]) if draft[r] else ()
            last = LastNeighbours(found.ids[i], found.tokens[i], len(request.output_tokens) + len(fed), fed)
            request.last.append(last)
            if r + 1 < len(draft) and draft[r + 1] == draft[r] + 1:
                plan.last[r + 1] = last

    def _drain(self, plan: StepPlan, key: tuple[str, int] | None = None) -> None:
        """Collect and drop the searches begun mid-forward (of one version, or all) that were not
        collected: a search in flight is always read back."""
        for k in [key] if key is not None else list(plan.started):
            started = plan.started.pop(k, None)
            if isinstance(started, PendingRows):
                try:
                    self.mixer.finish(started, keep=[])
                except Exception:  # noqa: BLE001 - already failing: its error is the one reported
                    logger.debug("knnlm: dropping a search begun mid-forward failed", exc_info=True)

    def _plan(self, rows: LogitsRows, clock: StepClock) -> StepPlan:
        """Resolve each row's request (pinning its version at its first step) and group the rows
        of active requests by version. A request's first sampling row takes over its last
        step's neighbours."""
        self.batch.forget_finished()
        plan = StepPlan(rows, [], [], [], [], {}, {}, clock)
        for row, (slot, draft) in enumerate(zip(rows.slot.tolist(), rows.draft.tolist())):
            request = self.batch.resolve(self.step.request_id(slot), self.runtime, self.step.request)
            plan.params.append(request.params)
            plan.requests.append(request)
            last, fed = None, None
            if rows.sampling and draft == 0:
                last, fed = request.last_sampled() or (None, None)
                request.last = []  # this step's rows that find neighbours fill it
            elif rows.sampling:
                fed = self.step.drafts(slot)[draft - 1]
            plan.last.append(last)
            plan.fed.append(fed)
            if not request.params.active or (rows.kept is not None and not rows.kept[row]):
                continue
            if request.pinned is None:  # unloaded between admission and the request's first step
                metrics.child(metrics.FALLBACKS, metrics.datastore_label(request.params.datastore), "datastore_unloaded").inc()
                continue
            plan.versions[request.pinned.key] = request.pinned
            plan.groups.setdefault(request.pinned.key, []).append(row)
        return plan

    def _search(self, plan: StepPlan, group: list[int], info: DatastoreInfo, keys: torch.Tensor) -> Neighbours | None:
        return self.mixer.finish(self._start(plan, group, info, keys), clock=plan.clock)

    def _start(self, plan: StepPlan, group: list[int], info: DatastoreInfo, keys: torch.Tensor) -> PendingRows:
        """Send the rows' queries (or their pointers' successors) to the version's shards; a row
        whose previous row is in the same call follows that row's pointers there (`row_links`)."""
        candidates = [self._pointers(plan, r, info) if plan.rows.sampling else None for r in group]
        params = [plan.params[r] for r in group]
        links = row_links(plan.rows, plan.params, plan.fed, group)
        queries = keys.float().cpu().numpy()
        plan.clock.lap(Part.KEYS)
        pending = self.mixer.start(info, queries, params, self.runtime, candidates, links)
        plan.clock.lap(Part.SEND)
        return pending

    def _pointers(self, plan: StepPlan, row: int, info: DatastoreInfo) -> np.ndarray | None:
        """Successors of the row's previous neighbours that predicted the token it was fed."""
        last, token = plan.last[row], plan.fed[row]
        starts = self.mixer.document_starts(info) if plan.params[row].min_pointers else None
        if last is None or token is None or starts is None:
            return None
        found = last.ids >= 0
        return successors(last.ids[found], last.tokens[found], token, starts)
