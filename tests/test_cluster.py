"""Shards on another node of a real two-node Ray cluster (Ray's own test-cluster utility: two
raylets on this machine): placement by `knn.shard_resources`, a hot-swap under streaming load, the
shard node's raylet killed and the node coming back, with the server running throughout; then
replicas on both nodes, where losing a node costs no fallback."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import requests
from conftest import TINY_SERVER, admin_knn, greedy, starting, stream_while, until

from index_builder.build import build_datastore
from knnlm_core.config import BuildConfig
from knnlm_serve.server.process import RunningServer, metric_total, scrape_metrics

pytestmark = pytest.mark.slow

PREFIX = "The miller at the edge of the marsh kept a ledger in which he wrote that every autumn"
TEXTS = {
    "a": PREFIX + " the herons came back to the reeds a day before the first frost, and never later.",
    "b": PREFIX + " a stranger in a grey coat bought all his flour and paid in coins from a drowned city.",
}
TOKEN, CONTINUATION = "s3cret", 12
SHARD_RESOURCE, ANY_NODE = "knn_shards", "knn_any"  # only the second node offers the first; both the second


def add_shard_node(cluster):
    node = cluster.add_node(num_cpus=1, resources={SHARD_RESOURCE: 1, ANY_NODE: 1})
    cluster.wait_for_nodes()
    return node


@pytest.fixture(scope="module")
def cluster():
    """{"cluster": Ray's test cluster, "shard_node": its second node (replaced when a test kills it)}."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False, "resources": {ANY_NODE: 1}})
    state = {"cluster": cluster, "shard_node": add_shard_node(cluster)}
    yield state
    cluster.shutdown()


@pytest.fixture(scope="module")
def ids(tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prefix = tokenizer(PREFIX).input_ids
    return {"prompt": prefix, **{k: tokenizer(t).input_ids[len(prefix) : len(prefix) + CONTINUATION] for k, t in TEXTS.items()}}


@pytest.fixture(scope="module")
def root(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("cluster")
    for name, text in TEXTS.items():
        (root / f"{name}.txt").write_text(text)
        build_datastore([root / f"{name}.txt"], root / name, tiny_model_dir, BuildConfig(index="flat", shards=2), progress=False)
    return root


def serve(tiny_model_dir, cluster, root, workdir: str, **knn_settings):
    # Room for a loaded machine in the shard timeout: a new version's actors on the one-CPU node
    # answered their first steps after a swap in over 1 s on CI (every row LM-only for those steps).
    placement = {"ray_address": cluster["cluster"].address, "shard_resources": {SHARD_RESOURCE: 0.01}}
    knn = admin_knn(root, TOKEN, **{**placement, **knn_settings})
    workdir = root / workdir  # the server's log and config
    workdir.mkdir(exist_ok=True)
    return RunningServer({**TINY_SERVER, "model": str(tiny_model_dir), "knn": knn}, workdir)


# Each replica a step asks gets half of what is left of the deadline: 2 s, room for a loaded machine
# while Ray has not yet noticed the node is gone (calls to its actors hang until then).
REPLICAS = {"replicas": 2, "shard_resources": {ANY_NODE: 0.01}, "shard_timeout_s": 4.0}


@pytest.fixture(scope="module")
def second_start(tiny_model_dir, cluster, root):
    """A second server of the same datastore on the cluster, starting beside the first: two
    replicas of each shard, on any node."""
    with starting(serve(tiny_model_dir, cluster, root, "second", **REPLICAS)) as start:
        yield start


@pytest.fixture(scope="module")
def server(tiny_model_dir, cluster, root):
    with serve(tiny_model_dir, cluster, root, "server") as server:
        yield server


def admin(server, method, route, **body):
    return requests.request(method, f"{server.base_url}/v1/knn{route}", json=body or None, headers={"X-Admin-Token": TOKEN}, timeout=120)


def shard_nodes(server, replica: int = 0) -> set[str | None]:
    return {s.get("node") for s in admin(server, "GET", "/health").json()["shards"] if s["replica"] == replica}


def fallbacks(server) -> float:
    return metric_total(scrape_metrics(server.base_url), "knnlm_fallbacks_total")


def complete(server, ids) -> list[int]:
    return greedy(server, ids["prompt"], CONTINUATION).token_ids


def test_a_server_without_a_ray_address_starts_its_own_ray_beside_a_running_cluster(cluster):
    # ray.init's own default joins a cluster started on the machine; a server would then share its
    # actor names (and die with it). The launcher's choice, made in a fresh process as a server makes it.
    start = "import ray; from knnlm_serve.server.launcher import ray_init_address as a; ray.init(address=a(None)); print(ray.get_runtime_context().gcs_address)"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    started = subprocess.run([sys.executable, "-c", start], capture_output=True, text=True, env=env, timeout=180)
    assert started.returncode == 0, started.stderr[-2000:]
    assert started.stdout.split()[-1] != cluster["cluster"].address


def test_a_second_server_of_the_datastore_on_the_cluster_keeps_its_own_shard_actors(second_start, server, ids, cluster):
    """Replicas of one deployment behind a load balancer: each server's shard actors are its own
    without a setting, so what one server does to its datastore costs the other nothing."""
    before, second = fallbacks(server), second_start.result()  # it serves `main` from the same files
    assert complete(second, ids) == complete(server, ids) == ids["a"]
    health = [admin(s, "GET", "/health").json() for s in (server, second)]
    namespaces = {h["ray_namespace"] for h in health}
    assert admin(second, "DELETE", "/datastores/main").status_code == 200  # its actors stop once released
    until(lambda: admin(second, "GET", "/datastores").json()["datastores"] == [], 60, "the unloaded version was never released")
    assert complete(server, ids) == ids["a"] and fallbacks(server) == before
    assert admin(server, "GET", "/health").json()["healthy"]
    assert len(namespaces) == 2, namespaces
    assert {h["ray_address"] for h in health} == {cluster["cluster"].address}  # what a client joins to read its object store


def test_shards_live_on_the_node_with_their_resource(server, cluster, ids):
    head, shard_node = cluster["cluster"].head_node, cluster["shard_node"]
    assert shard_nodes(server) == {shard_node.node_id} != {head.node_id}
    assert complete(server, ids) == ids["a"]


def test_a_hot_swap_under_streaming_load_loses_nothing(server, ids):
    def swap_to_b():
        time.sleep(2)
        assert admin(server, "POST", "/datastores", name="main", path="b").status_code == 200
        until(lambda: complete(server, ids) == ids["b"], 60, "the swap never took effect")
        time.sleep(2)

    results, errors = stream_while(server, ids["prompt"], CONTINUATION, swap_to_b)
    assert errors == [] and len(results) > 16
    assert ids["a"] in results and ids["b"] in results
    assert [r for r in results if r not in (ids["a"], ids["b"])] == [], "a response mixed two datastore versions"


def test_the_shard_node_dies_and_comes_back_without_a_restart(server, cluster, ids):
    ray_cluster, shard_node = cluster["cluster"], cluster["shard_node"]
    expected = complete(server, ids)  # whichever version the swap test left serving
    before = fallbacks(server)

    def lose_the_node():
        time.sleep(2)
        ray_cluster.remove_node(shard_node, allow_graceful=False)  # its raylet and workers killed
        until(lambda: fallbacks(server) > before, 60, "no fallback was counted while the shards were gone")
        time.sleep(2)

    results, errors = stream_while(server, ids["prompt"], CONTINUATION, lose_the_node)
    assert errors == [] and results, errors  # requests were served LM-only, none failed
    assert fallbacks(server) > before

    new_node = cluster["shard_node"] = add_shard_node(ray_cluster)
    until(lambda: shard_nodes(server) == {new_node.node_id}, 180, "the shards never came back on the new node")
    until(lambda: complete(server, ids) == expected, 60, "kNN never served again after the node came back")
    settled = fallbacks(server)
    assert complete(server, ids) == expected and fallbacks(server) == settled


def test_with_a_replica_on_each_node_losing_one_costs_no_fallback(second_start, cluster, ids):
    ray_cluster, head, server = cluster["cluster"], cluster["cluster"].head_node, second_start.result()
    assert admin(server, "POST", "/datastores", name="main", path="a").status_code == 200  # its first test unloaded it
    placed = {(s["shard"], s["node"]) for s in admin(server, "GET", "/health").json()["shards"]}
    assert placed == {(shard, node) for shard in ("shard-000", "shard-001") for node in (head.node_id, cluster["shard_node"].node_id)}
    assert complete(server, ids) == ids["a"]
    before = fallbacks(server)

    def lose_the_node():
        time.sleep(2)
        ray_cluster.remove_node(cluster["shard_node"], allow_graceful=False)
        time.sleep(5)

    results, errors = stream_while(server, ids["prompt"], CONTINUATION, lose_the_node)
    assert errors == [] and results and all(r == ids["a"] for r in results)  # kNN served every step
    assert fallbacks(server) == before
