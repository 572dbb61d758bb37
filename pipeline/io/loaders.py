"""Load memory pools and query sets from JSONL or Parquet; everything is validated before any work starts."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from pipeline.core.errors import InputError
from pipeline.io.records import (
    MAX_MEMORY_CHARS,
    Pool,
    PoolGrouper,
    Query,
    iter_records,
    parse_memory,
    parse_query,
    regular_file,
    text_field,
    warn_unknown,
)

MEMORY_FIELDS = {"memory_id", "text", "timestamp", "speaker", "metadata", "pool_id"}
QUERY_FIELDS = {"query_id", "pool_id", "question", "answer", "options", "category", "evidence"}
SUFFIXES = (".jsonl", ".json", ".ndjson", ".parquet")


def input_files(path: str | Path) -> list[Path]:
    """A file, or every JSONL/Parquet file directly inside a folder (sorted, so pool order is stable)."""
    p = Path(path)
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if f.suffix.lower() in SUFFIXES)
        if not files:
            raise InputError(p, "", None, f"is a folder with no input files; expected {', '.join(SUFFIXES)}")
        return [regular_file(f) for f in files]
    return [regular_file(p)]


def load_pools(paths: str | Path | Iterable[str | Path], max_chars: int = MAX_MEMORY_CHARS) -> dict[str, Pool]:
    """Memory pools by pool_id. A file without a pool_id column is one pool named after the file's stem; two such
    files with one stem (in two folders) are an error, never one merged pool."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    files = [f for p in paths for f in input_files(p)]
    grouped = PoolGrouper()
    stem_pools: dict[str, Path] = {}
    for f in files:
        seen: set[str] = set()
        count = 0
        with_pool: str | None = None  # where the first row with / without a pool_id was
        without_pool: str | None = None
        for where, rec in iter_records(f):
            warn_unknown(f, rec, MEMORY_FIELDS, seen)
            pool_id = text_field(f, where, rec, "pool_id", required=False, numbers=True)
            if pool_id is None:
                without_pool = without_pool or where
                pool_id = f.stem
                if stem_pools.setdefault(pool_id, f) != f:
                    raise InputError(f, where, "pool_id",
                                     f"is missing, and the pool named after the file, {pool_id!r}, "
                                     f"is also {stem_pools[pool_id]}; rename a file or give pool_id")
            else:
                with_pool = with_pool or where
            if with_pool and without_pool:
                raise InputError(f, where, "pool_id", f"is given in some rows ({with_pool}) and not in others "
                                                      f"({without_pool}); give it in every row or in none")
            mem = parse_memory(f, where, rec, max_chars)
            grouped.add(f, where, pool_id, mem)
            count += 1
        if count == 0:
            raise InputError(f, "", None, "holds no memory records")
    return grouped.pools()


def load_queries(paths: str | Path | Iterable[str | Path], pools: dict[str, Pool]) -> list[Query]:
    """Queries, each checked against the loaded pools. pool_id may be omitted only when there is a single pool."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    default_pool = next(iter(pools)) if len(pools) == 1 else None
    out: list[Query] = []
    first: dict[tuple[str, str], str] = {}
    for f in [f for p in paths for f in input_files(p)]:
        seen: set[str] = set()
        for where, rec in iter_records(f):
            warn_unknown(f, rec, QUERY_FIELDS, seen)
            q = parse_query(f, where, rec, default_pool)
            if q.pool_id not in pools:
                raise InputError(f, where, "pool_id", f"{q.pool_id!r} is not a loaded pool; pools: {sorted(pools)}")
            key = (q.pool_id, q.query_id)
            if key in first:
                raise InputError(f, where, "query_id",
                                 f"{q.query_id!r} repeats in pool {q.pool_id!r} (first at {first[key]})")
            first[key] = f"{f} {where}"  # the file too: the repeat may be in another file
            out.append(q)
    if not out:
        raise InputError(", ".join(str(p) for p in paths), "", None, "holds no query records")
    return out
