"""Building on a Ray cluster: build time in one process against `--ray` with 1 and 2 workers
(ratios within one run), the disk peak with and without `--stream` at about 1M entries, and the
encode rate of one worker, which `docs/scaling.md`'s build plan rests on.

* **Time.** A prefix of WikiText-2 valid built with the default model (SmolLM2) and the default
  settings but `--no-calibrate` (calibration runs in the driver, the same in every mode). A Ray
  cluster of this machine (Ray's test-cluster utility: one node with every CPU); `--ray` with one
  worker of every CPU, and with two workers of half each. The three builds are interleaved,
  `--rounds` times, each order rotated; medians with min-max.
* **Disk.** The 1M-token corpus of `benchmarks/corpus_1m.py` built in one process and with
  `--stream`, 8 shards, with the default model cut to its first 2 decoder layers (the same keys'
  size, 576 dimensions, at a tenth of the encode time: the disk does not depend on depth). The
  build's work directory is walked every 0.2 s; its peak is the disk peak.

    .venv/bin/python benchmarks/corpus_1m.py --out /tmp/corpus1m
    .venv/bin/python benchmarks/cluster_build.py --corpus1m /tmp/corpus1m

Writes benchmarks/results/cluster_build.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from run_record import run_record
from wikitext import WIKITEXT, prepare_corpus

RESULTS = ROOT / "benchmarks/results/cluster_build"
CLI = [sys.executable, "-m", "index_builder.cli", "build"]


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def node_rates(stderr: str) -> dict[str, float]:
    return {node: float(rate) for node, rate in re.findall(r"encode: node (\S+): [\d,]+ tokens at (\d+) tokens/s", stderr)}


def timed_build(args: list[str]) -> dict:
    began = time.monotonic()
    done = subprocess.run(CLI + args, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"build failed: {done.stderr[-3000:]}")
    out = Path(args[args.index("-o") + 1])
    manifest = json.loads((out / "manifest.json").read_text())
    return {
        "seconds": round(time.monotonic() - began, 2),
        "entries": manifest["entries"],
        "encode_tokens_per_s": manifest["build"]["encode_tokens_per_s"],
        "worker_tokens_per_s": node_rates(done.stderr),
    }


def build_times(corpus: Path, rounds: int, work: Path) -> dict:
    from ray.cluster_utils import Cluster

    cpus = len(os.sched_getaffinity(0))
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": cpus, "include_dashboard": False})
    modes = {
        "local": [],
        "ray_1_worker": ["--ray", cluster.address, "--workers", "1", "--worker-cpus", str(cpus)],
        "ray_2_workers": ["--ray", cluster.address, "--workers", "2", "--worker-cpus", str(cpus / 2)],
    }
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    try:
        for r in range(rounds + 1):  # round 0 warms the page cache and Ray's workers; not kept
            order = list(modes)[r % 3 :] + list(modes)[: r % 3]
            for mode in order:
                out = work / f"{mode}-{r}"
                run = timed_build([str(corpus), "-o", str(out), "--no-calibrate", *modes[mode]])
                log(f"round {r} {mode}: {run['seconds']} s, {run['entries']:,} entries")
                if r:
                    runs[mode].append(run)
                subprocess.run(["rm", "-rf", str(out)], check=True)
    finally:
        cluster.shutdown()
    local = [run["seconds"] for run in runs["local"]]
    summary = {}
    for mode, mode_runs in runs.items():
        ratios = [lo / run["seconds"] for lo, run in zip(local, mode_runs)]  # speed against local, same round
        summary[mode] = {
            "seconds_median": statistics.median(run["seconds"] for run in mode_runs),
            "speed_vs_local_median": round(statistics.median(ratios), 3),
            "speed_vs_local_range": [round(min(ratios), 3), round(max(ratios), 3)],
            "worker_tokens_per_s": [rate for run in mode_runs for rate in run["worker_tokens_per_s"].values()],
        }
    return {"entries": runs["local"][0]["entries"], "cpus": cpus, "rounds": rounds, "summary": summary, "runs": runs}


def shallow_model(out: Path, layers: int = 2) -> Path:
    """The default model with only its first `layers` decoder layers (same hidden size)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from knnlm_core.default_model import prepare_default_model

    source = prepare_default_model()
    model = AutoModelForCausalLM.from_pretrained(source)
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(source).save_pretrained(out)
    return out


