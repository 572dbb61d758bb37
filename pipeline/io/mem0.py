"""mem0 exports as memory pools: each exported memory becomes a Memory, its user_id names the pool.

Accepted layouts (what mem0's `Memory.get_all()` / platform export return, saved as JSON): a JSON list of memory
objects, an object with a "results" (or "memories") list, or JSONL with one memory object per line. Fields used:
`id` (memory_id), `memory` (text), `created_at` (timestamp), `user_id` (pool), `metadata` (object or null, carried,
never shown to the agent). Other mem0 fields (hash, updated_at, agent_id, run_id, categories, ...) are ignored
silently; anything else is ignored with a warning, as in the JSONL/Parquet loader. Errors name the file, the row
(0-based, JSON) or line (1-based, JSONL), and the field.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Iterator

from pipeline.core.errors import InputError
from pipeline.io.records import (
    MAX_MEMORY_CHARS,
    Memory,
    Pool,
    PoolGrouper,
    check_length,
    check_metadata,
    loads_json,
    regular_file,
    text_field,
    warn_unknown,
)

USED = {"id", "memory", "created_at", "user_id", "metadata"}
KNOWN = USED | {"hash", "updated_at", "agent_id", "run_id", "app_id", "actor_id", "role", "categories",
                "immutable", "expiration_date", "owner", "organization", "score"}


def _records(path: Path) -> Iterator[tuple[str, object]]:
    if path.is_dir():
        raise InputError(path, "", None, "is a folder; give a mem0 export file")
    try:
        raw = regular_file(path).read_bytes().decode("utf-8")  # read-only: the memory bank is never opened for writing
    except UnicodeDecodeError as exc:
        raise InputError(path, f"byte {exc.start}", None, "is not UTF-8 text") from None
    if path.suffix.lower() in (".jsonl", ".ndjson"):
        for n, line in enumerate(raw.splitlines(), start=1):
            if line.strip():
                yield f"line {n}", loads_json(line, path, f"line {n}")
        return
    doc = loads_json(raw, path)
    if isinstance(doc, dict):
        key = next((k for k in ("results", "memories") if k in doc), None)
        if key is None:
            raise InputError(path, "", None, "must be a list of memories or an object with a 'results' list")
        doc = doc[key]
    if not isinstance(doc, list):
        raise InputError(path, "", None, f"memories must be a JSON list, got {type(doc).__name__}")
    for n, rec in enumerate(doc):
        yield f"row {n}", rec


def _parse(path: Path, where: str, rec: object, max_chars: int = MAX_MEMORY_CHARS) -> tuple[str, Memory]:
    if not isinstance(rec, dict):
        raise InputError(path, where, None, f"must be a JSON object, got {type(rec).__name__}")
    metadata = rec.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise InputError(path, where, "metadata", f"must be an object or null, got {type(metadata).__name__}")
    check_metadata(path, where, metadata)
    pool = text_field(path, where, rec, "user_id", numbers=True)
    text = text_field(path, where, rec, "memory", limit=None)
    check_length(path, where, "memory", text, max_chars, " (--max-memory-chars)")  # type: ignore[arg-type]
    mem = Memory(
        memory_id=text_field(path, where, rec, "id", numbers=True),  # type: ignore[arg-type]
        text=text,  # type: ignore[arg-type]
        timestamp=text_field(path, where, rec, "created_at", required=False),
        metadata=metadata,
    )
    return pool, mem  # type: ignore[return-value]


def load_mem0(paths: str | Path | Iterable[str | Path], max_chars: int = MAX_MEMORY_CHARS) -> dict[str, Pool]:
    """Pools by user_id from one or more mem0 export files."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    grouped = PoolGrouper(id_field="id", owner="for user")
    for f in map(Path, paths):
        seen: set[str] = set()
        count = 0
        for where, rec in _records(f):
            pool, mem = _parse(f, where, rec, max_chars)
            warn_unknown(f, rec, KNOWN, seen)  # type: ignore[arg-type]
            grouped.add(f, where, pool, mem)
            count += 1
        if count == 0:
            raise InputError(f, "", None, "holds no memories")
    return grouped.pools()
