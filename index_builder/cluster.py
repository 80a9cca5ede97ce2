"""`knnlm-index build --ray`: the encode as a pool of Ray Data actors (one model replica each, on a
GPU or on a slot of CPUs), the shards added as Ray tasks, on a running cluster.

Files reach the datastore through a filesystem every node shares: the build's work directory and
the model directory are read and written at the same paths on every node. A worker checks that it
sees the driver's work directory (a random token the driver wrote there) before it loads the model,
and the driver checks each file a worker says it wrote, so a cluster without a shared filesystem is
refused with an error instead of building from files the driver never sees. Ray Data restarts a
killed worker and retries its job (one part); a part is renamed into place whole, so a retry or a
rerun of the build starts again only the parts that are missing.
"""

from __future__ import annotations

import logging
import os
import queue
import re
import secrets
import socket
import threading
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
from tqdm import tqdm

from index_builder.parts import Job, PartKeys, encode_job, write_job
from knnlm_core.config import BuildCluster, BuildConfig
from knnlm_core.errors import ConfigError, KnnlmError
from knnlm_core.files import write_json_atomic
from knnlm_core.manifest import ShardEntry
from knnlm_core.windows import WindowPlan, plan_of

logger = logging.getLogger("index_builder")

TOKEN_FILE = "cluster.json"  # in the work directory: what a worker must see there
NODE_CHECK_S, GIVE_UP_S = (
    2.0,
    30,
)  # with no part done, how often the driver looks for a node that can run a worker; how long it waits for one
INDEX_TOKENS, WINDOWS = "index_tokens.npy", "windows.npy"  # what the workers encode, in the work directory


class ClusterError(KnnlmError):
    """The cluster cannot run the build as asked (not reachable, no shared filesystem, no model)."""


def connect(address: str) -> dict[str, float]:
    """Join the Ray cluster at `address` ("auto": RAY_ADDRESS, else the cluster started on this
    machine); its resources."""
    # No API call may start or join a Ray by itself: after a failure, Ray Data's threads would
    # reconnect while the process exits (set before Ray is first imported, as the CLI does).
    os.environ.setdefault("RAY_ENABLE_AUTO_CONNECT", "0")
    import ray

    if not ray.is_initialized():
        if address != "auto" and not address.startswith("ray://"):
            _check_reachable(address)
        try:
            ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise ClusterError(
                f"--ray {address}: no Ray cluster could be joined ({str(e).splitlines()[0]}); start one with `ray start --head` "
                "on the first node and `ray start --address HEAD:6379` on the others, and pass the head's address (a cluster "
                "with token authentication also needs RAY_AUTH_MODE=token here)"
            ) from None
    return ray.cluster_resources()


