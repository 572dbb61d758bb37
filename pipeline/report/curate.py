"""Curation across queries and runs: harm aggregated per memory, ranked. It proposes; the memory bank is only read.

One row per (pool, memory) harmful in at least one query of any given run. Counts are over (run, query) pairs, so a
memory harmful in the same query on three nights counts three times in `harmful_queries` — the same evidence seen
again, which is what a curator wants to weigh.
"""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pyarrow as pa

from pipeline.core.text import safe
from pipeline.report.data import load_run, memory_texts
from pipeline.store import writer

CURATION = pa.schema(
    [
        ("rank", pa.int32()),  # 1 = most often harmful (ties: worst Shapley value first)
        ("pool_id", pa.string()),
        ("memory_id", pa.string()),
        ("text", pa.string()),  # the memory's text from the runs' contexts/
        ("harmful_queries", pa.int32()),  # (run, query) pairs where shapley < -tau
        ("retrieved_queries", pa.int32()),  # (run, query) pairs whose frozen context held it
        ("distinct_queries", pa.int32()),  # distinct query ids where it was harmful
        ("mean_shapley", pa.float64()),  # over the harmful pairs
        ("worst_shapley", pa.float64()),  # most negative Shapley value over all retrieved pairs
        ("substitution_pairs", pa.int32()),  # harmful pairs where it is a redundant copy of another harmful memory
        ("joint_interference_pairs", pa.int32()),  # harmful pairs labelled joint_interference that include it
        ("cleared", pa.int32()),  # (run, query) pairs whose verified clearance removed it
        ("cleared_recovering", pa.int32()),  # ... of those, clearances that turned a wrong answer right
        ("runs", pa.int32()),  # runs in which it was harmful at least once
        ("first_seen_run", pa.string()),  # folder name of the earliest run where it was harmful
        ("first_seen", pa.string()),  # ISO time of that run (UTC)
        ("last_seen_run", pa.string()),
        ("last_seen", pa.string()),
    ]
)


def curate(run_dirs: list[str | Path]) -> pa.Table:
    runs = sorted((load_run(p) for p in run_dirs), key=lambda r: r.when)  # stable: ties keep the order given
    att, mech, clr, texts = [], [], [], {}
    for order, r in enumerate(runs):  # runs written in the same millisecond keep the order given
        tag = [pl.lit(r.path.name).alias("run"), pl.lit(r.when).alias("when"), pl.lit(order).alias("order")]
        att.append(r.attributions.select("pool_id", "query_id", "memory_id", "position", "shapley", "harmful", *tag))
        harm = r.attributions.filter(pl.col("harmful")).select("pool_id", "query_id", "position")
        both = (  # pairs of two harmful memories, as in the report's pool summary
            r.interactions
            .join(harm.rename({"position": "position_a"}), on=["pool_id", "query_id", "position_a"], how="semi")
            .join(harm.rename({"position": "position_b"}), on=["pool_id", "query_id", "position_b"], how="semi")
        )
        subs = both.filter(pl.col("label") == "substitution")
        joint = both.filter(pl.col("label") == "joint_interference")
        for df, name in ((subs, "substitution_pairs"), (joint, "joint_interference_pairs")):
            for side in ("memory_a", "memory_b"):
                mech.append(df.select("pool_id", pl.col(side).alias("memory_id"), pl.lit(name).alias("mechanism")))
        rec = r.clearances.select(
            "pool_id", "cleared",
            ((~pl.col("baseline_correct")) & pl.col("recovered").fill_null(False)).alias("recovering"),
        ).explode("cleared").drop_nulls("cleared").rename({"cleared": "memory_id"})
        clr.append(rec)
        texts.update(memory_texts(r))
    a = pl.concat(att)
    harmful = a.filter(pl.col("harmful"))
    agg = (
        harmful.group_by("pool_id", "memory_id")
        .agg(
            pl.len().alias("harmful_queries"),
            pl.col("query_id").n_unique().alias("distinct_queries"),
            pl.col("shapley").mean().alias("mean_shapley"),
            pl.col("run").n_unique().alias("runs"),
            pl.col("run").sort_by("order").first().alias("first_seen_run"),
            pl.col("when").sort_by("order").first().alias("first_seen"),
            pl.col("run").sort_by("order").last().alias("last_seen_run"),
            pl.col("when").sort_by("order").last().alias("last_seen"),
        )
        .join(a.group_by("pool_id", "memory_id").agg(pl.len().alias("retrieved_queries"),
                                                      pl.col("shapley").min().alias("worst_shapley")),
              on=["pool_id", "memory_id"], how="left")
    )
    m = pl.concat(mech) if mech else pl.DataFrame(schema={"pool_id": pl.String, "memory_id": pl.String,
                                                          "mechanism": pl.String})
    for name in ("substitution_pairs", "joint_interference_pairs"):
        counts = m.filter(pl.col("mechanism") == name).group_by("pool_id", "memory_id").agg(pl.len().alias(name))
        agg = agg.join(counts, on=["pool_id", "memory_id"], how="left")
    c = pl.concat(clr).group_by("pool_id", "memory_id").agg(
        pl.len().alias("cleared"), pl.col("recovering").sum().alias("cleared_recovering"))
    agg = agg.join(c, on=["pool_id", "memory_id"], how="left").with_columns(
        pl.col("substitution_pairs", "joint_interference_pairs", "cleared", "cleared_recovering").fill_null(0))
    agg = agg.sort(["harmful_queries", "worst_shapley", "pool_id", "memory_id"], descending=[True, False, False, False])
    agg = agg.with_columns(
        pl.int_range(1, agg.height + 1).alias("rank"),
        pl.Series("text", [texts.get((p, mid)) for p, mid in agg.select("pool_id", "memory_id").iter_rows()],
                  dtype=pl.String),
    )
    return agg.select(CURATION.names).to_arrow().cast(CURATION)


def write_curation(table: pa.Table, out: str | Path) -> None:
    """Whole or not at all (`--out` was checked by `pipeline.store.outdir.check_file_out`)."""
    writer.write_table_atomic(table, Path(out))


def print_table(table: pa.Table, top: int = 15) -> None:
    print("  rank  pool/memory                    harmful/retrieved  mean phi  worst phi  cleared  subst  joint  text")
    for r in table.slice(0, top).to_pylist():
        name = safe(f"{r['pool_id']}/{r['memory_id']}")  # ids and text come from the memory bank: no raw escapes
        text = safe((r["text"] or "").replace("\n", " "))
        print(f"  {r['rank']:>4}  {name[:30]:<30} {r['harmful_queries']:>7}/{r['retrieved_queries']:<9} "
              f"{r['mean_shapley']:>8.3f}  {r['worst_shapley']:>9.3f}  {r['cleared']:>7}  {r['substitution_pairs']:>5}"
              f"  {r['joint_interference_pairs']:>5}  {text[:40]}")
    if table.num_rows > top:
        print(f"  ... {table.num_rows - top} more in the file")
