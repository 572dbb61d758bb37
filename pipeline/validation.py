"""Helpers for validated, frozen config dataclasses: unknown keys are errors, and every config has a fingerprint."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any, Mapping, TypeVar

from pipeline.errors import ConfigError

T = TypeVar("T")


def from_mapping(cls: type[T], data: Mapping[str, Any] | None, where: str) -> T:
    """Build dataclass `cls` from `data`, rejecting keys it does not declare (a misspelt option must not vanish)."""
    data = dict(data or {})
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(names)}")
    try:
        return cls(**data)
    except ConfigError as exc:  # a bad value: say where the setting came from
        raise ConfigError(f"{where}: {exc}") from None
    except TypeError as exc:  # a required key is missing
        raise ConfigError(f"{where}: {exc}") from None


def fingerprint(obj: Any, length: int = 12) -> str:
    """A short, stable hash of a config (dataclass or plain data) that can key caches and output folders."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = dataclasses.asdict(obj)
    blob = json.dumps(obj, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:length]


def check(condition: bool, where: str, message: str) -> None:
    if not condition:
        raise ConfigError(f"{where}: {message}")