def _check_reachable(address: str) -> None:
    """A quick refusal of an address nothing listens on (ray.init would retry for a minute)."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"--ray {address!r}: give the cluster's address as HOST:PORT (the head's GCS port, 6379 by default) or auto")
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as e:
        raise ClusterError(f"--ray {address}: nothing answers there ({e.strerror or e}); is the cluster's head running?") from None


def worker_shape(cluster: BuildCluster, resources: dict[str, float]) -> tuple[int, float, float]:
    """(workers, CPUs each, GPUs each): one worker per GPU where the cluster has GPUs, else one per
    `worker_cpus` CPUs, unless `workers` says how many."""
    gpus = cluster.worker_gpus if cluster.worker_gpus is not None else (1.0 if resources.get("GPU", 0) >= 1 else 0.0)
    if gpus > resources.get("GPU", 0):
        raise ClusterError(f"--worker-gpus {gpus}: the cluster has {resources.get('GPU', 0):g} GPUs")
    if cluster.worker_cpus > resources.get("CPU", 0):
        raise ClusterError(f"--worker-cpus {cluster.worker_cpus:g}: the cluster has {resources.get('CPU', 0):g} CPUs")
    fits = int(resources.get("GPU", 0) // gpus) if gpus else int(resources.get("CPU", 0) // cluster.worker_cpus)
    return cluster.workers or max(1, fits), cluster.worker_cpus, gpus


class PartEncoder:
    """A Ray Data worker: one model replica that encodes jobs (parts or pieces of the training
    sample) into files of the shared work directory."""

    def __init__(self, work: str, model_dir: str, token: str, key_type: str, dtype: str, batch_size: int, threads: int):
        import ray
        import torch

        from knnlm_core.keys import KeyEncoder

        self.node = f"{ray.util.get_node_ip_address()}/{ray.get_runtime_context().get_node_id()[:8]}"
        self.work = Path(work)
        seen = self.work / TOKEN_FILE
        missing = []  # every fix the node needs, in one error: a new node often lacks both
        if not seen.exists() or token not in seen.read_text():
            missing.append(
                f"does not see the build's work directory {work}: --ray needs the datastore's "
                "parent directory on a filesystem every node shares, at the same path"
            )
        if not (Path(model_dir) / "config.json").exists():
            missing.append(f"has no model at {model_dir}: put the model directory at the same path on every node")
        if missing:
            raise ClusterError(f"node {self.node} " + "; and it ".join(missing))
        if not torch.cuda.is_available():
            torch.set_num_threads(threads)
        self.encoder = KeyEncoder(Path(model_dir), key_type, dtype)
        self.tokens = np.load(self.work / INDEX_TOKENS, mmap_mode="r")
        self.plan = plan_of(np.load(self.work / WINDOWS))
        self.batch_size = batch_size

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list]:
        out = {"file": [], "node": [], "tokens": [], "seconds": []}
        for file, windows in zip(batch["file"], batch["windows"]):
            job = Job(Path(file), np.asarray(windows, dtype=np.int64))
            began = time.monotonic()
            write_job(job, encode_job(self.encoder, self.tokens, self.plan, job, self.batch_size))
            out["file"].append(str(file))
            out["node"].append(self.node)
            out["tokens"].append(job.fed_tokens(self.plan))
            out["seconds"].append(time.monotonic() - began)
        return out


class RayEncoder:
    """Encodes jobs on a pool of `PartEncoder` actors; one progress bar, each node's rate logged."""

    def __init__(self, work: Path, model_dir: Path, config: BuildConfig, cluster: BuildCluster, plan: WindowPlan, tokens: np.ndarray):
        self.work, self.model_dir, self.config, self.plan = work, model_dir, config, plan
        self.workers, self.cpus, self.gpus = worker_shape(cluster, connect(cluster.ray_address))
        self.node_wait_s = cluster.node_wait_s
        self.token = secrets.token_hex(16)
        write_json_atomic(work / TOKEN_FILE, {"token": self.token})
        for name, array in ((INDEX_TOKENS, tokens), (WINDOWS, plan.windows)):
            if not (work / name).exists():
                tmp = work / f".{name}.tmp"
                with open(tmp, "wb") as f:
                    np.save(f, np.asarray(array))
                os.replace(tmp, work / name)
        self.rates: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])  # node -> [tokens, seconds]
        logger.info("encode: %d worker(s) on the cluster, %g CPU and %g GPU each", self.workers, self.cpus, self.gpus)

    def run(self, jobs: list[Job], bar: tqdm) -> None:
        import ray
        import ray.data

        if not jobs:
            return
        logging.getLogger("ray.data").setLevel(logging.ERROR)  # its plans and notes (set on import): the driver shows one bar
        context = ray.data.DataContext.get_current()
        context.enable_progress_bars = False  # the driver's one bar instead
        context.wait_for_min_actors_s = 600
        items = [{"file": str(j.file), "windows": j.windows} for j in jobs]
        pool = ray.data.from_items(items, override_num_blocks=len(items)).map_batches(
            PartEncoder,
            fn_constructor_kwargs={
                "work": str(self.work),
                "model_dir": str(self.model_dir),
                "token": self.token,
                "key_type": self.config.key_type,
                "dtype": self.config.dtype,
                "batch_size": self.config.batch_size,
                "threads": max(1, int(self.cpus)),
            },
            batch_size=1,
            compute=ray.data.ActorPoolStrategy(size=min(self.workers, len(jobs))),
            num_cpus=self.cpus,
            num_gpus=self.gpus,
        )
        rows: queue.Queue = queue.Queue()
        threading.Thread(target=_drain, args=(pool, rows), daemon=True).start()
        unplaceable_since = None
        while True:
            try:
                row = rows.get(timeout=NODE_CHECK_S)
            except queue.Empty:
                unplaceable_since = None if self._placeable() else (unplaceable_since or time.monotonic())
                if unplaceable_since is not None and time.monotonic() - unplaceable_since > self.node_wait_s:
                    raise ClusterError(
                        f"no node of the cluster could run an encode worker ({self.cpus:g} CPU, {self.gpus:g} GPU) for {self.node_wait_s:g} s: "
                        "its nodes died; the parts encoded so far are kept, so rerunning the same command once nodes are back resumes"
                    ) from None
                continue
            if row is None:
                break
            if isinstance(row, Exception):
                raise _cause(row) from None
            if not Path(row["file"]).exists():
                raise ClusterError(
                    f"node {row['node']} wrote {row['file']}, which this machine does not see: --ray needs the datastore's "
                    "parent directory on a filesystem every node shares"
                )
            rate = self.rates[row["node"]]
            rate[0] += row["tokens"]
            rate[1] += row["seconds"]
            bar.update(row["tokens"])
        for node, (fed, seconds) in sorted(self.rates.items()):
            logger.info("encode: node %s: %s tokens at %.0f tokens/s", node, f"{int(fed):,}", fed / max(seconds, 1e-9))

    def _placeable(self) -> bool:
        """Whether a live node of the cluster has the resources of one encode worker."""
        import ray

        return any(
            n["Alive"] and n["Resources"].get("CPU", 0) >= self.cpus and n["Resources"].get("GPU", 0) >= self.gpus for n in ray.nodes()
        )


