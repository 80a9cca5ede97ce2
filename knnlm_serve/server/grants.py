"""What a tenant's key may do with a datastore, asked by every route that reads one.

A datastore the key was not given is refused exactly as one that does not exist (same status,
body and param: the key learns nothing of other tenants' stores); the audit log records which it
was. A given datastore used for a right the key lacks is a 403 naming the right.
"""

from __future__ import annotations

from collections.abc import Collection

from knnlm_core.errors import ErrorKind, KnnlmError
from knnlm_core.keys_file import Right, TenantKey
from knnlm_serve import metrics
from knnlm_serve.engine.request_params import KnnParamError
from knnlm_serve.server.audit import record_of

SCOPE_KEY = "knnlm.tenant"
ACTIONS = {"generate": "generate with", "explain": "explain with", "documents": "read documents of"}


def tenant_of(scope) -> TenantKey | None:
    """The request's key, where the server has tenants."""
    return scope.get(SCOPE_KEY)


def unknown_knob(requested) -> KnnParamError:
    """What the completion routes and explain answer a tenant for a `knn_datastore` it may not
    use, whether it exists or not."""
    return KnnParamError("knn_datastore", requested, "a datastore this API key may use (GET /v1/knn/datastores lists them)")


def granted(scope, key: TenantKey, requested: str | None, right: Right, served: Collection[str], unknown: Exception) -> str | None:
    """The datastore the request uses for `right`: the one it named, else its key's default
    (None: the key has none, kNN is off). `unknown` is what the route answers for a datastore
    that does not exist; a datastore the key was not given gets the same."""
    record, param = record_of(scope), getattr(unknown, "param", None)
    name = requested if requested is not None else key.default
    if name is None:
        return None
    if name not in served or name not in key.datastores:
        reason = "unknown_datastore" if name not in served else "not_granted"
        _deny(scope, key, reason, name)
        if requested is None:  # the key's default was unloaded: the server's doing, not the client's
            raise KnnlmError(f"this key's default datastore is not serving now: name one in {param}", ErrorKind.UNAVAILABLE, param)
        raise unknown
    if not key.may(name, right):
        _deny(scope, key, f"right:{right}", name)
        raise KnnlmError(
            f"this key may not {ACTIONS[right]} datastore {name!r}: it lacks the right {right!r} there; "
            "ask the server's operator to grant it in the keys file",
            ErrorKind.FORBIDDEN,
            param,
        )
    if record is not None:
        record.reading(name)
    return name


def key_listing(described: dict, key: TenantKey) -> dict:
    """The admin listing cut down to the key's serving datastores, each with the key's rights and
    without its directory."""
    mine = [
        {**{k: v for k, v in d.items() if k != "path"}, "rights": key.datastores[d["name"]]}
        for d in described["datastores"]
        if d["status"] == "serving" and d["name"] in key.datastores
    ]
    default = key.default if any(d["name"] == key.default for d in mine) else None
    return {"default": default, "datastores": mine}


def _deny(scope, key: TenantKey, reason: str, datastore: str) -> None:
    if (record := record_of(scope)) is not None:
        record.denied(reason, datastore)
    metrics.TENANT_DENIALS.labels(key_label(key.id), reason.split(":")[0]).inc()


_LABELLED: set[str] = set()
MAX_KEY_LABELS = 100


def key_label(key_id: str | None) -> str:
    """The metrics label of a key id: the id for the first 100 ids this process sees, 'other' past them."""
    if key_id is None:
        return "none"
    if key_id in _LABELLED or len(_LABELLED) < MAX_KEY_LABELS:
        _LABELLED.add(key_id)
        return key_id
    return "other"
