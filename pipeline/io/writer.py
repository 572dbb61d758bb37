"""Parquet output: streamed part files for utilities, whole-dataset atomic replacement for the reductions.

Every file appears under its final name only once complete (written to a temporary name, then renamed), so a reader or
a resumed run never sees half a file. `polars.scan_parquet(folder)` reads each dataset folder directly.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq


def _write_atomic(table: pa.Table, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    pq.write_table(table, tmp, compression="zstd")
    os.replace(tmp, path)


def rows_to_table(rows: list[dict] | dict[str, list], schema: pa.Schema) -> pa.Table:
    if isinstance(rows, dict):
        return pa.Table.from_pydict({n: rows[n] for n in schema.names}, schema=schema)
    return pa.Table.from_pylist(rows, schema=schema)


class PartWriter:
    """Streams rows of one dataset into numbered part files as they arrive (flushed by size or age)."""

    def __init__(self, folder: Path, schema: pa.Schema, prefix: str, flush_rows: int = 50_000, flush_s: float = 10.0):
        self.folder, self.schema, self.prefix = Path(folder), schema, prefix
        self.folder.mkdir(parents=True, exist_ok=True)
        self.flush_rows, self.flush_s = flush_rows, flush_s
        self._buf: list[pa.Table] = []
        self._rows = 0
        self._last = time.monotonic()
        self.parts = 0
        self.written = 0

    def add(self, columns: dict[str, list]) -> None:
        table = rows_to_table(columns, self.schema)
        self._buf.append(table)
        self._rows += table.num_rows
        if self._rows >= self.flush_rows or time.monotonic() - self._last >= self.flush_s:
            self.flush()

    def flush(self) -> None:
        self._last = time.monotonic()
        if not self._rows:
            return
        _write_atomic(pa.concat_tables(self._buf), self.folder / f"part-{self.prefix}-{self.parts:05d}.parquet")
        self.parts += 1
        self.written += self._rows
        self._buf, self._rows = [], 0

    def close(self) -> None:
        self.flush()
        if not any(self.folder.glob("*.parquet")):  # an empty dataset is still a readable dataset
            _write_atomic(self.schema.empty_table(), self.folder / f"part-{self.prefix}-empty.parquet")


def replace_dataset(out: Path, name: str, rows: list[dict], schema: pa.Schema) -> None:
    """Write a whole dataset folder and swap it in, so the previous version stays intact until the new one is done."""
    final = out / name
    staging = out / f".{name}.{uuid.uuid4().hex[:8]}.staging"
    staging.mkdir(parents=True)
    pq.write_table(rows_to_table(rows, schema), staging / "part-00000.parquet", compression="zstd")
    old = None
    if final.exists():
        old = out / f".{name}.{uuid.uuid4().hex[:8]}.old"
        os.replace(final, old)
    os.replace(staging, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True, default=str))
    os.replace(tmp, path)
