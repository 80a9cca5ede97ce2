"""Does kNN help on a task? "Which name does this?" from documentation, asked in three forms, on
two corpora, with kNN off, with calibrated defaults, and with a stronger λ.

    .venv/bin/python benchmarks/task_eval.py          # ~45 min on 2 CPU cores (one build, two servers)

Corpora (each: documents in the datastore, and control documents out of it):
  * pydocs: the embedded default datastore (`make serve`'s: the standard-library modules of
    index_builder.default_datastore.MODULES); control: other standard-library modules, and the
    modules its build held out for calibration.
  * networkx: docstrings of the `networkx` package's algorithms (PyPI; the same layout), a
    datastore built with `knnlm-index build` defaults; control: every fifth module, and the
    build's held-out ones.
  * sympy: the same for the `sympy` package's modules (not in the default run: kept as a corpus
    that no setting or rule was chosen on).
For each: `knnlm-eval items` writes the items; the datastore is calibrated again twice (copies):
`fit` (the best held-out adaptive-λ curve) and `ceiling` (the highest λ at distance 0 within
CEILING of it); a server (configs/default.yaml) serves both, and `knnlm-eval tasks` scores kNN
off, `served` (= fit), `ceiling`, `strong` (a fixed λ) and `strong-noskip` (the same, searching at
every step: the calibrated skip rule leaves out steps where the LM is confident). Writes
benchmarks/results/task_eval/<corpus>/tasks.*, and benchmarks/results/task_eval.json, .md and .png.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import importlib
import json
import pkgutil
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from run_record import run_record

from index_builder.build import build_datastore
from index_builder.calibrate import recalibrate
from index_builder.default_datastore import MODULES, module_documents, prepare_default_datastore
from knnlm_core.config import BuildConfig
from knnlm_core.datastore import read_manifest
from knnlm_core.default_model import prepare_default_model
from knnlm_serve.eval.doc_items import FORMS, stored_hashes
from knnlm_serve.eval.tasks import draw
from knnlm_serve.server.process import RunningServer

STDLIB_CONTROL = (
    "difflib",
    "shutil",
    "calendar",
    "string",
    "random",
    "tempfile",
    "glob",
    "fnmatch",
    "pprint",
    "copy",
    "ipaddress",
    "gettext",
)
CEILING = 0.005  # the ceiling tolerance tried against the best held-out fit
PACKAGE_STORE_CHARS = 480_000  # about 120k tokens, the size of the library-docs store
PACKAGE_CORPORA = {
    "networkx": "networkx.algorithms",
    "sympy": "sympy",
    "matplotlib": "matplotlib",
}  # corpus -> the package whose modules it documents
CORPORA = ("pydocs", *PACKAGE_CORPORA)
DEFAULT_CORPORA = ["pydocs", "networkx"]


def write_documents(modules, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    for name, text in module_documents(modules).items():
        (out / f"{name}.txt").write_text(text)
    return out


@functools.cache  # the corpus and the report's record both ask; a package imports once
def package_modules(package: str) -> tuple[list[str], list[str]]:
    """(stored, control): the package's modules that document two or more names, in name order,
    every fifth one the control; the stored ones until their text reaches PACKAGE_STORE_CHARS.
    Modules that fail to import (optional dependencies) are left out."""
    root = importlib.import_module(package)
    names = sorted(
        m.name
        for m in pkgutil.walk_packages(root.__path__, f"{package}.", onerror=lambda _: None)
        if ".tests" not in m.name and ".benchmarks" not in m.name
    )
    texts = {}
    for name in names:
        with contextlib.suppress(Exception):
            texts[name] = module_documents((name,))[name]
    top = package.split(".")[0]
    documented = [n for n, text in texts.items() if text.count(f"\n\n{top}.") >= 2]
    control = documented[4::5]
    stored, chars = [], 0
    for name in (n for n in documented if n not in control):
        if chars >= PACKAGE_STORE_CHARS:
            break
        stored.append(name)
        chars += len(texts[name])
    return stored, control


def prepare_corpora(names: list[str], work: Path, model_dir: Path) -> dict[str, tuple[Path, Path, Path]]:
    """name -> (datastore, stored documents, control documents), a package corpus's store built once in `work`."""
    corpora = {}
    if "pydocs" in names:
        docs, control = write_documents(MODULES, work / "pydocs-docs"), write_documents(STDLIB_CONTROL, work / "pydocs-control")
        corpora["pydocs"] = (prepare_default_datastore(model_dir), docs, control)
    for name in (n for n in names if n in PACKAGE_CORPORA):
        stored, control_modules = package_modules(PACKAGE_CORPORA[name])
        docs, control = write_documents(stored, work / f"{name}-docs"), write_documents(control_modules, work / f"{name}-control")
        store = work / f"{name}-store"
        if not (store / "manifest.json").exists():
            build_datastore([docs], store, model_dir, BuildConfig())
        corpora[name] = (store, docs, control)
    return corpora


def package_corpus(name: str) -> dict:
    """What a package corpus holds: the package's version, its stored and control modules."""
    stored, control = package_modules(PACKAGE_CORPORA[name])
    top = PACKAGE_CORPORA[name].split(".")[0]
    return {"package": f"{top} {importlib.import_module(top).__version__}", "documents": stored, "control": control}


def knnlm_eval(*args) -> None:
    subprocess.run([sys.executable, "-m", "knnlm_serve.eval.cli", *map(str, args)], check=True)


