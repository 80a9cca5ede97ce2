"""Many small vector stores on one server: what each costs in memory and in a kNN step, searched
in vLLM's worker (`knn.files.store_search: worker`, the default) against shard actors
(`backend`), so that a store per team or per user is a choice with its price known.

    .venv/bin/python benchmarks/many_vector_stores.py              # 100 stores, ~15 min on 2 CPU cores
    .venv/bin/python benchmarks/many_vector_stores.py --stores 20

configs/default.yaml's server (SmolLM2, the embedded datastore) is started three times on the same
datastore root layout: with no store; with N stores of one small file each, built offline
(`build_vector_store`, as `knnlm-index vector-store` does); and with 10 of them served by shard
actors. Each start's per-process memory (USS, by role: loadtest/soak_samples.py) is read once the
server answers and each store has been searched once (the worker opens a store's shards at its
first search); then greedy completions at kNN off and on (each on another store,
interleaved pairs) give the step cost of a store's search. Writes
benchmarks/results/many_vector_stores.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "loadtest")]

from run_record import run_record  # noqa: E402
from soak_samples import process_sample  # noqa: E402

from index_builder.vector_store import build_vector_store  # noqa: E402
from knnlm_core.config import BuildConfig  # noqa: E402
from knnlm_core.default_model import resolve_model  # noqa: E402
from knnlm_serve.server.process import RunningServer  # noqa: E402

PROMPT = "Team notes: where does the team keep its notes? The team keeps its notes"
PAIRS = 12
TOKENS = 32


def build_stores(root: Path, count: int, model_dir: Path) -> list[str]:
    """`count` stores of one small file each (a team's note), as the server keeps them."""
    ids = []
    for n in range(count):
        folder = root.parent / "inputs" / f"team-{n}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"team-{n}.txt").write_text(f"Team {n} keeps its notes in drawer {n} of the blue cabinet. " * 30)
        store = build_vector_store(root, [folder], model_dir, f"team-{n}", None, BuildConfig(index="flat"), progress=False)
        ids.append(store.id)
        if n % 10 == 9:
            print(f"many stores: {n + 1}/{count} built", flush=True)
    return ids


def searched_once(server, model: str, stores: list[str]) -> None:
    """One kNN step on each store: the worker opens a store's shards at its first search."""
    client = server.openai_client()
    for store in stores:
        client.completions.create(model=model, prompt=PROMPT, max_tokens=1, extra_body={"vllm_xargs": {"knn_datastore": store}})


def memory(server) -> dict[str, dict]:
    """USS MiB and process count by role."""
    time.sleep(5)  # the last loads settle
    return {
        role: {"uss_mib": round(v["uss"] / 2**20, 1), "processes": v["processes"]} for role, v in process_sample(server.proc.pid).items()
    }


def step_cost(server, model: str, stores: list[str]) -> dict:
    """Greedy completions at kNN off and on (each pair on the next store), interleaved; seconds per
    completion and the on/off ratio's median and spread."""
    client = server.openai_client()

    def timed(xargs: dict) -> float:
        started = time.monotonic()
        client.completions.create(model=model, prompt=PROMPT, max_tokens=TOKENS, temperature=0, extra_body={"vllm_xargs": xargs})
        return time.monotonic() - started

    timed({"knn": False})  # warm-up
    ratios, on, off = [], [], []
    for n in range(PAIRS):
        off.append(timed({"knn": False}))
        on.append(timed({"knn": True, "knn_datastore": stores[n % len(stores)]}))
        ratios.append(on[-1] / off[-1])
    return {
        "pairs": PAIRS,
        "tokens": TOKENS,
        "off_s": round(statistics.median(off), 3),
        "on_s": round(statistics.median(on), 3),
        "ratio_median": round(statistics.median(ratios), 3),
        "ratio_min": round(min(ratios), 3),
        "ratio_max": round(max(ratios), 3),
    }


def served(config: dict, root: Path, workdir: Path, store_search: str):
    config = {**config, "knn": {**config["knn"], "datastore_root": str(root), "files": {"store_search": store_search}}}
    workdir.mkdir(parents=True, exist_ok=True)
    return RunningServer(config, workdir)


def serving(config: dict, work: Path, store_search: str, model: str, stores: list[str]) -> dict:
    """A server of the stores below `work/root`: its start, its memory once each store was searched, the step cost."""
    started = time.monotonic()
    with served(config, work / "root", work, store_search) as server:
        start_s = round(time.monotonic() - started, 1)
        searched_once(server, model, stores)
        found = {"start_s": start_s, "memory": memory(server), "step": step_cost(server, model, stores)}
    print(json.dumps(found, indent=1), flush=True)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stores", type=int, default=100)
    parser.add_argument("--actor-stores", type=int, default=10, help="stores served by shard actors, for the comparison")
    parser.add_argument("--work", type=Path, default=Path("/tmp/knnlm-many-stores"))
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/many_vector_stores.json")
    args = parser.parse_args()
    shutil.rmtree(args.work, ignore_errors=True)
    config = yaml.safe_load((ROOT / "configs/default.yaml").read_text())
    config.pop("port")
    model = config["served_model_name"]
    model_dir = resolve_model(config["model"])
    record = {**run_record("many_vector_stores"), "stores": args.stores, "actor_stores": args.actor_stores}

    with served(config, args.work / "none" / "root", args.work / "none", "worker") as server:
        record["no_store"] = memory(server)
    started = time.monotonic()
    stores = build_stores(args.work / "many" / "root", args.stores, model_dir)
    record["build_s_per_store"] = round((time.monotonic() - started) / args.stores, 2)
    record["in_worker"] = serving(config, args.work / "many", "worker", model, stores)
    actor_stores = build_stores(args.work / "actors" / "root", args.actor_stores, model_dir)
    record["as_actors"] = serving(config, args.work / "actors", "backend", model, actor_stores)
    record["per_store_mib"] = per_store(record)
    print(json.dumps(record["per_store_mib"], indent=1))
    args.out.write_text(json.dumps(record, indent=1) + "\n")


def per_store(record: dict) -> dict:
    """MiB each store adds: to vLLM's worker (in the worker), and in shard actors (as actors)."""

    def total(memory: dict, roles: tuple[str, ...]) -> float:
        return sum(v["uss_mib"] for role, v in memory.items() if role in roles)

    base = record["no_store"]
    worker = ("VLLM::Worker", "api server")
    actors = ("ray ShardActor",)
    return {
        "in_worker": round((total(record["in_worker"]["memory"], worker) - total(base, worker)) / record["stores"], 2),
        "as_actors": round((total(record["as_actors"]["memory"], actors) - total(base, actors)) / record["actor_stores"], 1),
    }


if __name__ == "__main__":
    main()
