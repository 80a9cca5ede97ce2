"""The server under test: started from a config, or a running one reached through its admin API,
and the events a run can inject (a hot-swap, a killed shard actor)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path


def admin(base_url: str, token: str, method: str, route: str, body: dict | None = None) -> dict:
    request = urllib.request.Request(
        f"{base_url}/v1/knn{route}",
        method=method,
        headers={"X-Admin-Token": token, "Content-Type": "application/json"},
        data=json.dumps(body).encode() if body else None,
    )
    return json.loads(urllib.request.urlopen(request, timeout=300).read())


def during(delay_s: float, action, record: dict) -> threading.Thread:
    """Run `action` once, `delay_s` into the next run (hot-swap / shard-kill); note what happened."""

    def fire():
        time.sleep(delay_s)
        start = time.monotonic()
        try:
            action()
            record.update(ok=True)
        except Exception as e:  # noqa: BLE001 - reported, not raised: the run goes on
            record.update(ok=False, error=repr(e))
        record.update(at_s=delay_s, took_s=round(time.monotonic() - start, 2))

    thread = threading.Thread(target=fire, daemon=True)
    thread.start()
    return thread


def kill_one_shard(base_url: str, token: str, started_here: bool) -> None:
    """One shard actor's process ends as in a crash; Ray restarts it. A server this load test
    started runs its actors on this machine, in a Ray cluster of its own: its pid is killed.
    Another server's actor is killed through the Ray cluster RAY_ADDRESS names (else the last one
    started on this machine)."""
    health = admin(base_url, token, "GET", "/health")
    if started_here:
        os.kill(health["shards"][0]["pid"], signal.SIGKILL)
        return
    import ray

    actor = health["shards"][0]["actor"]
    ray.init(address="auto", namespace=health["ray_namespace"], log_to_driver=False)
    try:
        ray.kill(ray.get_actor(actor), no_restart=False)
    finally:
        ray.shutdown()


def swap_root(config: Path, swap_to: str) -> Path:
    """The datastore root the started server needs so the mid-run hot-swap is allowed."""
    import yaml

    from knnlm_core.model_dir import cache_dir

    if swap_to not in ("default", "none"):
        return Path(swap_to).resolve().parent
    knn = yaml.safe_load(config.read_text()).get("knn", {})
    name = knn.get("default_datastore") or next(iter(knn.get("datastores", {})), None)
    path = knn.get("datastores", {}).get(name, "default")
    return cache_dir() / "datastores" if path == "default" else Path(path).resolve().parent


@contextlib.contextmanager
def started_server(
    config: Path,
    admin_token: str,
    datastore_root: Path,
    log_dir: Path,
    extra_datastores: dict[str, str],
    draft_tokens: int | None = None,
    keys_file: Path | None = None,
    api_key: str | None = None,
):
    import yaml

    from knnlm_core.default_model import resolve_model
    from knnlm_serve.server.process import RunningServer

    settings = yaml.safe_load(config.read_text())
    # Off and on runs replay the same prompts: without this the second run would hit the prefix cache.
    settings["vllm_args"] = [*settings.get("vllm_args", []), "--no-enable-prefix-caching"]
    knn = settings.setdefault("knn", {})
    knn.update(admin_token=admin_token, datastore_root=str(datastore_root))
    knn["datastores"] = {**knn.get("datastores", {}), **extra_datastores}
    if draft_tokens is not None:
        knn["draft_tokens"] = draft_tokens
    if keys_file is not None:
        knn["keys_file"] = str(keys_file.resolve())
    with RunningServer(settings, log_dir, api_key=api_key) as server:
        yield server.base_url, settings.get("served_model_name") or "default", str(resolve_model(settings.get("model", "default")))


def load_into_running_server(base_url: str, token: str, datastores: dict[str, str]) -> None:
    """--base-url with --datastore: load each through the admin API, or stop before sending any traffic."""
    for name, path in datastores.items():
        try:
            admin(base_url, token, "POST", "/datastores", {"name": name, "path": path})
        except urllib.error.HTTPError as e:
            raise SystemExit(
                f"loadtest: error: the server at {base_url} did not load datastore {name}={path} "
                f"(HTTP {e.code}: {e.read().decode()[:300]}); check --admin-token and that PATH is under its knn.datastore_root"
            ) from None
