"""Vector stores through the stock `openai` client, on a corpus no setting was chosen on: what an
upload costs until it serves, what a search costs among ten stores, and whether `file_search`
answers questions about the uploaded documentation.

    .venv/bin/python benchmarks/vector_stores.py --sizes 10KB 100KB    # ~40 min on 2 CPU cores
    .venv/bin/python benchmarks/vector_stores.py --upload-only --sizes 1MB   # a new store's first file only

The server is configs/default.yaml's (SmolLM2, the embedded datastore beside), with
`knn.datastore_root` in a work directory. In one run:
  * upload: seconds from `files.create` to the vector-store file's `completed`, for 10 KB, 100 KB and
    1 MB of the corpus's text, each as the first file of a new store (a build) and as a second
    one (an add: the same number of characters, reversed, which tokenizes into more tokens);
  * search: the corpus split over 10 stores; `vector_stores.search` latency, p50 and p99, over the items' questions;
  * exact match: "Which name does this?" questions (`knnlm-eval items`, chat forms) about the
    package's documentation, uploaded one file per module to one store, asked through
    `responses.create` with the store's `file_search`, with `file_search` over the ten stores of
    the search part (the several-stores rule against one store), and without any tool; a reply matches
    where it names the answer as a whole word (knnlm_serve/eval/tasks.py's rule); the control
    items are about modules not uploaded.
Many small stores on one server: benchmarks/many_vector_stores.py.
Writes benchmarks/results/vector_stores.json and .png (with --upload-only, vector_store_uploads.json
and .png: each size as a new store's first file, for the sizes that take most of an hour).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from run_record import run_record  # noqa: E402
from task_eval import knnlm_eval, package_modules, write_documents  # noqa: E402

from knnlm_serve.eval.task_items import read_items  # noqa: E402
from knnlm_serve.eval.tasks import names  # noqa: E402
from knnlm_serve.server.process import RunningServer  # noqa: E402

SIZES = {"10KB": 10_000, "100KB": 100_000, "1MB": 1_000_000}
REPLY_TOKENS = 48


def corpus_text(docs: Path) -> str:
    return "\n\n".join(p.read_text() for p in sorted(docs.glob("*.txt")))


def upload_seconds(client, text: str, store_id: str | None = None) -> tuple[float, str]:
    """Seconds from the upload to `completed`, in a new store unless one is given; the store's id."""
    store_id = store_id or client.vector_stores.create(name="upload").id
    started = time.monotonic()
    done = client.vector_stores.files.upload_and_poll(vector_store_id=store_id, file=("part.txt", text.encode()))
    assert done.status == "completed", done.last_error
    return time.monotonic() - started, store_id