def _drain(pool, rows: queue.Queue) -> None:
    """Every row of `pool` into `rows`, then None (or the error that ended it)."""
    try:
        for row in pool.iter_rows():
            rows.put(row)
        rows.put(None)
    except Exception as e:  # noqa: BLE001 - handed to the driver's thread, which raises it
        rows.put(e)


def _cause(error: Exception) -> KnnlmError:
    """Our own error inside a Ray failure (a worker's, carried as text), where one was raised;
    else the failure, said plainly."""
    text = str(error).strip().splitlines()
    ours = [line.split("Error: ", 1)[1] for line in text if re.match(r"\s*(\w+\.)*(ClusterError|ModelError|CorpusError): ", line)]
    if ours:
        return ClusterError(ours[-1])
    return ClusterError(
        f"the cluster's encode failed: {text[-1] if text else type(error).__name__}; the parts encoded so far are kept, "
        "so rerunning the same command resumes"
    )


def add_shards_on_ray(
    work: Path, keys: PartKeys, values: np.ndarray, bounds: np.ndarray, trained: Path, keep_keys: bool, bar: tqdm, first_number: int = 0
) -> list[ShardEntry]:
    """Each shard added in its own Ray task, all at once (retried where its worker dies); a task
    reads its keys from the part files of the shared work directory."""
    import ray

    from index_builder.shards import add_shard

    task = ray.remote(num_cpus=1, max_retries=3)(add_shard)
    pending = {}
    for s in range(len(bounds) - 1):
        lo, hi = int(bounds[s]), int(bounds[s + 1])
        name = f"shard-{first_number + s:03d}"
        pending[task.remote(work, name, keys[lo:hi], values[lo:hi], trained, keep_keys)] = (name, hi - lo)
    done: dict[str, ShardEntry] = {}
    try:
        for ref in _as_completed(list(pending)):
            name, entries = pending[ref]
            done[name] = ray.get(ref)
            if not (work / name).exists():
                raise ClusterError(f"{name} was written where this machine does not see it: --ray needs a filesystem every node shares")
            bar.update(entries)
    except ray.exceptions.RayError as e:
        raise _cause(e) from None
    return [done[name] for name, _ in pending.values()]


def _as_completed(refs: list):
    import ray

    while refs:
        ready, refs = ray.wait(refs, num_returns=1)
        yield ready[0]
