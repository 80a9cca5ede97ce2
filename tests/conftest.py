"""Shared fixtures: the real default model, a tiny random Llama that vLLM loads in seconds, servers."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml
from tiny_models import make_tiny_model

from knnlm_core.default_model import prepare_default_model
from knnlm_serve.server.process import RunningServer


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real SmolLM2-135M-Instruct, converted once into the user cache (about 30 s cold)."""
    return prepare_default_model()


def make_tiny_llama(out: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    return make_tiny_model("LlamaForCausalLM", out, tokenizer_dir, seed=seed)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smollm2_dir) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), smollm2_dir)


ROOT = Path(__file__).resolve().parents[1]
TINY_SERVER = {"served_model_name": "tiny", "enforce_eager": True, "kv_cache_gib": 0.25, "max_model_len": 512}
# kNN settings every test server takes unless it tests fail-open itself: an error in kNN's per-step
# path stops the engine, so a bug fails its test instead of being served LM-only (engine/faults.py).
STRICT_KNN = {"fail_open": False}


def admin_knn(root: Path, token: str, **settings) -> dict:
    """kNN settings of a test server that serves `root/a` as `main` at λ 1, with the admin API on
    (loads from below `root`) and a short shard timeout."""
    return {
        "datastores": {"main": str(root / "a")},
        "k": 8,
        "lambda": 1.0,
        "admin_token": token,
        "datastore_root": str(root),
        "shard_timeout_s": 3.0,
        **STRICT_KNN,
        **settings,
    }


@contextlib.contextmanager
def starting(server: RunningServer) -> Iterator[Future]:
    """`server` starting in the background, and stopped on exit: a start is mostly one process at
    a time importing vLLM, so another server's start or tests can use the other core meanwhile.
    The future's result is the running server, or the start's error."""
    pool = ThreadPoolExecutor(1)
    start = pool.submit(server.__enter__)
    pool.shutdown(wait=False)
    try:
        yield start
    finally:  # on an error too: a server left running outlives the session, engine and Ray with it
        if start.exception() is None:  # waits for the start; one that failed has stopped its process already
            server.__exit__(None, None, None)


# Modules that time nothing and stop no process of another's. With test_soak.py selected they run
# first, while its five minutes go on in the background, then test_soak.py waits for the soak's
# end, and the modules that time deadlines or kill processes and nodes run after it.
BESIDE_THE_SOAK = (
    "test_architectures",
    "test_calibration",
    "test_doc_items",
    "test_docs",
    "test_engine_units",
    "test_eval",
    "test_eval_tasks",
    "test_explain",
    "test_interpolate",
    "test_keys_file",
    "test_layout",
    "test_model",
    "test_passages",
    "test_search",
    "test_setup",
    "test_task_items",
    "test_ui",
    "test_uploads",
)
SOAK = "test_soak"


def pytest_collection_modifyitems(items) -> None:
    if any(item.path.stem == SOAK for item in items):
        items.sort(key=lambda item: 0 if item.path.stem in BESIDE_THE_SOAK else 1 if item.path.stem == SOAK else 2)


@pytest.fixture(scope="session", autouse=True)
def soak_in_background(request) -> None:
    if any(item.path.stem == SOAK for item in request.session.items):
        request.getfixturevalue("soak_run")


@pytest.fixture(scope="session")
def soak_run(tiny_model_dir, tmp_path_factory) -> Iterator[tuple[subprocess.Popen, Path]]:
    """loadtest/soak.py's five-minute run on the tiny model, started with the session (the soak
    process, and the folder of its log and report). Its server's worker computes on the last core;
    the tests' servers bind theirs to the first (vLLM's automatic binding)."""
    out = tmp_path_factory.mktemp("soak")
    config = out / "soak.yaml"
    config.write_text(yaml.safe_dump({**TINY_SERVER, "model": str(tiny_model_dir), "knn": {"backend": "ray", "k": 8}}))
    command = [sys.executable, "loadtest/soak.py", "--config", str(config), "--minutes", "5", "--concurrency", "4", "--rate", "2"]
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": str(max(os.sched_getaffinity(0)))}
    with open(out / "soak.log", "w") as log:
        soak = subprocess.Popen(
            [*command, "--fault-every", "20", "--out", str(out / "runs")], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env
        )
        yield soak, out
        if soak.poll() is None:  # the session ended before test_soak.py waited: its server stops with it
            soak.send_signal(signal.SIGINT)
            try:
                soak.wait(timeout=120)
            except subprocess.TimeoutExpired:
                soak.kill()


@pytest.fixture(scope="session")
def plain_tiny_start(tiny_model_dir, tmp_path_factory):
    """Stock vLLM behaviour: the tiny model served with no datastore, starting in the background
    from the setup of the first module that asks for it (test_knn_serving's, beside its own two)."""
    with starting(RunningServer({**TINY_SERVER, "model": str(tiny_model_dir)}, tmp_path_factory.mktemp("plain"))) as start:
        yield start