def disk_peak(corpus: Path, model: Path, stream: bool, work: Path) -> dict:
    out = work / ("stream" if stream else "whole")
    partial = out.with_name(f".{out.name}.partial")
    peak, done = [0], threading.Event()

    def size(path: Path) -> int:
        total = 0
        for root, _, files in os.walk(path):
            for f in files:
                try:
                    total += os.stat(os.path.join(root, f)).st_size
                except OSError:  # removed while walked
                    pass
        return total

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], size(partial))
            time.sleep(0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    flags = ["--shards", "8", "--stride", "480", "--no-calibrate", "--quiet", "--model", str(model)] + (["--stream"] if stream else [])
    run = timed_build([str(corpus), "-o", str(out), *flags])
    done.set()
    watcher.join()
    manifest = json.loads((out / "manifest.json").read_text())
    run.update(
        {
            "stream": stream,
            "disk_peak_bytes": peak[0],
            "datastore_bytes": size(out),
            "all_keys_bytes": manifest["entries"] * manifest["dim"] * 2,
            "one_shard_keys_bytes": max(s["entries"] for s in manifest["shards"]) * manifest["dim"] * 2,
            "sample_keys_bytes": manifest["index"]["train_size"] * manifest["dim"] * 2,
            "index": manifest["index"]["factory"],
            "dim": manifest["dim"],
        }
    )
    subprocess.run(["rm", "-rf", str(out)], check=True)
    return run


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    modes = list(result["time"]["summary"])
    s = result["time"]["summary"]
    left.bar(modes, [s[m]["speed_vs_local_median"] for m in modes], color=["#888", "#4a7", "#27a"])
    lows = [s[m]["speed_vs_local_median"] - s[m]["speed_vs_local_range"][0] for m in modes]
    highs = [s[m]["speed_vs_local_range"][1] - s[m]["speed_vs_local_median"] for m in modes]
    left.errorbar(modes, [s[m]["speed_vs_local_median"] for m in modes], yerr=[lows, highs], fmt="none", color="k")
    left.set_ylabel("build speed / one process (higher is faster)")
    left.set_title(f"{result['time']['entries']:,} entries, {result['time']['cpus']} CPUs")
    disk = result["disk"]
    labels = ["one process", "--stream"]
    right.bar(labels, [d["disk_peak_bytes"] / 2**30 for d in disk], color=["#888", "#27a"])
    right.axhline(disk[0]["all_keys_bytes"] / 2**30, ls="--", color="k", label="all keys (fp16)")
    right.set_ylabel("disk peak of the build (GiB)")
    right.set_title(f"{disk[0]['entries']:,} entries, dim {disk[0]['dim']}, 8 shards")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chars", type=int, default=120_000, help="WikiText-2 valid characters for the timed builds")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--corpus1m", type=Path, required=True, help="benchmarks/corpus_1m.py's output")
    args = parser.parse_args()
    result = run_record("cluster_build")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        corpus = prepare_corpus(WIKITEXT / "valid.txt", args.chars, tmp)
        result["time"] = build_times(corpus, args.rounds, tmp)
        model = shallow_model(tmp / "smollm2-2-layers")
        result["disk"] = [disk_peak(args.corpus1m, model, stream, tmp) for stream in (False, True)]
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, RESULTS.with_suffix(".png"))
    print(
        json.dumps(
            {
                "time": result["time"]["summary"],
                "disk": [{k: d[k] for k in ("stream", "disk_peak_bytes", "seconds")} for d in result["disk"]],
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
