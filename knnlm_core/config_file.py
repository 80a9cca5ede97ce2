"""Reading the server's YAML config file into ServeConfig, and pydantic's errors as one line
that names the field (the CLIs report their flags' errors with it too)."""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import ValidationError

from knnlm_core.config import ServeConfig
from knnlm_core.errors import ConfigError


def load_serve_config(path: str | Path | None, **overrides) -> ServeConfig:
    data = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist; see configs/ for examples")
        data = yaml_mapping(path, str(path), "a mapping of settings") or {}
    data.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return ServeConfig(**data)
    except ValidationError as e:
        where = f"{path}: " if path else ""
        raise ConfigError(f"{where}invalid configuration: {validation_message(e)}") from None


def yaml_mapping(path: Path, name: str, expected: str) -> dict | None:
    """The YAML mapping in `path` (None: an empty file); a ConfigError starting with `name` that
    says where the YAML breaks, or what the top level should be."""
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise ConfigError(f"{name}: cannot be read ({e.strerror}); give a readable YAML file") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(f"{name}: not valid YAML{where}: {getattr(e, 'problem', None) or e}") from None
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"{name}: expected {expected} at the top level")
    return data


def validation_message(e: ValidationError) -> str:
    """pydantic's errors on one line: `field: problem; field: problem`."""
    return "; ".join(f"{'.'.join(map(str, err['loc'])) or 'config'}: {err['msg']}" for err in e.errors())


def flag_message(e: ValidationError, renamed: dict[str, str] | None = None) -> str:
    """pydantic's errors on one line, each named by the command-line flag that set its field
    (`--field-name`, or `renamed[field]`) with the value given: `--lambdas 2.0: problem`."""
    parts = []
    for err in e.errors():
        if not err["loc"]:  # a check across fields: its message names them
            parts.append(err["msg"].removeprefix("Value error, "))
            continue
        field = str(err["loc"][0])
        flag = (renamed or {}).get(field, "--" + field.replace("_", "-"))
        parts.append(f"{flag} {err['input']!r}: {err['msg']}")
    return "; ".join(parts)