def uploads(client, text: str, sizes: list[str], add: bool) -> dict:
    out = {}
    for name in sizes:
        size = SIZES[name]
        chunk = (text * (1 + size // max(len(text), 1)))[:size]
        built, store = upload_seconds(client, chunk)
        out[name] = {"bytes": size, "build_s": round(built, 1)}
        if add:
            added, _ = upload_seconds(client, chunk[::-1][: size // 2] + chunk[: size // 2][::-1], store)  # other text, same size
            out[name]["add_s"] = round(added, 1)
        client.vector_stores.delete(store)
        print(name, out[name], flush=True)
    return out


def split_stores(client, docs: Path, stores: int = 10) -> list[str]:
    """The corpus's files dealt over `stores` new stores, one batch each."""
    files = sorted(docs.glob("*.txt"))
    ids = []
    for n in range(stores):
        store = client.vector_stores.create(name=f"part-{n}")
        batch = client.vector_stores.file_batches.upload_and_poll(
            vector_store_id=store.id, files=[(f.name, f.read_bytes()) for f in files[n::stores]]
        )
        assert batch.file_counts.completed == batch.file_counts.total
        ids.append(store.id)
    return ids


def searches(client, ids: list[str], questions: list[str]) -> dict:
    seconds = []
    for n, question in enumerate(questions):
        started = time.monotonic()
        client.vector_stores.search(ids[n % len(ids)], query=question, max_num_results=5)
        seconds.append(time.monotonic() - started)
    seconds.sort()
    return {
        "stores": len(ids),
        "searches": len(seconds),
        "p50_ms": round(1000 * statistics.median(seconds), 1),
        "p99_ms": round(1000 * seconds[int(0.99 * (len(seconds) - 1))], 1),
    }


def exact_match(client, docs: Path, items: list, model: str, parts: list[str]) -> dict:
    """Each item without a tool, with `file_search` over one store of the whole corpus, and over
    the same corpus dealt over `parts` (passages ranked across them; kNN from the best passage's store)."""
    store = client.vector_stores.create(name="docs")
    batch = client.vector_stores.file_batches.upload_and_poll(
        vector_store_id=store.id, files=[(f.name, f.read_bytes()) for f in sorted(docs.glob("*.txt"))]
    )
    settings = {
        "plain": {},
        "file_search": {"tools": [{"type": "file_search", "vector_store_ids": [store.id], "max_num_results": 1}]},
        f"file_search_{len(parts)}_stores": {"tools": [{"type": "file_search", "vector_store_ids": parts, "max_num_results": 1}]},
    }
    kinds: dict[str, dict[str, list[bool]]] = {}
    for item in items:
        for setting, extra in settings.items():
            reply = client.responses.create(model=model, input=item.prompt, max_output_tokens=REPLY_TOKENS, temperature=0, **extra)
            kinds.setdefault(item.kind, {}).setdefault(setting, []).append(names(reply.output_text, item.answer))
    client.vector_stores.delete(store.id)
    return {
        "files": batch.file_counts.total,
        "kinds": {k: {s: {"items": len(v), "exact": round(sum(v) / len(v), 3)} for s, v in by.items()} for k, by in kinds.items()},
    }


def questions(docs: Path, control_docs: Path, args) -> list:
    """`knnlm-eval items` about the uploaded modules and the control ones: their questions and paraphrases."""
    path = args.work / "items.jsonl"
    knnlm_eval("items", docs, "--control", control_docs, "--limit", args.limit, "--control-limit", args.control_limit, "-o", path)
    return [i for i in read_items(path) if i.kind.split("/")[-1] in ("question", "paraphrase")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--package", default="click", help="whose modules' documentation is uploaded (no setting was chosen on it)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/knnlm-vector-stores"))
    parser.add_argument("--limit", type=int, default=30, help="stored names asked about")
    parser.add_argument("--control-limit", type=int, default=15)
    parser.add_argument(
        "--sizes", nargs="+", choices=list(SIZES), default=list(SIZES), help="upload sizes to time (1MB: about an hour each way here)"
    )
    parser.add_argument(
        "--upload-only", action="store_true", help="time each size as a new store's first file only (no add, no search, no questions)"
    )
    parser.add_argument(
        "--out", type=Path, help="default: benchmarks/results/vector_stores.json (vector_store_uploads.json with --upload-only)"
    )
    args = parser.parse_args()
    args.out = args.out or ROOT / "benchmarks/results" / ("vector_store_uploads.json" if args.upload_only else "vector_stores.json")
    args.work.mkdir(parents=True, exist_ok=True)
    stored, control = package_modules(args.package)
    docs, control_docs = write_documents(stored, args.work / "docs"), write_documents(control, args.work / "control")
    items = [] if args.upload_only else questions(docs, control_docs, args)
    config = yaml.safe_load((ROOT / "configs/default.yaml").read_text())
    config.pop("port")
    config["knn"]["datastore_root"] = str(args.work / "root")
    (args.work / "server").mkdir(exist_ok=True)
    record = {**run_record("vector_stores"), "package": args.package, "modules": len(stored), "control_modules": len(control)}
    with RunningServer(config, args.work / "server") as server:
        client = server.openai_client()
        record["upload"] = uploads(client, corpus_text(docs), args.sizes, add=not args.upload_only)
        if args.upload_only:
            return finish(record, args.out)
        parts = split_stores(client, docs)
        record["search"] = searches(client, parts, [i.prompt for i in items])
        print(record["search"], flush=True)
        record["exact_match"] = exact_match(client, docs, items, config["served_model_name"], parts)
        print(json.dumps(record["exact_match"], indent=1), flush=True)
        for store in parts:
            client.vector_stores.delete(store)
    finish(record, args.out)


def finish(record: dict, out: Path) -> None:
    out.write_text(json.dumps(record, indent=1) + "\n")
    plot(record, out.with_suffix(".png"))


def plot(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    questions = "exact_match" in record
    fig, axes = plt.subplots(1, 2 if questions else 1, figsize=(11 if questions else 5.5, 4), squeeze=False)
    if questions:
        plot_questions(record, axes[0][0])
    right = axes[0][-1]
    sizes = list(record["upload"])
    phases = [p for p in ("build_s", "add_s") if p in record["upload"][sizes[0]]]
    for n, phase in enumerate(phases):
        right.bar([x + 0.4 * n for x in range(len(sizes))], [record["upload"][s][phase] for s in sizes], width=0.4, label=phase[:-2])
    right.set_xticks([x + 0.2 for x in range(len(sizes))], sizes)
    right.set_ylabel("seconds from upload to completed")
    right.set_title("upload until it serves")
    right.legend()
    fig.suptitle(f"{record['created']}, {record['commit']}, {record['machine']['cpus']} CPUs", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def plot_questions(record: dict, left) -> None:
    kinds = sorted(record["exact_match"]["kinds"])
    settings = list(record["exact_match"]["kinds"][kinds[0]])
    width = 0.8 / len(settings)
    for n, setting in enumerate(settings):
        values = [record["exact_match"]["kinds"][k].get(setting, {}).get("exact", 0) for k in kinds]
        left.bar([x + width * n for x in range(len(kinds))], values, width=width, label=setting)
    left.set_xticks([x + 0.4 - width / 2 for x in range(len(kinds))], kinds, rotation=20, fontsize=8)
    left.set_ylim(0, 1)
    left.set_ylabel("exact match")
    left.set_title(f"questions about {record['package']}'s docs (uploaded)")
    left.legend()


if __name__ == "__main__":
    main()
