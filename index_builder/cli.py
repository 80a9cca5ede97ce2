"""`knnlm-index`: build, calibrate, grow (add), forget, compact, inspect and verify kNN-LM datastores."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import types
import typing
from pathlib import Path

from pydantic import BaseModel, ValidationError

from knnlm_core.config import BuildCluster, BuildConfig
from knnlm_core.config_file import flag_message
from knnlm_core.default_model import DEFAULT_MODEL, model_dir_for
from knnlm_core.errors import ConfigError, KnnlmError
from knnlm_core.flags import positive_int
from knnlm_core.manifest import job_record


def _add_config_flags(parser: argparse.ArgumentParser, model: type[BaseModel], skip: tuple[str, ...] = ()) -> None:
    """One flag per field of `model` (but `skip`), with its type, choices, default and description."""
    for name, field in model.model_fields.items():
        if name in skip:
            continue
        flag = "--" + name.replace("_", "-")
        annotation = field.annotation
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
            annotation = args[0]
        help_text = f"{field.description or ''} (default: {field.default})".strip()
        if annotation is bool and field.default is True:
            parser.add_argument("--no-" + flag[2:], dest=name, action="store_false", default=None, help=f"do not: {field.description}")
        elif annotation is bool:
            parser.add_argument(flag, action="store_true", default=None, help=help_text)
        elif typing.get_origin(annotation) is typing.Literal:
            parser.add_argument(flag, choices=typing.get_args(annotation), help=help_text)
        elif typing.get_origin(field.annotation) is typing.Literal:
            parser.add_argument(flag, choices=args, help=help_text)
        else:
            parser.add_argument(flag, type=annotation, help=help_text)


CALIBRATION_TOLERANCES = ("skip_tolerance", "k_tolerance", "ceiling_tolerance", "nprobe_tolerance")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="knnlm-index", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    build = commands.add_parser("build", help="corpus -> sharded FAISS datastore")
    build.add_argument("inputs", nargs="+", help=".txt/.md/.rst/.jsonl files (optionally .gz) or directories")
    build.add_argument("-o", "--output", required=True, help="datastore directory to create")
    build.add_argument("--model", default=DEFAULT_MODEL, help='"default" (SmolLM2) or an HF causal-LM directory')
    build.add_argument("--overwrite", action="store_true", help="replace an existing datastore at --output")
    build.add_argument("--quiet", action="store_true", help="no progress bars")
    _add_config_flags(build, BuildConfig)
    build.add_argument(
        "--ray",
        nargs="?",
        const="auto",
        dest="ray_address",
        metavar="ADDRESS",
        help="encode and add on a running Ray cluster: its head's HOST:PORT, or none for RAY_ADDRESS or the cluster started "
        "on this machine (docs/datastores.md#building-on-a-cluster)",
    )
    _add_config_flags(build, BuildCluster, skip=("ray_address",))

    store = commands.add_parser(
        "vector-store", help="a vector store built offline from files, as a server keeps one below its knn.datastore_root"
    )
    store.add_argument("root", help="the server's knn.datastore_root")
    store.add_argument("inputs", nargs="+", help="files (.txt .md .rst .html .json .jsonl, .pdf with pypdf) or folders of them")
    store.add_argument("--name", help="the store's name")
    store.add_argument("--owner", help="the key id (knn.keys_file) that owns it; none: the server's one tenant")
    store.add_argument("--model", default=DEFAULT_MODEL, help='"default" (SmolLM2) or the served model\'s directory')
    store.add_argument("--quiet", action="store_true", help="no progress bars")
    _add_config_flags(store, BuildConfig)
    store.add_argument("--ray", nargs="?", const="auto", dest="ray_address", metavar="ADDRESS", help="encode on a running Ray cluster")
    _add_config_flags(store, BuildCluster, skip=("ray_address",))

    calibrate = commands.add_parser(
        "calibrate", help="fit the served λ, τ, k and skip rule of a datastore on held-out text (rewrites only the manifest)"
    )
    calibrate.add_argument("datastore")
    calibrate.add_argument(
        "texts", nargs="*", help="held-out text of the datastore's domain: files or directories; none: the slice its build held out"
    )
    calibrate.add_argument("--model", default=DEFAULT_MODEL, help='the model the datastore was built for: "default" or a directory')
    calibrate.add_argument("--context-length", type=positive_int, help="default: the build's")
    calibrate.add_argument("--stride", type=positive_int, help="default: the build's")
    calibrate.add_argument("--text-field", default=BuildConfig().text_field, help="field holding the text in .jsonl inputs")
    for tolerance in CALIBRATION_TOLERANCES:
        calibrate.add_argument(
            "--" + tolerance.replace("_", "-"),
            type=float,
            default=BuildConfig.model_fields[tolerance].default,
            help=BuildConfig.model_fields[tolerance].description,
        )
    calibrate.add_argument("--quiet", action="store_true", help="no progress bars")

    add = commands.add_parser(
        "add", help="a new version of a datastore with the entries of new documents (old shards reused; resumable, atomic)"
    )
    add.add_argument("datastore")
    add.add_argument("inputs", nargs="+", help="the new documents: .txt/.md/.rst/.jsonl files (optionally .gz) or directories")
    add.add_argument("--model", default=DEFAULT_MODEL, help='the model the datastore was built for: "default" or a directory')
    add.add_argument("--text-field", default=BuildConfig().text_field, help="field holding the text in .jsonl inputs")
    add.add_argument("--batch-size", type=positive_int, help=f"windows per forward pass (default: {BuildConfig().batch_size})")
    add.add_argument("--recalibrate", action="store_true", help="fit the calibration again on the build's held-out slice")
    add.add_argument(
        "--ray", dest="ray_address", nargs="?", const="auto", metavar="ADDRESS", help="encode and add on a running Ray cluster"
    )
    add.add_argument("--quiet", action="store_true", help="no progress bars")

    forget = commands.add_parser(
        "forget", help="a new version of a datastore in which no search, pointer, explanation or snippet reaches some documents"
    )
    forget.add_argument("datastore")
    forget.add_argument("--document", type=int, action="append", default=[], help="a document's number (as explanations show it)")
    forget.add_argument(
        "--source",
        action="append",
        default=[],
        help="every document of this source file: its name as the datastore lists it, or a path to it",
    )
    forget.add_argument("--id", action="append", default=[], help="the document with this .jsonl id")
    forget.add_argument(
        "--erase", action="store_true", help="also take its entries' codes out of the index files now (default: kept until compact)"
    )

    compact = commands.add_parser(
        "compact", help="fold added shards and forgotten documents' tombstones into a plain datastore (resumable, atomic)"
    )
    compact.add_argument("datastore")
    compact.add_argument("--shards", type=positive_int, help="default: as many as the build's shard size needs")
    compact.add_argument(
        "--ray", dest="ray_address", nargs="?", const="auto", metavar="ADDRESS", help="add the shards on a running Ray cluster"
    )
    compact.add_argument("--quiet", action="store_true", help="no progress bars")

    inspect = commands.add_parser("inspect", help="print the manifest and verify checksums")
    inspect.add_argument("datastore")
    inspect.add_argument("--no-checksums", action="store_true", help="skip re-hashing the shard files")

    verify = commands.add_parser("verify", help="search sampled stored keys; report recall@1 and tied distances (exit 1 on a problem)")
    verify.add_argument("datastore")
    verify.add_argument("--samples", type=positive_int, default=1000)
    verify.add_argument("--nprobe", type=positive_int)

    args = parser.parse_args(argv)
    if getattr(args, "quiet", False):
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"  # transformers' model-loading bar too (read when it is imported)
    logging.basicConfig(level=logging.WARNING if getattr(args, "quiet", False) else logging.INFO, format="knnlm-index: %(message)s")
    logging.getLogger("faiss.loader").setLevel(logging.WARNING)  # which SIMD build FAISS loaded is no news
    try:
        if args.command == "build":
            from index_builder.build import build_datastore

            config, cluster = _build_settings(args)
            model_dir = model_dir_for(args.model)
            build_datastore(
                args.inputs, Path(args.output), model_dir, config, cluster=cluster, overwrite=args.overwrite, progress=not args.quiet
            )
        elif args.command == "vector-store":
            from index_builder.vector_store import build_vector_store

            config, cluster = _build_settings(args)
            made = build_vector_store(
                Path(args.root),
                [Path(i) for i in args.inputs],
                model_dir_for(args.model),
                args.name,
                args.owner,
                config,
                cluster,
                not args.quiet,
            )
            print(json.dumps(made.public(), indent=2))
        elif args.command == "calibrate":
            from index_builder.calibrate import recalibrate
            from knnlm_core.datastore import read_manifest

            built = read_manifest(args.datastore)
            try:
                config = BuildConfig(
                    context_length=args.context_length or built.build.context_length,
                    stride=args.stride or built.build.stride,
                    text_field=args.text_field,
                    **{tolerance: getattr(args, tolerance) for tolerance in CALIBRATION_TOLERANCES},
                    dtype=built.model.dtype,
                )
            except ValidationError as e:
                raise ConfigError(flag_message(e)) from None
            manifest = recalibrate(args.datastore, args.texts, model_dir_for(args.model), config, progress=not args.quiet)
            print(json.dumps(manifest.calibration.model_dump(mode="json", by_alias=True), indent=2))
        elif args.command == "add":
            from index_builder.add import add_documents

            manifest, _ = add_documents(
                args.datastore,
                args.inputs,
                model_dir_for(args.model),
                text_field=args.text_field,
                batch_size=args.batch_size,
                recalibrate=args.recalibrate,
                cluster=BuildCluster(ray_address=args.ray_address),
                progress=not args.quiet,
            )
            print(json.dumps(job_record(manifest, "add"), indent=2))
        elif args.command == "forget":
            from index_builder.forget import forget_documents

            _, records = forget_documents(args.datastore, documents=args.document, sources=args.source, ids=args.id, erase=args.erase)
            print(json.dumps([r.model_dump(mode="json") for r in records], indent=2))
        elif args.command == "compact":
            from index_builder.compact import compact_datastore

            manifest = compact_datastore(args.datastore, shards=args.shards, progress=not args.quiet, ray_address=args.ray_address)
            print(json.dumps(job_record(manifest, "compact"), indent=2))
        elif args.command == "inspect":
            from index_builder.verify import inspect_datastore, provenance_summary

            manifest = inspect_datastore(args.datastore, checksums=not args.no_checksums)
            print(json.dumps(manifest.model_dump(mode="json", by_alias=True), indent=2))
            print(
                f"knnlm-index: {args.datastore}: OK ({'checksums verified' if not args.no_checksums else 'checksums not checked'}); "
                f"{provenance_summary(Path(args.datastore), manifest)}",
                file=sys.stderr,
            )
        elif args.command == "verify":
            from index_builder.verify import verify_datastore

            report = verify_datastore(args.datastore, samples=args.samples, nprobe=args.nprobe)
            print(json.dumps(report, indent=2))
            if report["problems"]:
                sys.exit("\n".join(f"knnlm-index: {args.datastore}: {problem}" for problem in report["problems"]))
    except KnnlmError as e:
        sys.exit(f"knnlm-index: error: {e}")
    except OSError as e:  # a path that cannot be made or read (a missing parent, permissions, a full disk)
        sys.exit(f"knnlm-index: error: {e.strerror or e}: {e.filename or 'a file'}")


def _build_settings(args) -> tuple[BuildConfig, BuildCluster]:
    """The build's settings from its flags (those left out: the defaults)."""
    try:
        return tuple(
            model(**{name: getattr(args, name) for name in model.model_fields if getattr(args, name) is not None})
            for model in (BuildConfig, BuildCluster)
        )
    except ValidationError as e:
        raise ConfigError(flag_message(e)) from None


if __name__ == "__main__":
    main()
