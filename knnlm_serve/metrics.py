"""knnlm-serve's Prometheus metrics, exposed on vLLM's own `/metrics`.

The launcher turns on prometheus_client's multiprocess mode (vLLM's own helper) before any vLLM
process starts, so values recorded in the engine's worker processes (retrieval) and in the API
server (admission, admin) are merged at scrape time.
"""

from __future__ import annotations

from functools import cache

from prometheus_client import Counter, Gauge, Histogram

from knnlm_core.vector_store_records import is_vector_store

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)

RETRIEVAL_STEPS = Counter("knnlm_retrieval_steps", "logits computations (steps) that queried a datastore", ["datastore"])
RETRIEVAL_SECONDS = Histogram(
    "knnlm_retrieval_seconds",
    "one step's retrieval for one datastore: fan-out, search, merge",
    ["datastore"],
    buckets=_LATENCY_BUCKETS,
)
RETRIEVAL_WAIT_SECONDS = Histogram(
    "knnlm_retrieval_wait_seconds",
    "one step's time in sending one datastore's search and waiting for its answer: what retrieval added to the step "
    "(with knn.overlap, the part of the search the end of the forward pass did not hide)",
    ["datastore"],
    buckets=_LATENCY_BUCKETS,
)
STEP_SECONDS = Histogram(
    "knnlm_step_seconds",
    "one logits computation's whole kNN work on the step's path, over every datastore it served: planning, "
    "log-softmax and skip rule, keys, pointer candidates, sending and waiting for searches, mix (with knn.overlap, "
    "also what ran mid-forward); its sum over a run's wall time is the share of the engine's time kNN took",
    buckets=_LATENCY_BUCKETS,
)
STEP_PART_SECONDS = Counter(  # a counter: one write a part a step, where a histogram's buckets cost two and a search
    "knnlm_step_part_seconds",
    "knnlm_step_seconds split by part (engine/step_clock.py), summed over steps: plan, keys, send, confidence (the LM's "
    "log-softmax), wait (for the shards' answers and their merge), neighbours, mix, record (neighbours kept, explanations, "
    "metrics); per step: divide by knnlm_step_seconds_count",
    ["part"],
)
BROADCAST_SECONDS = Counter(
    "knnlm_tensor_parallel_broadcast_seconds",
    "with tensor parallelism, the time each rank spent in the broadcast of rank 0's search answer (rank 0: sending it; "
    "the others: waiting for it, which includes the search), summed over steps",
    ["rank"],
)
BROADCASTS = Counter("knnlm_tensor_parallel_broadcasts", "with tensor parallelism, broadcasts of rank 0's search answer", ["rank"])
INTERPOLATION_SECONDS = Histogram(
    "knnlm_interpolation_seconds",
    "one step's p_kNN scatter and log-space mix for one datastore",
    ["datastore"],
    buckets=_LATENCY_BUCKETS,
)
SHARD_SEARCH_SECONDS = Histogram(
    "knnlm_shard_search_seconds", "search time inside one shard", ["datastore", "shard"], buckets=_LATENCY_BUCKETS
)
SHARD_ANSWERS = Counter(
    "knnlm_shard_answers",
    "shard answers by transport: graph (Ray Compiled Graph), call (plain actor call), local (in-process)",
    ["datastore", "shard", "transport"],
)
SLOWEST_SHARD_SECONDS = Histogram(
    "knnlm_slowest_shard_search_seconds",
    "per step, the search time of the slowest shard (the fan-out waits for it)",
    ["datastore"],
    buckets=_LATENCY_BUCKETS,
)
QUERIES = Counter(
    "knnlm_queries",
    "query vectors sent to a datastore (with knn.overlap, also those of rows the skip rule then served p_LM)",
    ["datastore"],
)
POINTER_ROWS = Counter(
    "knnlm_pointer_rows", "rows of kNN requests served from the last step's neighbours' successors, without a search", ["datastore"]
)
SKIPPED_ROWS = Counter(
    "knnlm_skipped_rows",
    "rows of kNN requests served p_LM because the LM was confident (adaptive retrieval): not searched, unless knn.overlap began it",
    ["datastore"],
)
NEIGHBOURS = Counter("knnlm_neighbours", "neighbours retrieved (k per query)", ["datastore"])
FALLBACKS = Counter(
    "knnlm_fallbacks",
    "rows served with fewer shards or LM-only, by reason (error: an unexpected error in kNN's per-step path; "
    "unhealthy: the datastore version was stopped after repeated errors)",
    ["datastore", "reason"],
)
DRAFTS = Counter(
    "knnlm_drafts",
    "drafts proposed (speculative decoding, knn.draft_tokens), by request datastore ('none' = kNN off) and source "
    "(datastore: its stored continuation; context: prompt lookup in the request's own text)",
    ["datastore", "source"],
)
DRAFT_TOKENS = Counter("knnlm_draft_tokens", "tokens proposed in drafts", ["datastore", "source"])
DRAFT_ACCEPTED_TOKENS = Counter(
    "knnlm_draft_accepted_tokens",
    "draft tokens the engine accepted; per draft: knnlm_draft_accepted_tokens_total / knnlm_drafts_total",
    ["datastore", "source"],
)
DRAFT_FAILURES = Counter("knnlm_draft_failures", "steps that proposed no drafts because drafting failed (served without drafts)")
CONTEXT_FAILURES = Counter(
    "knnlm_context_failures", "requests served without in-context passages because retrieving them failed", ["datastore"]
)
REQUESTS = Counter("knnlm_requests", "requests admitted, by datastore ('none' = kNN off)", ["datastore"])
TENANT_REQUESTS = Counter(
    "knnlm_tenant_requests",
    "tenants: requests by key id ('none': no usable key; 'other': past the first 100 ids) and decision (allowed / denied)",
    ["key", "decision"],
)
TENANT_DENIALS = Counter(
    "knnlm_tenant_denials",
    "tenants: refused requests by key id and reason (missing, twice, form, unknown, expired, requests_per_minute, "
    "tokens_per_minute, not_granted, right)",
    ["key", "reason"],
)
TENANT_TOKENS = Counter("knnlm_tenant_tokens", "tenants: prompt and generated tokens by key id, from each response's usage", ["key"])
DATASTORE_INFO = Gauge(
    "knnlm_datastore_info",
    "serving datastores (value 1) and the mixing defaults in force; settings_from = where λ came from",
    ["datastore", "version", "entries", "shards", "key_type", "lambda", "k", "temperature", "skip_threshold", "settings_from"],
    multiprocess_mode="mostrecent",
)
DATASTORE_HEALTHY = Gauge(
    "knnlm_datastore_healthy",
    "1 while the datastore's serving version is healthy; 0 once vLLM's workers stopped using it after repeated errors "
    "(its requests are served LM-only until it is reloaded)",
    ["datastore"],
    multiprocess_mode="mostrecent",
)
SWAPS = Counter("knnlm_swaps", "datastore loads and hot-swaps, by result", ["datastore", "result"])
SWAP_SECONDS = Histogram(
    "knnlm_swap_seconds",
    "load, check and switch of one datastore version",
    ["datastore"],
    buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
)
SHARD_RESTARTS = Counter("knnlm_shard_restarts", "shard actors that Ray restarted", ["datastore", "shard", "replica"])
DOCUMENT_JOBS = Counter(
    "knnlm_document_jobs", "adds and forgets of a serving datastore's documents, by result", ["datastore", "job", "result"]
)
DOCUMENT_JOB_SECONDS = Histogram(
    "knnlm_document_job_seconds",
    "one add or forget, from the request to the new version serving",
    ["datastore", "job"],
    buckets=(0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900, 3600),
)
DOCUMENTS = Gauge(
    "knnlm_datastore_documents",
    "documents the serving version holds (forgotten ones not counted)",
    ["datastore"],
    multiprocess_mode="mostrecent",
)


