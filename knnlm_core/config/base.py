"""What every settings model shares: strict validation, the key types, datastore names."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict

KeyType = Literal["final", "ffn_input"]
DATASTORE_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # a whole name: it appears in routes, actor names and metric labels


def datastore_name_problem(name: str) -> str | None:
    """Why `name` cannot name a datastore, or None."""
    if isinstance(name, str) and DATASTORE_NAME.fullmatch(name):
        return None
    return f"datastore name {name!r} is invalid: use 1-64 letters, digits, '-' and '_' (no dots, spaces or other characters)"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
