"""Index-build throughput: `build_datastore` encode rate vs the model's bare forward pass.

For each corpus size (a prefix of WikiText-2 valid, by characters) this runs, each in a fresh
subprocess so that peak RSS is per run:

  * a build with the default BuildConfig except `index="flat"`, recording tokens, entries,
    wall seconds, the manifest's encode tokens/s, peak RSS and the key bytes on disk;
  * the baseline: the same windows (`plan_windows` over the same tokenization), batched and
    right-padded exactly as the builder does, through `model(input_ids=ids, use_cache=False)`.
    Each baseline batch is also run through `model.model(...)` (the decoder stack without the LM
    head), interleaved batch by batch, because the builder stops at the last layer's MLP input
    and never computes logits: the full forward does ~30% more matmul work than the encoder.

Schedule: baseline, build, baseline on the first size (the baselines are averaged, so machine
noise hits both sides alike; `--repeats N` runs N build+baseline pairs, builds averaged too);
later sizes get one build and, with `--baseline-every-size`, a baseline after it. The ratio for
a size uses that size's baselines if it has any, else the first size's (all windows but each
document's first have the same shape, so the per-token rate does not depend on corpus length).

    .venv/bin/python benchmarks/build_throughput.py            # ~8k and ~32k tokens
    .venv/bin/python benchmarks/build_throughput.py --chars 20000 80000 --baseline-every-size

Writes benchmarks/results/build_throughput.json and prints a Markdown table. WikiText is read
from ../shared/data/wikitext-2 beside the repository and prepared in a temporary directory
outside it; the datastores are built there too and deleted afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks/results/build_throughput.json"
DEFAULT_CHARS = (32_000, 128_000)  # about 8k and 32k SmolLM2 tokens (WikiText: ~3.95 chars/token)

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from wikitext import WIKITEXT, WIKITEXT_UNESCAPE, prepare_corpus  # noqa: E402


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def bench_config():
    from knnlm_core.config import BuildConfig

    # Flat index: this benchmark measures the encode path. For a corpus this small `auto` picks
    # Flat anyway; pinning it keeps IVF-PQ training time out of the build's wall seconds (index
    # training is reported separately) and makes the key bytes on disk a plain fp32 figure.
    return BuildConfig(index="flat")


# ---------------------------------------------------------------- child processes


def child_build(spec: dict) -> dict:
    import torch

    from index_builder.build import build_datastore

    config = bench_config()
    t0 = time.monotonic()
    manifest = build_datastore([spec["corpus"]], spec["output"], spec["model_dir"], config, overwrite=True, progress=True)
    wall = time.monotonic() - t0
    output = Path(spec["output"])
    return {
        "kind": "build",
        "tokens": manifest.corpus.tokens,
        "documents": manifest.corpus.documents,
        "entries": manifest.entries,
        "factory": manifest.index.factory,
        "key_type": manifest.key_type,
        "dim": manifest.dim,
        "wall_s": round(wall, 2),
        "manifest_seconds": manifest.build.seconds,
        "encode_tokens_per_s": manifest.build.encode_tokens_per_s,
        "peak_rss_mib": round(peak_rss_mib(), 1),
        # Flat index = the keys as fp32 vectors (plus a small header); keep_keys is off by default.
        "key_bytes": sum(s.index.bytes for s in manifest.shards),
        "values_bytes": sum(s.values.bytes for s in manifest.shards),
        "datastore_bytes": sum(p.stat().st_size for p in output.rglob("*") if p.is_file()),
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
    }


def child_baseline(spec: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from knnlm_core.corpus import find_files, tokenize_files
    from knnlm_core.keys import pad_right
    from knnlm_core.windows import fed_tokens, plan_windows

    config = bench_config()
    model_dir = spec["model_dir"]
    tokens, offsets = tokenize_files(find_files([spec["corpus"]]), model_dir, text_field=config.text_field, on_bad_utf8=config.on_bad_utf8)
    plan = plan_windows(offsets, config.context_length, config.stride)
    windows = plan.windows

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with_backbone = spec["backbone"]
    full_s = backbone_s = 0.0
    fed = 0
    starts = range(0, len(windows), config.batch_size)
    with torch.inference_mode():
        for b, i in enumerate(starts):
            j = min(i + config.batch_size, len(windows))
            ids, _ = pad_right([tokens[f:k1] for f, _, k1 in windows[i:j]])
            fed += fed_tokens(plan, i, j)
            # Alternate which pass goes first so cache warmth and noise favour neither.
            order = ("full", "backbone") if b % 2 == 0 else ("backbone", "full")
            for which in order:
                if which == "full":
                    t = time.perf_counter()
                    model(input_ids=ids, use_cache=False)
                    full_s += time.perf_counter() - t
                elif with_backbone:
                    t = time.perf_counter()
                    model.model(input_ids=ids, use_cache=False)
                    backbone_s += time.perf_counter() - t
            print(f"\rbaseline: batch {b + 1}/{len(starts)}, {fed:,} tok fed", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr, flush=True)
    return {
        "kind": "baseline",
        "tokens": int(offsets[-1]),
        "entries": plan.entries,
        "windows": len(windows),
        "fed_tokens": fed,
        "forward_s": round(full_s, 2),
        "forward_tokens_per_s": round(fed / full_s, 1),
        "backbone_s": round(backbone_s, 2) if with_backbone else None,
        "backbone_tokens_per_s": round(fed / backbone_s, 1) if with_backbone else None,
        "peak_rss_mib": round(peak_rss_mib(), 1),  # includes the full forward's logits [8, 512, 49152] fp32
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
    }


def run_child(kind: str, spec: dict, scratch: Path) -> dict:
    result = scratch / f"result-{kind}-{time.monotonic_ns()}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--_child", kind, "--_spec", json.dumps(spec), "--_result", str(result)]
    t0 = time.monotonic()
    subprocess.run(cmd, check=True, cwd=ROOT)
    out = json.loads(result.read_text())
    out["process_wall_s"] = round(time.monotonic() - t0, 2)
    return out


# ---------------------------------------------------------------- driver


def mean(xs):
    xs = [x for x in xs if x is not None]
    return round(sum(xs) / len(xs), 1) if xs else None


def markdown(rows: list[dict]) -> str:
    head = (
        "| chars | tokens | entries | fed tok | build wall s | encode tok/s | fwd tok/s | ratio | "
        "no-head fwd tok/s | ratio (no head) | peak RSS MiB | key MiB |"
    )
    lines = [head, "|" + "---:|" * (head.count("|") - 1)]
    for r in rows:
        fmt = lambda v, spec="": "n/a" if v is None else format(v, spec)  # noqa: E731
        lines.append(
            f"| {r['chars']:,} | {r['tokens']:,} | {r['entries']:,} | {r['fed_tokens']:,} | {r['build_wall_s']:.1f} | "
            f"{r['encode_tokens_per_s']:.1f} | {fmt(r['forward_tokens_per_s'], '.1f')} | {fmt(r['ratio'], '.3f')} | "
            f"{fmt(r['backbone_tokens_per_s'], '.1f')} | {fmt(r['ratio_no_head'], '.3f')} | "
            f"{r['peak_rss_mib']:.0f} | {r['key_bytes'] / 2**20:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--chars", type=int, nargs="+", default=list(DEFAULT_CHARS), help="corpus sizes, in characters of WikiText (default: %(default)s)"
    )
    p.add_argument("--wikitext", type=Path, default=WIKITEXT, help="WikiText-2 directory (default: %(default)s)")
    p.add_argument("--split", default="valid", help="which WikiText file: valid or test (default: %(default)s)")
    p.add_argument("--baseline-every-size", action="store_true", help="also run a baseline after each later size's build")
    p.add_argument(
        "--repeats", type=int, default=1, help="build+baseline pairs after the first baseline on the first size (default: %(default)s)"
    )
    p.add_argument("--no-backbone", action="store_true", help="skip the no-LM-head forward in the baseline (halves its time)")
    p.add_argument("--output", type=Path, default=RESULTS, help="JSON results file (default: %(default)s)")
    p.add_argument("--_child", choices=("build", "baseline"), help=argparse.SUPPRESS)
    p.add_argument("--_spec", help=argparse.SUPPRESS)
    p.add_argument("--_result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args._child:
        fn = child_build if args._child == "build" else child_baseline
        Path(args._result).write_text(json.dumps(fn(json.loads(args._spec))))
        return 0

    source = args.wikitext / f"{args.split}.txt"
    if not source.is_file():
        p.error(f"{source} not found; pass --wikitext DIR")
    from knnlm_core.default_model import prepare_default_model

    started = time.monotonic()
    model_dir = prepare_default_model()
    scratch = Path(tempfile.mkdtemp(prefix="knnlm-build-bench-"))  # outside the repo
    log(f"model {model_dir}; scratch {scratch}; sizes {args.chars} chars of {source}")
    runs: list[dict] = []
    try:
        for n, chars in enumerate(args.chars):
            corpus = prepare_corpus(source, chars, scratch)
            spec = {"corpus": str(corpus), "model_dir": str(model_dir), "backbone": not args.no_backbone}
            build_spec = {**spec, "output": str(scratch / f"datastore-{chars}")}
            if n == 0:
                schedule = ["baseline"] + ["build", "baseline"] * args.repeats
            else:
                schedule = ["build"] + (["baseline"] if args.baseline_every_size else [])
            for step, kind in enumerate(schedule, 1):
                log(f"size {chars:,} chars: {kind} ({step}/{len(schedule)})")
                r = run_child(kind, build_spec if kind == "build" else spec, scratch)
                r["chars"] = chars
                runs.append(r)
                if kind == "build":
                    shutil.rmtree(build_spec["output"], ignore_errors=True)
                    log(
                        f"  build: {r['tokens']:,} tokens, {r['entries']:,} entries, {r['wall_s']:.1f} s, "
                        f"encode {r['encode_tokens_per_s']:.1f} tok/s, peak RSS {r['peak_rss_mib']:.0f} MiB"
                    )
                else:
                    log(
                        f"  baseline: {r['fed_tokens']:,} fed tokens, forward {r['forward_tokens_per_s']:.1f} tok/s, "
                        f"no-head {r['backbone_tokens_per_s']} tok/s, peak RSS {r['peak_rss_mib']:.0f} MiB"
                    )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    rows = []
    first_base = [r for r in runs if r["kind"] == "baseline" and r["chars"] == args.chars[0]]
    for chars in args.chars:
        builds = [r for r in runs if r["kind"] == "build" and r["chars"] == chars]
        build = {**builds[0], **{k: mean(r[k] for r in builds) for k in ("encode_tokens_per_s", "wall_s", "peak_rss_mib")}}
        own = [r for r in runs if r["kind"] == "baseline" and r["chars"] == chars]
        base = own or first_base
        fwd = mean(r["forward_tokens_per_s"] for r in base)
        bb = mean(r["backbone_tokens_per_s"] for r in base)
        config = bench_config()
        plan_fed = _fed_tokens(build["tokens"], config) if build["documents"] == 1 else None
        rows.append(
            {
                "chars": chars,
                "tokens": build["tokens"],
                "entries": build["entries"],
                "fed_tokens": own[0]["fed_tokens"] if own else plan_fed,
                "build_wall_s": build["wall_s"],
                "encode_tokens_per_s": build["encode_tokens_per_s"],
                "forward_tokens_per_s": fwd,
                "backbone_tokens_per_s": bb,
                "baseline_from_chars": chars if own else args.chars[0],
                "ratio": round(build["encode_tokens_per_s"] / fwd, 3) if fwd else None,
                "ratio_no_head": round(build["encode_tokens_per_s"] / bb, 3) if bb else None,
                "peak_rss_mib": build["peak_rss_mib"],
                "key_bytes": build["key_bytes"],
                "key_bytes_per_entry": round(build["key_bytes"] / build["entries"], 1),
                "datastore_bytes": build["datastore_bytes"],
            }
        )
    config = bench_config()
    report = {
        "benchmark": "build_throughput",
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "total_wall_s": round(time.monotonic() - started, 1),
        "model_dir": str(model_dir),
        "corpus": {"source": str(source), "unescaped": [e for e, _ in WIKITEXT_UNESCAPE], "chars": args.chars},
        "build_config": config.model_dump(mode="json"),
        "schedule": f"first size: baseline, (build, baseline) x {args.repeats} (averaged); later sizes: build"
        + (", baseline" if args.baseline_every_size else " (ratio against the first size's baselines)"),
        "machine": {
            "cpu_count": os.cpu_count(),
            "affinity_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "torch_threads": runs[0]["torch_threads"],
            "torch_version": runs[0]["torch_version"],
            "python": platform.python_version(),
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
        },
        "summary": rows,
        "runs": runs,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    log(f"wrote {args.output} ({report['total_wall_s']:.0f} s in all)")
    print(markdown(rows))
    m = report["machine"]
    print(
        f"\n{m['cpu_count']} CPUs, torch {m['torch_version']} with {m['torch_threads']} threads; "
        f"ratio = build encode tok/s / bare forward tok/s over the same fed tokens (target >= 0.8)."
    )
    return 0


def _fed_tokens(tokens: int, config) -> int:
    """Fed tokens of one document of `tokens` tokens, as plan_windows lays it out."""
    import numpy as np

    from knnlm_core.windows import fed_tokens, plan_windows

    return fed_tokens(plan_windows(np.array([0, tokens]), config.context_length, config.stride))


if __name__ == "__main__":
    sys.exit(main())