def calibrated_copies(name: str, datastore: Path, heldout: list[Path], work: Path, model_dir: Path) -> dict[str, Path]:
    """Two copies of the datastore (hard links; only the manifest is rewritten), calibrated again on
    its build's held-out documents: `fit`, the best held-out curve (ceiling tolerance 0), and
    `ceiling`, the curve with the highest λ at distance 0 within CEILING of it."""
    copies = {}
    for variant, tolerance in (("fit", 0.0), ("ceiling", CEILING)):
        copy = work / f"{name}-{variant}"
        shutil.rmtree(copy, ignore_errors=True)
        subprocess.run(["cp", "-al", str(datastore), str(copy)], check=True)
        built = read_manifest(copy)
        config = BuildConfig(context_length=built.build.context_length, stride=built.build.stride, ceiling_tolerance=tolerance)
        recalibrate(copy, heldout, model_dir, config, progress=False)
        copies[f"{name}-{variant}"] = copy
    return copies


def evaluate_corpus(name: str, datastore: Path, docs: Path, control: Path, work: Path, out: Path, model_dir: Path, args) -> dict:
    items = work / f"{name}-items.jsonl"
    knnlm_eval(
        "items",
        docs,
        "--datastore",
        datastore,
        "--control",
        control,
        "--limit",
        args.limit,
        "--control-limit",
        args.control_limit,
        "-o",
        items,
    )
    served = stored_hashes(datastore)
    heldout = [f for f in sorted(docs.glob("*.txt")) if hashlib.sha256(f.read_text().encode()).hexdigest() not in served]
    copies = calibrated_copies(name, datastore, heldout, work, model_dir)
    config = yaml.safe_load((ROOT / "configs/default.yaml").read_text())
    config["knn"]["datastores"] = {n: str(p) for n, p in copies.items()}
    config["knn"]["default_datastore"] = f"{name}-fit"  # what requests that name none get: `served`
    config.pop("port")
    (work / name).mkdir(exist_ok=True)
    with RunningServer(config, work / name) as server:
        knnlm_eval(
            "tasks", items, "--base-url", server.base_url, "--set", f"ceiling:knn_datastore={name}-ceiling",
            "--set", f"strong:knn_lambda={args.strong}", "--set", f"strong-noskip:knn_lambda={args.strong},knn_skip_threshold=1",
            "-o", out / name,
        )  # fmt: skip
    report = json.loads((out / name / "tasks.json").read_text())
    report["calibrations"] = {n: read_manifest(p).calibration.model_dump(mode="json", by_alias=True) for n, p in copies.items()}
    report["datastore_entries"] = read_manifest(datastore).entries
    return report


def plot(reports: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(reports), figsize=(6.2 * len(reports), 6.4), sharex="col", sharey="row", squeeze=False)
    for column, (corpus, report) in enumerate(reports.items()):
        summary = report["summary"]
        kinds = sorted((k for k in summary["off"] if k != "all"), key=lambda k: (k.startswith("control/"), FORMS.index(k.split("/")[-1])))
        draw(axes[:, column], summary, kinds)
        axes[0][column].set_title(f"{corpus} ({report['datastore_entries']:,} entries)")
        if column:
            axes[0][column].set_ylabel(""), axes[1][column].set_ylabel("")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def table(reports: dict) -> str:
    """Per corpus and kind: items, then per setting exact match and (past `off`) the mean gain in the
    answer's log-probability over kNN off."""
    settings = list(next(iter(reports.values()))["summary"])
    rows = [
        "| corpus | kind | items | " + " | ".join(settings) + " | " + " | ".join(f"Δ log p {s}" for s in settings[1:]) + " |",
        "|---|---|---:|" + "---:|" * (2 * len(settings) - 1),
    ]
    for corpus, report in reports.items():
        summary = report["summary"]
        kinds = sorted(
            summary["off"], key=lambda k: (k == "all", k.startswith("control/"), FORMS.index(k.split("/")[-1]) if k != "all" else 0)
        )
        for kind in kinds:
            exact = " | ".join(f"{summary[s][kind]['exact_match']:.1%}" for s in settings)
            gain = " | ".join(f"{summary[s][kind]['vs_off']['mean_logprob_gain']:+.2f}" for s in settings[1:])
            rows.append(f"| {corpus} | {kind} | {summary['off'][kind]['items']} | {exact} | {gain} |")
    return "\n".join(rows) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strong", type=float, default=0.8, help="λ of the stronger setting")
    parser.add_argument("--limit", type=int, default=60, help="documented names sampled per corpus from the stored documents")
    parser.add_argument("--control-limit", type=int, default=30, help="and from the control documents")
    parser.add_argument("--corpora", nargs="+", default=DEFAULT_CORPORA, choices=CORPORA)
    parser.add_argument("--work", type=Path, default=Path("/tmp/knnlm-task-eval"))
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/task_eval")
    args = parser.parse_args()
    record = run_record("task_eval")  # the commit whose code runs, whatever is committed meanwhile
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)

    model_dir = prepare_default_model()
    corpora = prepare_corpora(args.corpora, args.work, model_dir)
    reports = {
        name: evaluate_corpus(name, datastore, docs, control_docs, args.work, args.out, model_dir, args)
        for name, (datastore, docs, control_docs) in corpora.items()
    }
    result = {
        **record,
        "corpora": {
            "pydocs": {"documents": list(MODULES), "control": list(STDLIB_CONTROL)},
            **{name: package_corpus(name) for name in corpora if name in PACKAGE_CORPORA},
        },
        "strong_lambda": args.strong,
        "ceiling_tolerance": CEILING,
        "results": {
            name: {k: r[k] for k in ("datastore_entries", "calibrations", "settings", "skipped", "summary")} for name, r in reports.items()
        },
    }
    (args.out.parent / "task_eval.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(reports, args.out.parent / "task_eval.png")
    (args.out.parent / "task_eval.md").write_text(table(reports))
    print(
        json.dumps(
            {n: {s: {k: round(v["exact_match"], 3) for k, v in by.items()} for s, by in r["summary"].items()} for n, r in reports.items()},
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
