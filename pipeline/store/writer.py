"""Parquet output: content-addressed, append-only part files for utilities and, per run attempt, for the reductions.

Every file appears under its final name only once complete (written to a temporary name, then renamed), so a reader or
a resumed run never sees half a file. Utility part files are named by the SHA-256 of their bytes: no run can overwrite
another run's rows, and a crash at any point leaves only whole parts behind. `compact` deduplicates a folder on its key
into one part, so after every finished run `utilities/` holds each key exactly once, however many crashes came before.
Reduction parts are named `part-<attempt>-<sha256>` (`run_prefix`) and streamed as cases finish; a finished run drops
every other part (`drop_other_parts`). `polars.scan_parquet(folder)` reads each dataset folder directly.
Every file is fsynced before its rename and its folder after it, so a power loss leaves the old file or the whole new
one, never a renamed empty file. Every part records the run-folder schema version in its Arrow metadata
(`pipeline.store.parts` checks it on read).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

SCHEMA_VERSION = 1  # of the whole run-folder layout: manifest and parts (`pipeline.store.manifest`)
VERSION_KEY = b"meclear.schema_version"  # in every part's Arrow schema metadata


def _tmp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")


def with_version(table: pa.Table) -> pa.Table:
    return table.replace_schema_metadata({**(table.schema.metadata or {}), VERSION_KEY: str(SCHEMA_VERSION).encode()})


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp: Path, final: Path) -> None:
    """Rename a finished temporary file to its final name durably: the file's bytes first, the folder's entry after."""
    _fsync(tmp)
    os.replace(tmp, final)
    _fsync(final.parent)


def _write_tmp(table: pa.Table, tmp: Path) -> None:
    """Write `table` to `tmp`; on any failure (a full disk) remove the half file and re-raise."""
    try:
        pq.write_table(with_version(table), tmp, compression="zstd")
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_part(table: pa.Table, folder: Path, prefix: str = "part") -> Path:
    """Write `table` as `<prefix>-<sha256 of its bytes>.parquet` in `folder` (identical content, identical name)."""
    tmp = _tmp_name(folder / prefix)
    _write_tmp(table, tmp)
    final = folder / f"{prefix}-{digest(tmp)[:24]}.parquet"
    publish(tmp, final)
    return final


def write_table_atomic(table: pa.Table, path: Path) -> None:
    """`table` as the one Parquet file `path` (e.g. `curate --out`): whole or not at all, fsynced, versioned."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_name(path)
    _write_tmp(table, tmp)
    publish(tmp, path)


def rows_to_table(rows: list[dict] | dict[str, list], schema: pa.Schema) -> pa.Table:
    if isinstance(rows, dict):
        return pa.Table.from_pydict({n: rows[n] for n in schema.names}, schema=schema)
    return pa.Table.from_pylist(rows, schema=schema)


ROW_BATCH = 1024  # dict rows per Arrow table in `PartWriter.add_rows`: ~1 MB of dicts at most


class PartWriter:
    """Streams rows of one dataset into content-addressed part files as they arrive (flushed by size or age).
    `prefix` starts every part's name (`run_prefix` gives one per run attempt, so a finished run can drop the rest)."""

    def __init__(self, folder: Path, schema: pa.Schema, flush_rows: int = 50_000, flush_s: float = 10.0,
                 prefix: str = "part"):
        self.folder, self.schema, self.prefix = Path(folder), schema, prefix
        self.folder.mkdir(parents=True, exist_ok=True)
        self.flush_rows, self.flush_s = flush_rows, flush_s
        self._buf: list[pa.Table] = []
        self._pending: list[dict] = []  # rows given as dicts, not yet a table (`add_rows`)
        self._rows = 0
        self._last = time.monotonic()
        self.parts = 0
        self.written = 0

    def add(self, columns: dict[str, list]) -> None:
        self.add_table(rows_to_table(columns, self.schema))

    def add_table(self, table: pa.Table) -> None:
        """Rows already in Arrow (built by the worker that reduced the cases), with this writer's schema."""
        if not table.schema.equals(self.schema):
            raise ValueError(f"{self.folder.name}: rows with schema {table.schema} given; expected {self.schema}")
        self._buf.append(table)
        self._rows += table.num_rows
        if self._rows >= self.flush_rows or time.monotonic() - self._last >= self.flush_s:
            self.flush()

    def flush(self) -> None:
        self._take_pending()
        self._last = time.monotonic()
        if not self._rows:
            return
        write_part(pa.concat_tables(self._buf), self.folder, self.prefix)
        self.parts += 1
        self.written += self._rows
        self._buf, self._rows = [], 0

    def close(self, empty_part: bool = False) -> None:
        """Flush; with `empty_part`, a writer that wrote nothing leaves one empty part, so the folder still reads
        back with its schema (`polars.read_parquet` of a folder without files fails)."""
        self.flush()
        if empty_part and not self.parts:
            write_part(self.schema.empty_table(), self.folder, self.prefix)
            self.parts += 1

    def add_rows(self, rows: list[dict]) -> None:
        """Rows as dicts (a finished case's reductions: 1 to 10 rows). Gathered into one Arrow table per
        `ROW_BATCH` rows, since building a table per case costs more than the case's reduction."""
        self._pending.extend(rows)
        if len(self._pending) >= min(ROW_BATCH, self.flush_rows):
            self._take_pending()
        elif time.monotonic() - self._last >= self.flush_s:  # a crash loses at most `flush_s` of finished cases
            self.flush()

    def _take_pending(self) -> None:
        if self._pending:
            rows, self._pending = self._pending, []
            self.add({n: [r.get(n) for r in rows] for n in self.schema.names})


