"""`knnlm-index build --ray` on a real two-node Ray cluster on this machine (Ray's test-cluster
utility: two raylets), and `--stream`: the datastore equals the local build's, a worker killed
mid-encode and a killed driver cost no correctness, streaming keeps one shard's keys on disk,
and a cluster that cannot run the build is refused with an error naming why."""

from __future__ import annotations

import importlib
import inspect
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from index_builder.build import build_datastore
from index_builder.verify import verify_datastore
from knnlm_core.config import BuildConfig
from knnlm_core.datastore import read_manifest

pytestmark = pytest.mark.slow

MODULES = ("json", "argparse", "heapq", "re", "csv", "textwrap", "subprocess", "functools")
# Long windows with a short stride: enough forward passes for a kill to land mid-encode.
CONFIG = BuildConfig(context_length=256, stride=32, batch_size=4, index="IVF8,Flat", shards=3, keep_keys=True, train_sample=4096)
FLAGS = ["--context-length", "256", "--stride", "32", "--batch-size", "4", "--index", "IVF8,Flat", "--shards", "3", "--keep-keys"]
FLAGS += ["--train-sample", "4096", "--part-entries", "256"]  # not --quiet: the log names each node's rate


def write_documented(directory: Path) -> Path:
    """Real documentation every machine has: modules' docstrings and their members' (about 11,800
    tokens: enough for the build to hold out a calibration slice, and for a kill to land mid-encode)."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in MODULES:
        module = importlib.import_module(name)
        members = [v for k, v in sorted(vars(module).items()) if not k.startswith("_") and getattr(v, "__module__", "") == name]
        docs = [module.__doc__ or ""] + [inspect.getdoc(v) or "" for v in members if inspect.isfunction(v) or inspect.isclass(v)]
        (directory / f"{name}.txt").write_text("\n\n".join(d for d in docs if d))
    return directory


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    yield cluster
    cluster.shutdown()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_documented(tmp_path_factory.mktemp("documented"))


@pytest.fixture(scope="module")
def local(corpus, tiny_model_dir, tmp_path_factory) -> Path:
    """The same corpus built in one process, as without --ray."""
    out = tmp_path_factory.mktemp("local") / "ds"
    build_datastore([corpus], out, tiny_model_dir, CONFIG, progress=False)
    return out


@pytest.fixture(scope="module")
def ray_build(cluster, corpus, tiny_model_dir, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """The corpus built on the cluster, and what the build printed."""
    out = tmp_path_factory.mktemp("on-ray") / "ds"
    return out, knnlm_index_build(corpus, out, tiny_model_dir, "--ray", cluster.address)


def build_command(corpus: Path, out: Path, model: Path, *flags: str) -> list[str]:
    return [sys.executable, "-m", "index_builder.cli", "build", str(corpus), "-o", str(out), "--model", str(model), *FLAGS, *flags]


def knnlm_index_build(
    corpus: Path, out: Path, model: Path, *flags: str, timeout: float = 400, env: dict | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(build_command(corpus, out, model, *flags), capture_output=True, text=True, timeout=timeout, env=env)


def start_build(corpus: Path, out: Path, model: Path, *flags: str) -> subprocess.Popen:
    return subprocess.Popen(build_command(corpus, out, model, *flags), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def parts_of(out: Path) -> list[Path]:
    return sorted((out.with_name(f".{out.name}.partial") / "parts").glob("part-*.npy"))


def wait_for_parts(out: Path, count: int, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while len(parts_of(out)) < count:
        assert proc.poll() is None, f"the build ended before {count} parts were encoded: {proc.stderr.read()[-2000:]}"
        assert time.monotonic() < deadline, f"fewer than {count} parts after {timeout} s"
        time.sleep(0.05)


def encoded_tokens(log: str) -> dict[str, int]:
    """Tokens each node encoded, from the driver's log lines."""
    return {node: int(n.replace(",", "")) for node, n in re.findall(r"encode: node (\S+): ([\d,]+) tokens at", log)}


