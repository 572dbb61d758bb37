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
KINDS = ("audit",)  # the one kind of run folder with a manifest (an eval folder has summary.json instead)


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
    # every input file read: {"path" (resolved, absolute), "device", "inode", "sha256"}; manifests written before the
    # resolved paths hold the path as given, relative to the audit's working directory (see `input_paths`)
    inputs: list[dict[str, Any]] = field(default_factory=list)
    input_folders: list[str] = field(default_factory=list)  # folders given as inputs (resolved), whose files were read
    versions: dict[str, str] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    utilities: dict[str, Any] = field(default_factory=dict)  # compaction: rows, dropped, part, complete
    reuse: list[str] = field(default_factory=list)  # --reuse folders read
    replaced_run: str | None = None  # the run whose reductions this one replaced, if another

    @property
    def finished(self) -> bool:
        return self.status != "running"

    def input_paths(self, folder: Path) -> list[Path]:
        """Every file and folder this run read: its inputs, input folders and --reuse folders (never to be written
        over), as absolute paths. A relative path (a manifest written before paths were resolved) is relative to the
        audit's working directory, which is not known: both the run folder's parent and the current directory are
        returned, so the rule errs towards refusing."""
        given = ([Path(i["path"]) for i in self.inputs if isinstance(i, dict) and isinstance(i.get("path"), str)]
                 + [Path(f) for f in self.input_folders] + [Path(r) for r in self.reuse])
        out: list[Path] = []
        for p in given:
            out += [p] if p.is_absolute() else [(Path(folder).resolve().parent / p), p.resolve()]
        return out

    @property
    def input_identities(self) -> set[tuple[int, int]]:
        """(device, inode) of every input file as recorded: the same file under another name, link or mount."""
        return {(i["device"], i["inode"]) for i in self.inputs
                if isinstance(i, dict) and isinstance(i.get("device"), int) and isinstance(i.get("inode"), int)}

    @property
    def input_hashes(self) -> set[str]:
        return {i["sha256"] for i in self.inputs if isinstance(i, dict) and isinstance(i.get("sha256"), str)}

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
    # A manifest is read by commands that decide from it (resume, report, curate, --previous): a value it cannot hold
    # is one line here, never taken for a default.
    if raw["status"] not in STATUSES:
        raise OutputError(f"{p}: status {raw['status']!r} is not one of {list(STATUSES)}; give a meclear run folder")
    if raw.get("kind", "audit") not in KINDS:
        raise OutputError(f"{p}: kind {raw.get('kind')!r}; meclear run folders are of kind {list(KINDS)}")
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