@pytest.fixture(scope="session")
def plain_tiny_server(plain_tiny_start):
    return plain_tiny_start.result()


@pytest.fixture(scope="session")
def tenant_root(tmp_path_factory, tiny_model_dir) -> Path:
    """test_tenants' and test_vector_stores' datastores, keys file and offline-built store."""
    import tenant_server as shared

    root = tmp_path_factory.mktemp("tenants")
    shared.prepare(root, tiny_model_dir)
    return root


@pytest.fixture(scope="session")
def tenant_server(tenant_root, tiny_model_dir):
    """The server with tenants that test_tenants and test_vector_stores share (tests/tenant_server.py)."""
    import tenant_server as shared

    with RunningServer(shared.config(tenant_root, tiny_model_dir), tenant_root, api_key=shared.KEYS["a"]) as server:
        yield server


@pytest.fixture(scope="session")
def local_server(tmp_path_factory, tiny_model_dir):
    """The server without Ray that test_eval_tasks, test_explain, test_ui and test_tensor_parallel
    (its one-rank reference) share (tests/local_server.py)."""
    import local_server as shared

    root = tmp_path_factory.mktemp("local")
    with RunningServer(shared.config(root, tiny_model_dir), root) as server:
        yield server


def until(condition, timeout: float, what: str) -> None:
    """Wait for `condition()`, failing with `what` after `timeout` seconds."""
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.25)


def continuations(model_dir: Path, prefix: str, texts: dict[str, str], length: int) -> dict[str, list[int]]:
    """The token ids of `prefix` ("prompt"), and of each text's `length` tokens after it."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt = tokenizer(prefix).input_ids
    return {"prompt": prompt, **{k: tokenizer(t).input_ids[len(prompt) : len(prompt) + length] for k, t in texts.items()}}


def prompt_logprobs(server, prompt: list[int], model: str = "tiny", **xargs):
    """log p of each prompt token after the first, as served (echo), with these vllm_xargs."""
    import numpy as np

    result = server.openai_client().completions.create(
        model=model, prompt=prompt, max_tokens=1, temperature=0, echo=True, logprobs=1, extra_body={"vllm_xargs": xargs}
    )
    return np.array(result.choices[0].logprobs.token_logprobs[1 : len(prompt)], dtype=np.float64)


def greedy(server, prompt, max_tokens: int, model: str = "tiny", api_key: str | None = None, **xargs):
    """A greedy completion with its token ids and logprobs, with these vllm_xargs (and this API key)."""
    return (
        server.openai_client(api_key)
        .completions.create(
            model=model,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0,
            logprobs=1,
            extra_body={"vllm_xargs": xargs, "return_token_ids": True},
        )
        .choices[0]
    )


def stream_while(
    server,
    prompt: list[int],
    max_tokens: int,
    during,
    clients: int = 16,
    model: str = "tiny",
    gaps: list | None = None,
    xargs: dict | None = None,
) -> tuple[list, list]:
    """`clients` threads stream greedy completions of `prompt` (with these vllm_xargs) back to back
    while `during()` runs; the token ids of every response, and every failure. `gaps` collects each
    response's longest wait between two chunks."""
    import threading
    import time

    results, errors, stop = [], [], threading.Event()

    def client():
        openai_client = server.openai_client()
        while not stop.is_set():
            try:
                stream = openai_client.completions.create(
                    model=model,
                    prompt=prompt,
                    max_tokens=max_tokens,
                    temperature=0,
                    stream=True,
                    extra_body={"return_token_ids": True, **({"vllm_xargs": xargs} if xargs else {})},
                )
                tokens, last, longest = [], None, 0.0
                for chunk in stream:
                    now = time.monotonic()
                    longest, last = (max(longest, now - last) if last is not None else longest), now
                    tokens.extend(chunk.choices[0].token_ids or [])
                results.append(tokens)
                if gaps is not None:
                    gaps.append(longest)
            except Exception as e:  # noqa: BLE001 - every failure is the caller's to judge
                errors.append(repr(e))

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    try:
        during()
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=300)
    return results, errors


@pytest.fixture(scope="session")
def browser():
    """Debian's headless chromium (`make test` installs it: scripts/browser.sh), driven by Playwright."""
    import shutil

    from playwright.sync_api import sync_playwright

    assert shutil.which("chromium"), "Debian's chromium is missing: `make test` installs it (scripts/browser.sh)"
    flags = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking"]
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=shutil.which("chromium"), args=[*flags, "--disable-component-update", "--disable-sync"]
        )
        yield browser
        browser.close()
