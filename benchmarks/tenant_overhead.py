"""What tenants cost: kNN on/off throughput at concurrency 32 on two servers started from the same
config, one with `knn.keys_file` (every request checked against its key's grants and charged to
its key), one without. `--variant ui`: the same for the kNN page, `knn.ui` on against off.

    .venv/bin/python benchmarks/tenant_overhead.py                 # ~20 min on 2 CPU cores
    .venv/bin/python benchmarks/tenant_overhead.py --audit         # with knn.audit_log too (-> ..._audit.json)
    .venv/bin/python benchmarks/tenant_overhead.py --variant ui    # -> benchmarks/results/ui_overhead.json

Both servers run at once (one is idle while the other is measured); after a warm-up round, each
of `--pairs` rounds runs off and on against each server, the servers' order alternating, so
machine noise hits both alike. Traffic is vLLM's serving benchmark through loadtest/bench.py,
sending the key with every request (the server without keys ignores it). Reported: per round,
with keys / without for kNN off and for kNN on, and each server's on/off; medians and spread.
Writes benchmarks/results/tenant_overhead.{json,md} (ui_overhead with --variant ui).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "loadtest")]

from bench import run_benchmark  # noqa: E402
from run import prompts_file  # noqa: E402
from run_record import run_record  # noqa: E402
from server import started_server, swap_root  # noqa: E402

from knnlm_core.keys_file import new_key  # noqa: E402


def keys_for(config: Path, work: Path) -> tuple[Path, str]:
    """A keys file granting one key every datastore of `config`, the first as its default; the key."""
    datastores = list(yaml.safe_load(config.read_text())["knn"]["datastores"])
    key, digest = new_key()
    grant = {"id": "bench", "sha256": digest, "datastores": dict.fromkeys(datastores, ["generate"]), "default": datastores[0]}
    path = work / "keys.yaml"
    path.write_text(yaml.safe_dump({"keys": [grant]}))
    return path, key


def with_knn(config: Path, work: Path, name: str, **knn) -> Path:
    """A copy of `config` with these knn settings."""
    settings = yaml.safe_load(config.read_text())
    settings.setdefault("knn", {}).update(knn)
    path = work / f"config-{name}.yaml"
    path.write_text(yaml.safe_dump(settings, sort_keys=False))
    return path


def summary(values: list[float]) -> dict:
    return {"median": float(np.median(values)), "min": min(values), "max": max(values), "rounds": values}


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=ROOT / "configs/default.yaml")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--variant", choices=["keys", "ui"], default="keys", help="what the second server adds")
    parser.add_argument("--audit", action="store_true", help="keys: the server with keys also writes knn.audit_log")
    parser.add_argument("--out", type=Path, help="default: benchmarks/results/tenant_overhead[_audit].json (ui_overhead.json)")
    args = parser.parse_args()
    default = "ui_overhead" if args.variant == "ui" else "tenant_overhead_audit" if args.audit else "tenant_overhead"
    args.out = args.out or ROOT / "benchmarks/results" / f"{default}.json"

    work = Path(tempfile.mkdtemp(prefix="knnlm-tenants-"))
    keys_file, key = keys_for(args.config, work)
    os.environ["OPENAI_API_KEY"] = key  # vLLM's benchmark client sends it as `Authorization: Bearer`
    dataset = str(work / "prompts.jsonl")
    n = 2 * args.concurrency
    source = prompts_file(Path(dataset), 2 * n, 96)
    root = swap_root(args.config, "none")
    runs: list[dict] = []
    variant = args.variant
    if variant == "keys":
        keyed = with_knn(args.config, work, "audit", audit_log=str(work / "audit.jsonl")) if args.audit else args.config
        setups = {"plain": (args.config, None), "keys": (keyed, keys_file)}
    else:
        setups = {
            "plain": (with_knn(args.config, work, "ui-off", ui=False), None),
            "ui": (with_knn(args.config, work, "ui-on", ui=True), None),
        }
    with contextlib.ExitStack() as stack:
        servers = {}
        for name, (config, keys) in setups.items():
            print(f"tenant_overhead: starting the server {name} ...", flush=True)
            (log := work / name).mkdir()
            servers[name] = stack.enter_context(started_server(config, "bench-admin", root, log, {}, None, keys, key))
        for i in range(args.pairs + 1):
            order = ("plain", variant) if i % 2 == 0 else (variant, "plain")
            for name in order:
                base_url, model, tokenizer = servers[name]
                for knn in (False, True):
                    label = f"{name}-{'on' if knn else 'off'}-{i}"
                    print(f"tenant_overhead: {label}", flush=True)
                    result = run_benchmark(
                        base_url, model, tokenizer, dataset, concurrency=args.concurrency, rate=None, num_prompts=n,
                        output_len=args.output_len, xargs={"knn": knn}, result_dir=work / "runs", label=label,
                    )  # fmt: skip
                    assert result["failed"] == 0, f"{label}: {result['failed']} requests failed"
                    runs.append(result)
    by = {r["label"]: r["output_throughput"] for r in runs}
    rounds = range(1, args.pairs + 1)
    ratios = {
        f"{variant}_over_plain_knn_off": summary([by[f"{variant}-off-{i}"] / by[f"plain-off-{i}"] for i in rounds]),
        f"{variant}_over_plain_knn_on": summary([by[f"{variant}-on-{i}"] / by[f"plain-on-{i}"] for i in rounds]),
        "on_over_off_plain": summary([by[f"plain-on-{i}"] / by[f"plain-off-{i}"] for i in rounds]),
        f"on_over_off_{variant}": summary([by[f"{variant}-on-{i}"] / by[f"{variant}-off-{i}"] for i in rounds]),
    }
    report = {
        **run_record("tenant_overhead"),
        "variant": variant,
        "audit_log": args.audit,
        "config": str(args.config.resolve().relative_to(ROOT)) if args.config.resolve().is_relative_to(ROOT) else args.config.name,
        "concurrency": args.concurrency,
        "requests_per_run": n,
        "output_len": args.output_len,
        "prompts": source,
        "output_throughput": {r["label"]: r["output_throughput"] for r in runs},
        "ratios": ratios,
    }
    args.out.write_text(json.dumps(report, indent=2))
    machine = f"{report['machine']['cpus']} CPU cores, no GPU"
    what = ("Tenants' (with the audit log)" if args.audit else "Tenants'") if variant == "keys" else "The kNN page's"
    lines = [f"# {what} cost at c{args.concurrency} ({report['created']}, commit {report['commit']}, {machine})", ""]
    lines += ["| output throughput ratio | median | min | max |", "|---|---|---|---|"]
    lines += [f"| {name} | {r['median']:.3f} | {r['min']:.3f} | {r['max']:.3f} |" for name, r in ratios.items()]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