def assert_same_datastore(built: Path, reference: Path) -> None:
    """What a user of the datastore reads: the same entries, values, documents, provenance,
    passages and calibration, and keys within fp16 rounding."""
    a, b = read_manifest(built), read_manifest(reference)
    assert (a.entries, a.dim, a.index) == (b.entries, b.dim, b.index)
    assert [(s.name, s.entries, s.values) for s in a.shards] == [(s.name, s.entries, s.values) for s in b.shards]
    for ours, theirs in zip(a.shards, b.shards):
        keys, expected = np.load(built / ours.keys.path), np.load(reference / theirs.keys.path)
        assert keys.shape == expected.shape
        assert np.abs(keys.view(np.int16).astype(np.int32) - expected.view(np.int16)).max() <= 1  # within one fp16 step
    assert a.documents == b.documents and a.provenance == b.provenance
    assert a.passages.file == b.passages.file and a.passages.gate == pytest.approx(b.passages.gate)
    assert a.calibration.model_dump(exclude={"created"}) == b.calibration.model_dump(exclude={"created"})
    assert a.calibration.tokens > 0


def test_a_build_on_a_two_node_cluster_equals_the_local_build_and_logs_each_nodes_rate(ray_build, local):
    out, result = ray_build
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_datastore(out, local)
    ours, theirs = verify_datastore(out, samples=500), verify_datastore(local, samples=500)
    assert ours["recall_at_1"] == theirs["recall_at_1"] and not ours["problems"]
    rates = encoded_tokens(result.stderr)
    assert len(rates) == 2, f"both nodes encode: {rates}"  # one worker per node (each has one CPU)
    assert not out.with_name(".ds.partial").exists()


