"""Parquet parts verified on read: the SHA-256 in a part's name against its bytes, its schema against this meclear's.

A part is `part-<sha256[:24]>.parquet` (utilities) or `part-<attempt>-<sha256[:24]>.parquet` (reductions), named by
the digest of its bytes (`pipeline.store.writer`), so a truncated, zero-length or overwritten part is found by hashing
it. What is done with a bad part depends on whose folder it is:
- the run's own folder (`sweep`, under its lock, before any evaluation): moved to `quarantine/<dataset>/`, one warning
  line naming it; the coalitions it held are not in `utilities/` any more, so the run evaluates them again;
- a `--reuse` folder (`good_files`): an input, never written: the part is skipped with one warning line, and its
  coalitions are evaluated again;
- a run `report` or `curate` reads (`read_dataset`): one line naming it, exit 2 (a rerun of the audit sets it aside).
A part of another schema version (recorded in its metadata, or a missing or retyped column) is one line naming the
file and both versions, exit 2, before any evaluation: it is whole, so it is not quarantined.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.core.errors import InputError
from pipeline.store.manifest import SchemaVersionError
from pipeline.store.writer import SCHEMA_VERSION, VERSION_KEY, digest

log = logging.getLogger(__name__)

QUARANTINE = "quarantine"
_NAME = re.compile(r"^part-(?:[0-9a-f]+-)?([0-9a-f]{24})\.parquet$")


def damage(path: Path) -> str | None:
    """Why part `path` cannot be read as written (None: its bytes hash to its name and its footer reads)."""
    m = _NAME.match(path.name)
    if m is None:
        return "its name carries no digest (not a part meclear wrote)"
    size = path.stat().st_size
    if size == 0:
        return "zero-length"
    if digest(path)[:24] != m.group(1):
        return f"its bytes do not hash to its name ({size} bytes: truncated or overwritten)"
    try:
        pq.read_schema(path)
    except (pa.ArrowException, OSError) as exc:
        return f"not readable Parquet ({' '.join(str(exc).split())[:80]})"
    return None


def _added(schema: pa.Schema) -> tuple[str, ...]:
    """The columns of `schema` an older part of schema version 1 may lack (pipeline.store.schemas.ADDED_COLUMNS)."""
    from pipeline.store.schemas import ADDED_COLUMNS, DATASETS

    return next((ADDED_COLUMNS.get(name, ()) for name, s in DATASETS.items() if s.equals(schema)), ())


def check_schema(path: Path, schema: pa.Schema) -> None:
    """One line (SchemaVersionError) if part `path` is not of this meclear's schema for its dataset. A column added
    within this schema version (`_added`) may be absent: readers fill it with nulls."""
    got = pq.read_schema(path)
    raw = (got.metadata or {}).get(VERSION_KEY)
    version = raw.decode() if raw else "unrecorded"
    if raw and version != str(SCHEMA_VERSION):
        raise SchemaVersionError(f"{path}: schema version {version}; this meclear reads and writes version "
                                 f"{SCHEMA_VERSION}; use the meclear that wrote it, or another folder")
    # every missing column before any retyped one: a part rewritten without a column (by polars, whose strings are
    # large_string) is named by the column it lacks
    optional = _added(schema)
    missing = [f.name for f in schema if f.name not in got.names and f.name not in optional]
    if missing:
        raise SchemaVersionError(f"{path}: no column '{missing[0]}' (schema version {version}; this meclear reads "
                                 f"version {SCHEMA_VERSION})")
    for f in schema:
        if f.name in got.names and not got.field(f.name).type.equals(f.type):
            raise SchemaVersionError(f"{path}: column '{f.name}' is {got.field(f.name).type}, expected {f.type} "
                                     f"(schema version {version}; this meclear reads version {SCHEMA_VERSION})")


def sweep(out: Path, schemas: dict[str, pa.Schema]) -> list[Path]:
    """Verify every part of run folder `out` (its own, under its lock): move damaged ones to `quarantine/<dataset>/`
    with one warning each, refuse one of another schema version. Returns the quarantined paths (new locations)."""
    moved = []
    for name, schema in schemas.items():
        for p in sorted((out / name).glob("*.parquet")) if (out / name).is_dir() else []:
            why = damage(p)
            if why is None:
                check_schema(p, schema)
                continue
            dest = out / QUARANTINE / name / p.name
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.replace(p, dest)
            log.warning("%s: damaged part (%s) moved to %s; what it held is evaluated again", p, why, dest)
            moved.append(dest)
    return moved


def good_files(folder: Path, name: str, schema: pa.Schema) -> list[Path]:
    """The verified parts of dataset `name` in a folder this run only reads (`--reuse`): a damaged part is skipped
    with one warning (what it held is evaluated again); one of another schema version is refused."""
    good = []
    for p in sorted((folder / name).glob("*.parquet")) if (folder / name).is_dir() else []:
        why = damage(p)
        if why is not None:
            log.warning("%s: damaged part (%s) skipped; what it held is evaluated again", p, why)
            continue
        check_schema(p, schema)
        good.append(p)
    return good


def _footer_reads(path: Path) -> bool:
    try:
        pq.read_schema(path)
    except (pa.ArrowException, OSError):
        return False
    return True


def read_dataset(folder: Path, name: str, schema: pa.Schema):
    """Dataset `name` of a run `report` or `curate` reads, as a polars DataFrame: every part verified and checked for
    every column of `schema`; a damaged part or a missing column is one line naming the file (and the column)."""
    import polars as pl

    files = sorted((folder / name).glob("*.parquet"))
    if not files:
        raise InputError(folder / name, "", None, "holds no Parquet files; the run is incomplete")
    for p in files:
        why = damage(p)
        if why is not None:
            # A part rewritten in place (with polars, say) no longer hashes to its name; if it is readable and lacks a
            # column, that is the more useful line: name the column.
            if _footer_reads(p):
                check_schema(p, schema)
            raise InputError(p, "", None, f"damaged part ({why}); rerun `meclear audit --out {folder}` to set it "
                                          "aside and evaluate it again")
        check_schema(p, schema)
    optional = _added(schema)
    if optional and any(not set(optional) <= set(pq.read_schema(p).names) for p in files):
        # a run resumed across the column's addition: older parts get it as nulls, every part the same columns
        return pl.from_arrow(pa.concat_tables([with_columns(pq.read_table(p), schema) for p in files]))
    return pl.read_parquet(files, glob=False)  # literal paths: a '[' or '*' in --out is a name, not a pattern


def with_columns(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """`table` with every column of `schema`, in its order: a column it lacks (one added later) as nulls."""
    cols = [table.column(f.name) if f.name in table.column_names else pa.nulls(table.num_rows, f.type)
            for f in schema]
    return pa.Table.from_arrays(cols, schema=schema)
