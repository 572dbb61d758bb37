"""Helpers for validated, frozen config dataclasses: unknown keys are errors, and every config has a fingerprint."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from typing import Any, Mapping, TypeVar

from pipeline.core.errors import ConfigError
from pipeline.core.text import safe

T = TypeVar("T")


def from_mapping(cls: type[T], data: Mapping[str, Any] | None, where: str) -> T:
    """Build dataclass `cls` from `data`, rejecting keys it does not declare (a misspelt option must not vanish)."""
    data = dict(data or {})
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(names)}")
    check_finite(data, where)
    try:
        return cls(**data)
    except ConfigError as exc:  # a bad value: say where the setting came from
        raise ConfigError(f"{where}: {exc}") from None
    except TypeError as exc:  # a required key is missing
        raise ConfigError(f"{where}: {exc}") from None


def check_finite(data: Mapping[str, Any], where: str) -> None:
    """No NaN or infinity anywhere in a mapping of settings (lists and mappings inside included): YAML's `.inf` and
    `.nan` read as floats, and one such setting (an agent's beta, a temperature) turns every utility into NaN."""
    stack: list[tuple[str, Any]] = list(data.items())
    while stack:
        key, value = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{where}: {key}={value!r}; must be a finite number")
        if isinstance(value, Mapping):
            stack.extend((f"{key}.{k}", v) for k, v in value.items())
        elif isinstance(value, (list, tuple)):
            stack.extend((f"{key}[{i}]", v) for i, v in enumerate(value))


def fingerprint(obj: Any, length: int = 12) -> str:
    """A short, stable hash of a config (dataclass or plain data) that can key caches and output folders."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = dataclasses.asdict(obj)
    blob = json.dumps(obj, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:length]


def key_values(pairs: list[str], flag: str) -> dict[str, Any]:
    """`KEY=VALUE` command-line pairs as a mapping; values read as YAML scalars (numbers and booleans as such)."""
    from pipeline.core.yamlconf import load_yaml

    out = {}
    for kv in pairs:
        key, sep, value = kv.partition("=")
        if not sep or not key:
            raise ConfigError(f"{flag} {safe(kv)[:200]!r}: expected KEY=VALUE")
        if key in out:  # the same rule as a job config's keys: a setting given twice is an error, never the last
            raise ConfigError(f"{flag} {safe(key)[:200]!r}: is given twice; give each key once")
        out[key] = load_yaml(value, f"{flag} {safe(key)[:200]}")
    return out


def check(condition: bool, where: str, message: str) -> None:
    if not condition:
        raise ConfigError(f"{where}: {message}")