def test_a_killed_driver_resumes_on_rerun_without_encoding_its_parts_again(cluster, corpus, local, ray_build, tiny_model_dir, tmp_path):
    out = tmp_path / "ds"
    proc = start_build(corpus, out, tiny_model_dir, "--ray", cluster.address)
    wait_for_parts(out, 6, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    kept = len(parts_of(out))
    assert not out.exists(), "a killed build must not leave a datastore-looking directory"
    resumed = knnlm_index_build(corpus, out, tiny_model_dir, "--ray", cluster.address)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_datastore(out, local)
    full = sum(encoded_tokens(ray_build[1].stderr).values())
    assert sum(encoded_tokens(resumed.stderr).values()) < full, f"{kept} parts were kept"


def test_a_streamed_build_with_a_worker_killed_mid_encode_keeps_one_shards_keys_on_disk_and_equals_the_local_build(
    cluster, corpus, local, tiny_model_dir, tmp_path
):
    out, peak, done = tmp_path / "ds", [0], threading.Event()
    work = out.with_name(f".{out.name}.partial")

    def watch() -> None:  # the bytes of key files in the work directory, every few milliseconds
        while not done.is_set():
            size = sum(_key_bytes(f) for d in ("parts", "sample", "") for f in (work / d).glob("*.npy*"))
            peak[0] = max(peak[0], size)
            time.sleep(0.005)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    proc = start_build(corpus, out, tiny_model_dir, "--ray", cluster.address, "--stream")
    wait_for_parts(out, 2, proc)  # the sample is encoded and trained on: the first shard's parts come
    workers = [p for p in psutil.process_iter(["cmdline"]) if "PartEncoder" in " ".join(p.info["cmdline"] or [])]
    assert workers, "no encode worker process found"
    workers[0].send_signal(signal.SIGKILL)  # as a node's out-of-memory killer would, mid-encode (the build is running)
    assert psutil.wait_procs(workers[:1], timeout=30)[0], "the worker died"
    _, stderr = proc.communicate(timeout=400)
    done.set()
    watcher.join()
    assert proc.returncode == 0, stderr[-3000:]
    assert_same_datastore(out, local)
    manifest = read_manifest(out)
    all_keys = manifest.entries * manifest.dim * 2
    one_shard = max(s.entries for s in manifest.shards) * manifest.dim * 2
    part = 256 * 2 * manifest.dim * 2  # a part at each end of a shard, partly another shard's
    assert 0 < peak[0] <= one_shard + 2 * part + 4096, (peak[0], one_shard, all_keys)
    assert peak[0] < 0.6 * all_keys


def _key_bytes(f: Path) -> int:
    """The size of a key file of the build (a part, a piece of the sample, or the whole keys.npy,
    never while streaming); 0 for anything else, or for a file renamed or removed while looked at."""
    if f.parent.name not in ("parts", "sample") and not f.name.startswith("keys.npy"):
        return 0
    try:
        return f.stat().st_size
    except OSError:
        return 0


def test_an_unreachable_cluster_is_one_line_naming_it_and_writes_nothing(corpus, tiny_model_dir, tmp_path):
    result = knnlm_index_build(corpus, tmp_path / "ds", tiny_model_dir, "--ray", "127.0.0.1:9", timeout=120)
    assert result.returncode != 0
    assert result.stderr.strip().splitlines()[-1].startswith("knnlm-index: error: --ray 127.0.0.1:9: nothing answers there")
    assert not (tmp_path / "ds").exists() and not (tmp_path / ".ds.partial").exists()
    badly_written = knnlm_index_build(corpus, tmp_path / "ds", tiny_model_dir, "--ray", "headnode", timeout=120)
    assert "give the cluster's address as HOST:PORT" in badly_written.stderr


# The hand-started cluster's processes and its clients, all without Ray's token authentication:
# whether `ray start` turns it on depends on a token file another Ray on this machine may have left.
NO_TOKEN = {**os.environ, "RAY_AUTH_MODE": "disabled"}


def _ray_start(*args: str) -> subprocess.Popen:
    ray = Path(sys.executable).with_name("ray")
    command = [str(ray), "start", "--block", "--disable-usage-stats", *args]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=NO_TOKEN, start_new_session=True)


def _stop(process: subprocess.Popen) -> None:
    """A `ray start --block` and every process it started (its GCS, raylet, agents): its session.
    A node in its own mount namespace outlives a SIGTERM for as long as the wait allows, so the
    group gets a SIGKILL after a short grace."""
    for sig, grace in ((signal.SIGTERM, 3), (signal.SIGKILL, 30)):
        try:
            os.killpg(process.pid, sig)
            process.wait(timeout=grace)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    time.sleep(1)  # the group's other processes end after its leader


def wait_for_cpus(address: str, cpus: int, timeout: float = 120) -> None:
    """Until the cluster at `address` answers and has `cpus` CPUs (its worker node joined), asked
    from another process."""
    ask = (
        "import ray, sys, time\n"
        f"deadline = time.monotonic() + {timeout}\n"
        "while True:\n"
        "    try:\n"
        f"        ray.init(address='{address}'); break\n"
        "    except Exception:\n"
        "        if time.monotonic() > deadline: raise\n"
        "        time.sleep(1)\n"
        f"while ray.cluster_resources().get('CPU', 0) < {cpus}:\n"
        "    if time.monotonic() > deadline: sys.exit('the worker node did not join')\n"
        "    time.sleep(0.5)\n"
    )
    subprocess.run([sys.executable, "-c", ask], check=True, timeout=timeout + 60, capture_output=True, env=NO_TOKEN)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="hiding a path from one node needs root's unshare")
