"""A `knnlm-serve` server in a child process, and its Prometheus metrics: what tests and load tests drive.

`RunningServer` starts the launcher on a config dict (port chosen free unless given, and chosen
again where another process bound it before the launcher did), waits until
the OpenAI API answers, and stops the whole process group on exit (vLLM's engine, Ray's local
cluster). `scrape_metrics` reads `/metrics` into {series: value}.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PortTaken(RuntimeError):
    """The port a `RunningServer` chose was bound by another process before its launcher bound it."""


class RunningServer:
    def __init__(
        self, config: dict, workdir: Path, startup_timeout: float = 900, env: dict[str, str] | None = None, api_key: str | None = None
    ):
        self.env = {**os.environ, **(env or {})}
        self.api_key = api_key  # the key its clients send (a tenant's, where the server has knn.keys_file)

        self.chosen_port = not config.get("port")  # a free one, chosen here: taken meanwhile, another is chosen
        self.config_path = workdir / "serve.yaml"
        self.log_path = workdir / "serve.log"
        self.startup_timeout = startup_timeout
        self._set_port(config, config.get("port") or free_port())

    def _set_port(self, config: dict, port: int) -> None:
        import yaml

        self.port = port
        self.config = {**config, "port": port, "host": "127.0.0.1"}
        self.config_path.write_text(yaml.safe_dump(self.config, sort_keys=False))  # keep the datastores in order: the first is the default
        self.base_url = f"http://127.0.0.1:{port}"

    def __enter__(self) -> RunningServer:
        for tries_left in (2, 1, 0):
            try:
                return self._start()
            except PortTaken:
                if not (self.chosen_port and tries_left):
                    raise
                self._set_port(self.config, free_port())

    def _start(self) -> RunningServer:
        """Start the launcher and wait until it serves; `PortTaken` where another process bound the
        port this object chose between its choice and the launcher's bind."""
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "knnlm_serve.server.launcher", "--config", str(self.config_path)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=self.env,
        )
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._log.close()
                if f"port: 127.0.0.1:{self.port} cannot be bound" in self.log_tail():
                    raise PortTaken(f"server exited: its port was taken:\n{self.log_tail()}")
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                models = urllib.request.Request(f"{self.base_url}/v1/models", headers=self.auth_headers())
                with urllib.request.urlopen(models, timeout=2) as response:
                    if "data" in json.load(response):  # vLLM's model list, not another process on the port
                        return self
            except (OSError, ValueError):
                pass
            time.sleep(0.25)
        self.__exit__(None, None, None)
        raise TimeoutError(f"server did not start in {self.startup_timeout}s:\n{self.log_tail()}")

    def __exit__(self, *exc) -> None:
        for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        self._log.close()

    def log_tail(self, n: int = 4000) -> str:
        return self.log_path.read_text()[-n:]

    def auth_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def openai_client(self, api_key: str | None = None):
        import openai

        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=api_key or self.api_key or "unused")


def scrape_metrics(base_url: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"{base_url}/metrics", timeout=30).read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def metric_total(values: dict[str, float], pattern: str) -> float:
    """The sum over every series whose name (with labels) matches the regex `pattern` from its start."""
    regex = re.compile(pattern)
    return sum(v for k, v in values.items() if regex.match(k))
