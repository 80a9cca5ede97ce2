"""The tenants' API keys (`knn.keys_file`): which datastores each key may use, and for what.

A key is stored only as the SHA-256 of its secret, beside a public id that logs, metrics and the
audit log name. The file is YAML:

    keys:
      - id: team-a
        sha256: <64 hex digits: `knnlm-serve new-key` prints a key and its hash>
        datastores: {docs: [generate, explain, documents]}
        default: docs                 # for requests that name no datastore; default: kNN off
        expires: 2027-06-30T00:00:00Z # optional
        requests_per_minute: 600      # optional
        tokens_per_minute: 200000     # optional

Rights: `generate` (completions and chat with kNN, passages, pointers and drafts), `explain`
(POST /v1/knn/explain: neighbours with snippets), `documents` (GET /v1/knn/documents: whole documents).
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
from collections.abc import Collection
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from knnlm_core.config_file import yaml_mapping
from knnlm_core.errors import ConfigError

Right = Literal["generate", "explain", "documents"]
KEY_ID = re.compile(r"[A-Za-z0-9_.-]{1,64}")
KEY_PREFIX = "sk-knn-"


class TenantKey(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(pattern=KEY_ID.pattern, description="public name of the key: logs, metrics and the audit log show it")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="SHA-256 of the key, as lowercase hex")
    datastores: dict[str, list[Right]] = Field(min_length=1, description="datastore -> the rights this key has on it")
    default: str | None = Field(None, description="datastore of requests that name none; default: kNN off for them")
    expires: AwareDatetime | None = Field(None, description="refused from then on (with a time zone, e.g. 2027-01-01T00:00:00Z)")
    requests_per_minute: int | None = Field(None, gt=0)
    tokens_per_minute: int | None = Field(None, gt=0, description="prompt and generated tokens of the last 60 s")

    @field_validator("datastores")
    @classmethod
    def _some_right_each(cls, grants: dict[str, list[Right]]) -> dict[str, list[Right]]:
        for name, rights in grants.items():
            if not rights:
                raise ValueError(f"{name}: grant at least one of generate, explain, documents, or leave the datastore out")
        return grants

    @model_validator(mode="after")
    def _default_granted(self) -> TenantKey:
        if self.default is not None and "generate" not in self.datastores.get(self.default, []):
            raise ValueError(f"default {self.default!r} must be one of this key's datastores with the right 'generate'")
        return self

    def may(self, datastore: str, right: Right) -> bool:
        return right in self.datastores.get(datastore, ())

    def expired(self, now: datetime | None = None) -> bool:
        return self.expires is not None and (now or datetime.now(timezone.utc)) >= self.expires


class KeysFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    keys: list[TenantKey] = Field(default_factory=list)

    @model_validator(mode="after")
    def _unique(self) -> KeysFile:
        for field in ("id", "sha256"):
            seen: set[str] = set()
            for key in self.keys:
                value = getattr(key, field)
                if value in seen:
                    shown = value if field == "id" else "another key's"
                    raise ValueError(f"two keys have the same {field} ({shown}): each key needs its own id and its own secret")
                seen.add(value)
        return self


def load_keys_file(path: str | Path, datastores: Collection[str]) -> KeysFile:
    """The keys file, checked against the datastores the server knows; a ConfigError naming the
    file and the field otherwise."""
    path = Path(path)
    data = yaml_mapping(path, f"knn.keys_file {path}", "a mapping with a `keys` list")
    if data is None:
        raise ConfigError(f"knn.keys_file {path}: the file is empty; give a mapping with a `keys` list")
    try:
        keys = KeysFile.model_validate(data)
    except ValidationError as e:
        raise ConfigError(f"knn.keys_file {path}: {_message(e)}") from None
    for i, key in enumerate(keys.keys):
        for name in key.datastores:
            if name not in datastores:
                raise ConfigError(
                    f"knn.keys_file {path}: keys.{i}.datastores: {name!r} is not a datastore of this server "
                    f"(knn.datastores or loaded through the admin API); remove the grant or load the datastore first"
                )
    return keys


def check_keys_config(keys_file: str, datastores: Collection[str], vllm_args: list[str]) -> None:
    """At startup: the keys file parses and names only configured datastores, and no vLLM API key
    is set beside it (tenant keys replace vLLM's one key for all clients)."""

    load_keys_file(keys_file, datastores)
    own = [a for a in vllm_args if a.split("=", 1)[0] == "--api-key"] or (["VLLM_API_KEY"] if os.environ.get("VLLM_API_KEY") else [])
    if own:
        raise ConfigError(f"knn.keys_file gives each client its own key, and {own[0]} sets one key for all: remove {own[0]}")


def _message(e: ValidationError) -> str:
    """pydantic's errors on one line, each named by its place in the file (`keys.0.datastores.docs.0`)."""
    return "; ".join(f"{'.'.join(map(str, err['loc'])) or 'keys'}: {err['msg'].removeprefix('Value error, ')}" for err in e.errors())


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> tuple[str, str]:
    """A fresh secret key and its SHA-256, for the keys file."""
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    return key, key_hash(key)
