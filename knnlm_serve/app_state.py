"""The API-server process's one datastore registry, published once by the launcher.

vLLM builds the HTTP app and calls our endpoint plugin itself, so it cannot be handed the
registry as an argument. The launcher publishes it here once, before vLLM starts; the admin
plugin moves it onto the app's state for its routes and admission.
"""

from __future__ import annotations

_registry = None


def publish_registry(registry) -> None:
    global _registry
    if _registry is not None and registry is not None and _registry is not registry:
        raise RuntimeError("a datastore registry is already published in this process")
    _registry = registry


def published_registry():
    return _registry
