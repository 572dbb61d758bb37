"""mem0 exports as memory pools: each exported memory becomes a Memory, its user_id names the pool.

Accepted layouts (what mem0's `Memory.get_all()` / platform export return, saved as JSON): a JSON list of memory
objects, an object with a "results" (or "memories") list, or JSONL with one memory object per line. Fields used:
`id` (memory_id), `memory` (text), `created_at` (timestamp), `user_id` (pool), `metadata` (object or null, carried,
never shown to the agent). Other mem0 fields (hash, updated_at, agent_id, run_id, categories, ...) are ignored
silently; anything else is ignored with a warning, as in the JSONL/Parquet loader. Errors name the file, the row
(0-based, JSON) or line (1-based, JSONL), and the field.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Iterator

from pipeline.errors import InputError
from pipeline.io.records import Memory, Pool, PoolGrouper, text_field, warn_unknown

USED = {"id", "memory", "created_at", "user_id", "metadata"}
KNOWN = USED | {"hash", "updated_at", "agent_id", "run_id", "app_id", "actor_id", "role", "categories",
                "immutable", "expiration_date", "owner", "organization", "score"}


def _records(path: Path) -> Iterator[tuple[str, object]]:
    try:
        raw = path.read_text(encoding="utf-8")  # read-only: the memory bank is never opened for writing
    except FileNotFoundError:
        raise InputError(path, "", None, "does not exist") from None
    if path.suffix.lower() in (".jsonl", ".ndjson"):
        for n, line in enumerate(raw.splitlines(), start=1):
            if line.strip():
                try:
                    yield f"line {n}", json.loads(line)
                except json.JSONDecodeError as exc:
                    raise InputError(path, f"line {n}", None, f"is not valid JSON ({exc.msg})") from None
        return
    try:
        doc = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise InputError(path, f"line {exc.lineno}", None, f"is not valid JSON ({exc.msg})") from None
    if isinstance(doc, dict):
        key = next((k for k in ("results", "memories") if k in doc), None)
        if key is None:
            raise InputError(path, "", None, "must be a list of memories or an object with a 'results' list")
        doc = doc[key]
    if not isinstance(doc, list):
        raise InputError(path, "", None, f"memories must be a JSON list, got {type(doc).__name__}")
    for n, rec in enumerate(doc):
        yield f"row {n}", rec


def _parse(path: Path, where: str, rec: object) -> tuple[str, Memory]:
    if not isinstance(rec, dict):
        raise InputError(path, where, None, f"must be a JSON object, got {type(rec).__name__}")
    metadata = rec.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise InputError(path, where, "metadata", f"must be an object or null, got {type(metadata).__name__}")
    pool = text_field(path, where, rec, "user_id", numbers=True)
    mem = Memory(
        memory_id=text_field(path, where, rec, "id", numbers=True),  # type: ignore[arg-type]
        text=text_field(path, where, rec, "memory"),  # type: ignore[arg-type]
        timestamp=text_field(path, where, rec, "created_at", required=False),
        metadata=metadata,
    )
    return pool, mem  # type: ignore[return-value]


def load_mem0(paths: str | Path | Iterable[str | Path]) -> dict[str, Pool]:
    """Pools by user_id from one or more mem0 export files."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    grouped = PoolGrouper(id_field="id", owner="for user")
    for f in map(Path, paths):
        seen: set[str] = set()
        count = 0
        for where, rec in _records(f):
            pool, mem = _parse(f, where, rec)
            warn_unknown(f, rec, KNOWN, seen)  # type: ignore[arg-type]
            grouped.add(f, where, pool, mem)
            count += 1
        if count == 0:
            raise InputError(f, "", None, "holds no memories")
    return grouped.pools()
