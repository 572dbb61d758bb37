"""Utilities that earlier runs wrote, read back by key: the rows a rerun into the same folder skips, and the rows a
run given `--reuse PREVIOUS_OUT` copies into its own folder."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pipeline.io import writer
from pipeline.schemas import UTILITIES, UTILITY_KEY


def previous_utilities(folders: list[Path], agent_fp: str,
                       mode: str) -> dict[tuple[str, str, str], tuple[np.ndarray, ...]]:
    """Coalitions earlier runs already wrote for this agent and utility mode, by (pool, query, context hash). The
    key covers everything a utility depends on (the context hash fixes the memories and their order; the agent
    fingerprint the model and its settings), so a row whose key matches is reused whatever run wrote it."""
    files = [f for folder in folders for f in sorted((folder / "utilities").glob("*.parquet"))]
    if not files:
        return {}
    import polars as pl

    df = (
        pl.scan_parquet(files)
        .filter((pl.col("agent") == agent_fp) & (pl.col("utility_mode") == mode) & pl.col("utility").is_finite())
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


def previous_run_id(out: Path) -> str | None:
    """The run whose manifest `out` holds (None: no readable manifest)."""
    import json

    try:
        return json.loads((out / "manifest.json").read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None


def import_reused(folders: list[Path], out: Path, cases: list[tuple[str, str, str]], agent_fp: str, mode: str) -> int:
    """Copy into `out/utilities` the rows of earlier runs (`--reuse`) whose key this run needs and does not hold yet,
    so the new folder is complete on its own. `cases`: the run's (pool_id, query_id, context_hash). Returns the
    number of rows copied."""
    files = [f for folder in folders for f in sorted((folder / "utilities").glob("*.parquet"))]
    if not files or not cases:
        return 0
    import polars as pl

    wanted = pl.DataFrame({"pool_id": [c[0] for c in cases], "query_id": [c[1] for c in cases],
                           "context_hash": [c[2] for c in cases]})
    df = (
        pl.scan_parquet(files)
        .filter((pl.col("agent") == agent_fp) & (pl.col("utility_mode") == mode) & pl.col("utility").is_finite())
        .join(wanted.lazy(), on=["pool_id", "query_id", "context_hash"], how="semi")
        .unique(subset=list(UTILITY_KEY), keep="first", maintain_order=True)
        .collect()
    )
    own = sorted((out / "utilities").glob("*.parquet"))
    if own and df.height:
        have = pl.scan_parquet(own).select(list(UTILITY_KEY)).collect()
        df = df.join(have, on=list(UTILITY_KEY), how="anti")
    if df.height:
        (out / "utilities").mkdir(parents=True, exist_ok=True)
        writer.write_part(df.to_arrow().cast(UTILITIES), out / "utilities")
    return df.height
