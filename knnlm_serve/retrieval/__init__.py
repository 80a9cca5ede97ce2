"""Batched top-k search over a datastore version's shards: Ray actors (one per shard) or in-process.

Both backends answer `search(info, queries, k, nprobe, pointers)`, or `start` then `result` (the
shards search while the caller goes on), with the global top-k merged from every shard's top-k by
distance; rows with pointers (pointer following) are scored against those entries instead of
searched, in the same call; where the backend holds the version in one place (`links_rows`),
rows may follow the pointers of an earlier row of the same call (`RowLinks`: a request's draft
rows), served in rounds there. A shard that fails or misses the deadline is left out (policy
`partial`) or fails the whole search (policy `lm_only`); either way the caller learns why.

    types.py    what a search returns, and how it fails
    local.py    shards searched in this process
    actors.py   the Ray shard actor, and starting a version's actors
    graphs.py   Ray Compiled Graphs to the actors: built, parked when idle, dropped when they fail
    fanout.py   the Ray backend: fan-out to one replica per shard, deadlines, replicas, merge
    placement.py  each version searched by the backend or, where the registry says, in this process
"""

from __future__ import annotations

from knnlm_core.config import KnnConfig
from knnlm_serve.retrieval.actors import SERVING_PROCESS_ENV, SHARD_ACTOR_ENV, ShardActor, actor_name, start_shard_actors
from knnlm_serve.retrieval.fanout import RayRetriever
from knnlm_serve.retrieval.local import LocalRetriever
from knnlm_serve.retrieval.placement import PlacedRetriever
from knnlm_serve.retrieval.types import RetrievalError, SearchResult

__all__ = [
    "SHARD_ACTOR_ENV",
    "LocalRetriever",
    "SERVING_PROCESS_ENV",
    "PlacedRetriever",
    "RayRetriever",
    "RetrievalError",
    "SearchResult",
    "ShardActor",
    "actor_name",
    "make_retriever",
    "start_shard_actors",
]


def make_retriever(knn: KnnConfig, ray_address: str | None) -> LocalRetriever | PlacedRetriever:
    return PlacedRetriever(knn, ray_address) if knn.backend == "ray" else LocalRetriever(knn)
