"""The API-server process's one datastore registry, published once by the launcher.

vLLM builds the HTTP app and calls our endpoint plugin itself, so it cannot be handed the
registry as an argument. The launcher publishes it here once, before vLLM starts, with the
future of its configured datastores' loading, which runs while vLLM starts its engine; the admin
plugin waits for it, then moves the registry onto the app's state for its routes and admission.
"""

from __future__ import annotations

from concurrent.futures import Future

_registry = None
_loaded: Future | None = None


def publish_registry(registry, loaded: Future) -> None:
    global _registry, _loaded
    if _registry is not None and registry is not None and _registry is not registry:
        raise RuntimeError("a datastore registry is already published in this process")
    _registry, _loaded = registry, loaded


def published_registry():
    return _registry


def registry_loaded() -> Future:
    """The configured datastores' loading (its result: None; its exception: why they cannot serve)."""
    return _loaded