def run_prefix(attempt: str) -> str:
    """The part-name prefix of one run attempt's reduction parts."""
    return f"part-{attempt}"


def drop_other_parts(folder: Path, prefix: str) -> int:
    """Remove every part in `folder` not named `<prefix>-*`: once a run has written all its reduction parts, the
    rows of earlier runs (or of a crashed attempt of this one) go, so the folder holds exactly this run's rows. A crash
    half way leaves a folder the next finished run cleans the same way. Returns the number of parts removed."""
    gone = 0
    for p in folder.glob("*.parquet"):
        if not p.name.startswith(prefix + "-"):
            p.unlink(missing_ok=True)
            gone += 1
    for tmp in folder.glob(".*.tmp"):  # a crashed writer's half file
        tmp.unlink(missing_ok=True)
    return gone


def compact(folder: Path, schema: pa.Schema, key: Sequence[str], by: str | None = None) -> dict:
    """Rewrite every part of `folder` as one part holding each `key` once (the first written wins), then remove the
    old parts. A crash between the two steps leaves duplicates that readers deduplicate and the next compaction
    removes, never a lost row. Returns {"rows", "dropped", "part", "seconds"}.

    The rows are deduplicated one value of `by` at a time (default: the key's first column, the pool), each group
    read with a pushed-down filter and appended as row groups of the one new part: memory is one pool's rows, not the
    folder's (reading 320k rows whole took the 10k-query benchmark's driver from 234 MB to 516 MB)."""
    t = time.perf_counter()
    folder.mkdir(parents=True, exist_ok=True)
    for tmp in folder.glob(".*.tmp"):  # a crashed writer's half file
        tmp.unlink(missing_ok=True)
    old = sorted(folder.glob("*.parquet"))
    tmp = _tmp_name(folder / "part")
    try:
        before, rows = _compact_into(tmp, old, with_version(schema.empty_table()).schema, key, by or key[0])
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    new = folder / f"part-{digest(tmp)[:24]}.parquet"
    publish(tmp, new)
    for p in old:
        if p != new:
            p.unlink(missing_ok=True)
    _fsync(folder)
    return {"rows": rows, "dropped": before - rows, "part": new.name, "seconds": round(time.perf_counter() - t, 3)}


def _compact_into(tmp: Path, old: list[Path], schema: pa.Schema, key: Sequence[str], by: str) -> tuple[int, int]:
    """Write the deduplicated rows of parts `old` to `tmp`, one `by` group at a time; (rows before, rows after)."""
    import polars as pl

    before = rows = 0
    with pq.ParquetWriter(tmp, schema, compression="zstd") as out:
        scan = pl.scan_parquet(old, glob=False) if old else None  # literal paths: '[' in --out is no pattern
        groups = scan.select(pl.col(by).unique()).collect()[by].sort().to_list() if scan is not None else []
        for g in groups:
            df = scan.filter(pl.col(by) == g).collect()
            before += df.height
            df = df.unique(subset=list(key), keep="first", maintain_order=True)
            rows += df.height
            out.write_table(df.to_arrow().cast(schema))
        if not groups:
            out.write_table(schema.empty_table())
    return before, rows


def recover_swaps(out: Path, names: Sequence[str]) -> None:
    """Undo what a crash mid-swap of an earlier version (whole-folder reductions) left: restore `name` from its `.old`
    copy when `name` is missing; drop leftovers."""
    for name in names:
        olds = sorted(out.glob(f".{name}.*.old"))
        if olds and not (out / name).exists():
            os.replace(olds.pop(), out / name)
        for p in [*olds, *out.glob(f".{name}.*.staging")]:
            shutil.rmtree(p, ignore_errors=True)


def write_json_atomic(path: Path, data: Any) -> None:
    write_bytes_atomic(path, json.dumps(data, indent=2, sort_keys=True, default=str).encode())


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """`data` at `path`, whole or not at all (a full disk leaves the old file and no temporary one)."""
    tmp = _tmp_name(path)
    try:
        tmp.write_bytes(data)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    publish(tmp, path)
