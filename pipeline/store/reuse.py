"""Utilities that earlier runs wrote, read back by key: the rows a rerun into the same folder skips, and the rows a
run given `--reuse PREVIOUS_OUT` copies into its own folder."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pipeline.store import writer
from pipeline.store.parts import good_files
from pipeline.store.schemas import UTILITIES, UTILITY_KEY

CaseKey = tuple[str, str, str]  # (pool_id, query_id, context_hash)
Previous = tuple[np.ndarray, np.ndarray, np.ndarray, list]  # coalitions, utilities, correct, answers


def _read_previous(files: list[Path], agent_fp: str, mode: str, pool_id: str | None) -> dict[CaseKey, Previous]:
    import polars as pl

    cond = (pl.col("agent") == agent_fp) & (pl.col("utility_mode") == mode) & pl.col("utility").is_finite()
    if pool_id is not None:  # pushed down into the scan: row groups of other pools are skipped by their statistics
        cond = (pl.col("pool_id") == pool_id) & cond
    df = (
        pl.scan_parquet(files, glob=False)
        .filter(cond)
        .select("pool_id", "query_id", "context_hash", "coalition", "utility", "correct", "answer")
        .unique(subset=["pool_id", "query_id", "context_hash", "coalition"], keep="first")
        .collect()
    )
    found = {}
    for key, g in df.group_by(["pool_id", "query_id", "context_hash"]):
        found[tuple(key)] = (
            g["coalition"].to_numpy(), g["utility"].to_numpy(), g["correct"].to_numpy(), g["answer"].to_list()
        )
    return found


def previous_utilities(folders: list[Path], agent_fp: str, mode: str) -> dict[CaseKey, Previous]:
    """Coalitions earlier runs already wrote for this agent and utility mode, by (pool, query, context hash). The
    key covers everything a utility depends on (the context hash fixes the memories and their order; the agent
    fingerprint the model and its settings), so a row whose key matches is reused whatever run wrote it. Reads
    every pool at once; the driver reads one pool at a time (`PoolReuse`)."""
    files = [f for folder in folders for f in good_files(folder, "utilities", UTILITIES)]
    return _read_previous(files, agent_fp, mode, None) if files else {}


class PoolReuse:
    """`previous_utilities` one pool at a time: the driver admits cases pool by pool, and only the current pool's
    earlier rows are in memory (reading a 318k-row cache whole cost 0.85 s and +140 MB, growing with the run).
    The file list is taken once, before this run writes its own parts."""

    def __init__(self, folders: list[Path], agent_fp: str, mode: str):
        self.files = [f for folder in folders for f in good_files(folder, "utilities", UTILITIES)]
        self.agent_fp, self.mode = agent_fp, mode
        self._pool: str | None = None
        self._found: dict[CaseKey, Previous] = {}
        self.reads = 0  # pools read from disk (a test checks one read per pool)

    def get(self, key: CaseKey) -> Previous | None:
        if not self.files:
            return None
        if key[0] != self._pool:
            self._pool, self._found = key[0], _read_previous(self.files, self.agent_fp, self.mode, key[0])
            self.reads += 1
        return self._found.pop(key, None)  # each case is admitted once: its rows are not needed again


class ReuseImport:
    """Copies into `out/utilities` the rows of earlier runs (`--reuse`) whose key this run needs and does not hold yet,
    so the new folder is complete on its own; one pool at a time (`pool`), as the driver reaches it, with the pool
    filter pushed into the scan, so a whole earlier night is never in memory at once. The file lists are taken at
    construction, before this run writes: rows this run evaluates are never re-read. `copied`: rows copied so far."""

    def __init__(self, folders: list[Path], out: Path, agent_fp: str, mode: str):
        self.files = [f for folder in folders for f in good_files(folder, "utilities", UTILITIES)]
        self.own = sorted((out / "utilities").glob("*.parquet"))
        self.out, self.agent_fp, self.mode = out, agent_fp, mode
        self.copied = 0

    def pool(self, pool_id: str, keys: list[CaseKey]) -> int:
        """Import the rows of pool `pool_id` for `keys` (its cases' (pool_id, query_id, context_hash)); rows copied."""
        if not self.files or not keys:
            return 0
        import polars as pl

        wanted = pl.DataFrame({"pool_id": [c[0] for c in keys], "query_id": [c[1] for c in keys],
                               "context_hash": [c[2] for c in keys]})
        df = (
            pl.scan_parquet(self.files, glob=False)
            .filter((pl.col("pool_id") == pool_id) & (pl.col("agent") == self.agent_fp)
                    & (pl.col("utility_mode") == self.mode) & pl.col("utility").is_finite())
            .join(wanted.lazy(), on=["pool_id", "query_id", "context_hash"], how="semi")
            .unique(subset=list(UTILITY_KEY), keep="first", maintain_order=True)
            .collect()
        )
        if self.own and df.height:
            have = (pl.scan_parquet(self.own, glob=False).filter(pl.col("pool_id") == pool_id)
                    .select(list(UTILITY_KEY)).collect())
            df = df.join(have, on=list(UTILITY_KEY), how="anti")
        if df.height:
            (self.out / "utilities").mkdir(parents=True, exist_ok=True)
            writer.write_part(df.to_arrow().cast(UTILITIES), self.out / "utilities")
        self.copied += df.height
        return df.height

