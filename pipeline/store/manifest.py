"""`manifest.json`, typed: what a run folder is, which run wrote it, from which inputs, and whether it finished.

This module is the only one that reads or writes the file (`grep -rn manifest.json pipeline`). `schema_version`
versions the whole run-folder layout (manifest and Parquet parts, `pipeline.store.parts`): a folder of another version
is refused with one line naming the file and both versions, before any work. A manifest written before the field
existed has the layout of version 1 and is read as version 1.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from pipeline.core.errors import InputError, OutputError
from pipeline.store.writer import SCHEMA_VERSION, write_json_atomic

FILE = "manifest.json"
STATUSES = ("running", "complete", "complete_with_errors")


class SchemaVersionError(OutputError):
    """A manifest or part written by a meclear with another run-folder layout (exit 2)."""


@dataclass
class Manifest:
    """One audit run folder's manifest. `status` is `running` from the start of a run until it finishes, so a folder
    left by a killed run is never taken for a complete one."""

    run_id: str
    status: str
    attempt: str  # names this attempt's reduction parts: part-<attempt>-<sha256>.parquet
    datasets: list[str]
    schema_version: int = SCHEMA_VERSION
    kind: str = "audit"
    config: dict[str, Any] = field(default_factory=dict)  # AuditConfig as a mapping
    agent: str | None = None  # the agents' fingerprint
    retrieval: str | None = None
    inputs: list[dict[str, str]] = field(default_factory=list)  # {"path", "sha256"} of every input file read
    versions: dict[str, str] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    utilities: dict[str, Any] = field(default_factory=dict)  # compaction: rows, dropped, part, complete
    reuse: list[str] = field(default_factory=list)  # --reuse folders read
    replaced_run: str | None = None  # the run whose reductions this one replaced, if another

    @property
    def finished(self) -> bool:
        return self.status != "running"

    @property
    def input_paths(self) -> list[Path]:
        """Every file and folder this run read: its inputs and its --reuse folders (never to be written over)."""
        return ([Path(i["path"]) for i in self.inputs if isinstance(i, dict) and "path" in i]
                + [Path(r) for r in self.reuse])

    def write(self, folder: Path) -> None:
        write_json_atomic(Path(folder) / FILE, asdict(self))


def path(folder: str | Path) -> Path:
    return Path(folder) / FILE


def exists(folder: str | Path) -> bool:
    return path(folder).is_file()


def read(folder: str | Path) -> Manifest:
    """The manifest of run folder `folder`. One-line errors: unreadable, not meclear's, another schema version."""
    p = path(folder)
    try:
        raw = json.loads(p.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise InputError(Path(folder), "", None, f"is not an audit run folder (no {FILE}); run `meclear audit --out "
                                                 "DIR` first") from None
    except (OSError, ValueError) as exc:
        raise OutputError(f"{p}: not a meclear manifest ({type(exc).__name__}); give a meclear run folder") from None
    if not isinstance(raw, dict) or not {"run_id", "datasets"} <= set(raw):
        raise OutputError(f"{p}: was not written by meclear (no run_id/datasets); give a meclear run folder")
    version = raw.get("schema_version", 1)
    if version != SCHEMA_VERSION:
        raise SchemaVersionError(f"{p}: run-folder schema version {version!r}; this meclear reads and writes version "
                                 f"{SCHEMA_VERSION}; use the meclear that wrote it, or another folder")
    known = {f.name for f in fields(Manifest)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise OutputError(f"{p}: unknown key(s) {unknown} for schema version {SCHEMA_VERSION}")
    raw.setdefault("status", "running")
    raw.setdefault("attempt", "")
    return Manifest(**raw)


def run_id(folder: str | Path) -> str | None:
    """The run whose manifest `folder` holds (None: none, or not readable)."""
    try:
        return read(folder).run_id
    except (InputError, OutputError):
        return None


def finished(folder: str | Path) -> Manifest:
    """The manifest of a run `report` or `curate` can read: one that finished (one line otherwise)."""
    m = read(folder)
    if not m.finished:
        raise InputError(path(folder), "", None, "the run has not finished (status 'running': stopped or still "
                                                 f"running); rerun `meclear audit --out {folder}` to complete it")
    missing = [k for k in ("agent", "config") if not getattr(m, k)]
    missing += [f"config.{k}" for k in ("utility", "tau") if m.config and k not in m.config]
    if missing:
        raise InputError(path(folder), "", missing[0], "is missing from a finished run's manifest")
    return m