@cache
def child(metric, *labels: str):
    """`metric.labels(*labels)`, looked up once: the kNN step records a dozen of them every step,
    and each lookup validates and locks. (No child of these metrics is ever removed.)"""
    return metric.labels(*labels)


def count(metric, n: int, *labels: str) -> None:
    """`child(metric, *labels).inc(n)`, without the write when n is 0 (the series exists either way):
    a step's counts of its kinds of rows are often 0, and each write takes a lock."""
    counter = child(metric, *labels)
    if n:
        counter.inc(n)


def datastore_label(name: str) -> str:
    """A datastore's label: its name, or `vector_stores` for every vector store. Users create and
    delete stores at will, and no series is ever removed (multiprocess files keep each one), so a
    label per store would grow for as long as the server runs; a store's own figures are its
    objects' (`file_counts`, `usage_bytes`)."""
    return "vector_stores" if is_vector_store(name) else name


def datastore_info_labels(info) -> tuple[str, ...]:
    """DATASTORE_INFO's labels for a serving version (runtime.DatastoreInfo)."""
    d = info.defaults
    lam = "adaptive" if d.lambda_ is None else f"{d.lambda_:g}"
    return (
        info.name,
        str(info.version),
        str(info.entries),
        str(len(info.shards)),
        info.key_type,
        lam,
        str(d.k),
        f"{d.temperature:g}",
        f"{d.skip_threshold:g}",
        d.source["lambda"],
    )
