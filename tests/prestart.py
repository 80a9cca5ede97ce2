"""A module's slow setup (its datastores built, its server started) begun in the background while
the module before it runs, where that module times nothing: a start is mostly one process at a
time importing vLLM, and such a module leaves the other core idle most of the time.

A module opts in with a generator function `prepare` over session fixtures (named by its
parameters) that yields what its tests use and cleans up after the yield, and a module fixture
that calls `prepared(request, prepare)`. Run alone, or after a module that times something, the
setup runs in place, as a fixture would.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

# Modules beside which the next module's setup may run: they assert no time and no load, so a
# neighbour's start costs them nothing but time; they leave the process's environment, which a
# server started meanwhile takes, as they found it; and they leave a core idle much of the time
# (not test_cluster_build: its encoders take both cores, and a neighbour's start slowed it by as
# much as it saved). Each is the module before one that opts in.
HOSTS = {"test_eval", "test_eval_tasks", "test_index_builder", "test_living_datastores"}

_following: dict[str, object] = {}  # module name -> the module that runs after it this session
_begun: dict[str, tuple[Iterator, Future]] = {}  # module name -> its setup, and the future of its first yield
_pool = ThreadPoolExecutor(1, thread_name_prefix="prestart")


def pytest_collection_finish(session) -> None:
    modules = list(dict.fromkeys(item.module for item in session.items if item.module is not None))
    _following.update({m.__name__: n for m, n in zip(modules, modules[1:])})


def _start(setup, request) -> Iterator:
    return setup(**{name: request.getfixturevalue(name) for name in inspect.signature(setup).parameters})


_loading = threading.RLock()


def _one_model_load_at_a_time() -> None:
    """transformers builds a model under a process-wide patch of torch's parameter registration
    (its meta-device init), so two threads loading at once corrupt each other's models ("Cannot
    copy out of meta tensor"): while setups run beside modules, this process's loads take turns."""
    from transformers import PreTrainedModel

    for name in ("from_pretrained", "_from_config"):
        original = getattr(PreTrainedModel, name).__func__
        if getattr(original, "takes_turns", False):
            continue

        def in_turn(cls, *args, _original=original, **kwargs):
            with _loading:
                return _original(cls, *args, **kwargs)

        in_turn.takes_turns = True
        setattr(PreTrainedModel, name, classmethod(in_turn))


@pytest.fixture(scope="module", autouse=True)
def next_module_setup_in_background(request) -> None:
    following = _following.get(request.module.__name__)
    setup = getattr(following, "prepare", None)
    if request.module.__name__ in HOSTS and inspect.isgeneratorfunction(setup):
        _one_model_load_at_a_time()
        steps = _start(setup, request)
        _begun[following.__name__] = steps, _pool.submit(next, steps)


@contextlib.contextmanager
def prepared(request, setup) -> Iterator:
    """What `setup` yields: begun beside the module before, or run now. Cleaned up on exit."""
    begun = _begun.pop(request.module.__name__, None)
    if begun:
        steps, value = begun[0], begun[1].result()
    else:
        steps = _start(setup, request)
        value = next(steps)
    try:
        yield value
    finally:
        steps.close()


@pytest.fixture(scope="session", autouse=True)
def setups_never_used() -> Iterator[None]:
    """A session that stops before a begun module runs (-x, a keyboard interrupt) still stops its server."""
    yield
    for steps, first in _begun.values():
        with contextlib.suppress(Exception):
            first.result()
        steps.close()