def test_a_node_without_the_model_and_the_shared_directory_is_refused_naming_the_node_and_both_paths(corpus, tiny_model_dir, tmp_path):
    """Two `ray start` on this machine: a head that runs nothing, and a worker node in its own
    mount namespace where the model and the datastore's parent directory are empty tmpfs (a node
    without the model's files and without the shared filesystem: one error names both fixes)."""
    out = tmp_path / "out"
    out.mkdir()
    port = _free_port()
    head = _ray_start("--head", f"--port={port}", "--num-cpus=0", "--include-dashboard=false")
    ray = Path(sys.executable).with_name("ray")
    hide = " && ".join(f'mount -t tmpfs tmpfs "{path}"' for path in (tiny_model_dir, out))
    node = subprocess.Popen(
        [
            "unshare",
            "-m",
            "--propagation",
            "private",
            "sh",
            "-c",
            f'{hide} && exec "{ray}" start --block --address=127.0.0.1:{port} --num-cpus=1',
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=NO_TOKEN,
        start_new_session=True,
    )
    try:
        wait_for_cpus(f"127.0.0.1:{port}", 1)
        result = knnlm_index_build(corpus, out / "ds", tiny_model_dir, "--ray", f"127.0.0.1:{port}", timeout=300, env=NO_TOKEN)
        assert result.returncode != 0
        last = result.stderr.strip().splitlines()[-1]
        assert "node " in last, last
        assert f"has no model at {tiny_model_dir}" in last and f"does not see the build's work directory {out}" in last, last
        assert not (out / "ds").exists()
    finally:
        for p in (node, head):
            _stop(p)


def test_a_build_whose_only_worker_node_dies_stops_with_an_error_and_resumes(corpus, local, tiny_model_dir, tmp_path):
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    node = cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    try:
        out = tmp_path / "ds"
        proc = start_build(corpus, out, tiny_model_dir, "--ray", cluster.address, "--node-wait-s", "5")
        wait_for_parts(out, 2, proc)
        cluster.remove_node(node)
        _, stderr = proc.communicate(timeout=300)
        assert proc.returncode != 0
        # Ray Data's own threads may still print an error of theirs as the process exits after it
        assert any("knnlm-index" in line and "no node of the cluster could run an encode worker" in line for line in stderr.splitlines())
        assert not out.exists() and parts_of(out), "the parts encoded so far are kept for a rerun"
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        resumed = knnlm_index_build(corpus, out, tiny_model_dir, "--ray", cluster.address)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert_same_datastore(out, local)
    finally:
        cluster.shutdown()


def test_an_add_and_a_compact_on_the_cluster_equal_the_same_in_one_process(cluster, local, tiny_model_dir, tmp_path):
    new = tmp_path / "new"
    new.mkdir()
    for name in ("difflib", "shlex"):
        (new / f"{name}.txt").write_text(importlib.import_module(name).__doc__)
    here, there = tmp_path / "here", tmp_path / "there"
    shutil.copytree(local, here)
    shutil.copytree(local, there)
    index = [sys.executable, "-m", "index_builder.cli", "add"]
    for datastore, flags in ((here, []), (there, ["--ray", cluster.address])):
        added = subprocess.run([*index, str(datastore), str(new), "--model", str(tiny_model_dir), *flags], capture_output=True, text=True)
        assert added.returncode == 0, added.stderr[-3000:]
    a, b = read_manifest(there), read_manifest(here)
    assert a.entries == b.entries > read_manifest(local).entries
    assert [(s.name, s.entries, s.values, s.index) for s in a.shards] == [(s.name, s.entries, s.values, s.index) for s in b.shards]
    assert a.documents == b.documents and a.provenance == b.provenance
    for datastore, flags in ((here, []), (there, ["--ray", cluster.address])):
        compacted = subprocess.run([*index[:-1], "compact", str(datastore), *flags], capture_output=True, text=True)
        assert compacted.returncode == 0, compacted.stderr[-3000:]
    a, b = read_manifest(there), read_manifest(here)
    assert not a.additions and [(s.name, s.values, s.index) for s in a.shards] == [(s.name, s.values, s.index) for s in b.shards]
