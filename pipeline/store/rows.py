"""Typed rows of every audit dataset: one dataclass per schema of `pipeline.store.schemas`, fields in the schema's order
(a test, test_store_rows.py, keeps each in step with its schema). A row is made with keyword arguments, so a misspelt
or missing column is a TypeError where the row is made, not a null column in the Parquet; the schema's comments say
what each column holds.

Datasets written a row at a time (attributions, interactions, clearances, errors) are built as these rows; those
written a column at a time for speed (contexts, utilities: one row per memory, per coalition) pass their columns
through `columns`, which holds them to the same field names.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


class _Row:
    def as_row(self) -> dict:
        # Shallow: `dataclasses.asdict` deep-copies the lists and took 0.63 ms a case, more than the rest of streaming
        # the case out; the row goes straight to the writer, which copies it into Arrow.
        return {f.name: getattr(self, f.name) for f in fields(self)}  # type: ignore[arg-type]


@dataclass(frozen=True)
class ContextRow(_Row):
    run_id: str
    pool_id: str
    query_id: str
    context_hash: str
    position: int
    memory_id: str
    text: str
    retrieval_score: float
    bm25_rank: int
    dense_rank: int | None


@dataclass(frozen=True)
class UtilityRow(_Row):
    run_id: str
    pool_id: str
    query_id: str
    context_hash: str
    coalition: int
    size: int
    utility: float
    correct: bool
    utility_mode: str
    agent: str
    answer: str
    gold_prob: float | None
    stage: str
    prompt_tokens: int | None
    cached_tokens: int | None
    latency_s: float | None


@dataclass(frozen=True)
class AttributionRow(_Row):
    run_id: str
    pool_id: str
    query_id: str
    memory_id: str
    position: int
    loo: float | None  # null where the plan dropped the LOO screen (pipeline.game.plan.auto_measures_loo)
    loo_inconclusive: bool | None
    shapley: float
    shapley_se: float
    harmful: bool
    rank: int | None
    estimator: str
    permutations: int
    stop_reason: str | None


@dataclass(frozen=True)
class InteractionRow(_Row):
    run_id: str
    pool_id: str
    query_id: str
    memory_a: str
    memory_b: str
    position_a: int
    position_b: int
    interaction: float
    label: str
    support: int


@dataclass(frozen=True)
class ClearanceRow(_Row):
    """One query's clearance decision, typed until the writer makes it a row of `clearances/`."""

    run_id: str
    pool_id: str
    query_id: str
    context_hash: str
    question: str
    gold: str
    options: list[str]
    answer_before: str | None
    answer_after: str | None
    cleared: list[str]  # memory ids suppressed for this query only, most harmful first
    baseline_utility: float
    cleared_utility: float
    gain: float
    baseline_correct: bool
    recovered: bool | None  # null when the full context was already answered right
    reason: str | None  # why nothing was cleared; None when something was
    harmful: int
    candidates: int
    evaluations: int
    estimator: str
    source: str = "shapley"  # the ranking whose candidate was chosen; "unchanged" when nothing was cleared


@dataclass(frozen=True)
class ErrorRow(_Row):
    run_id: str
    pool_id: str
    query_id: str
    context_hash: str
    stage: str
    coalition: int | None
    kind: str
    reason: str


ROWS: dict[str, type] = {
    "contexts": ContextRow,
    "utilities": UtilityRow,
    "attributions": AttributionRow,
    "interactions": InteractionRow,
    "clearances": ClearanceRow,
    "errors": ErrorRow,
}


def columns(row_type: type, cols: dict[str, list[Any]]) -> dict[str, list[Any]]:
    """`cols` (a dataset's rows, a column at a time) if its names are exactly `row_type`'s fields; a TypeError naming
    the misspelt or missing ones otherwise."""
    names = [f.name for f in fields(row_type)]
    if set(cols) != set(names):
        raise TypeError(f"{row_type.__name__} columns: unknown {sorted(set(cols) - set(names))}, "
                        f"missing {sorted(set(names) - set(cols))}")
    return cols


def table_columns(rows: list[Any], names: list[str]) -> dict[str, list[Any]]:
    """Typed rows as columns `names` (a schema's): an attribute the rows lack is an AttributeError, not a null."""
    return {n: [getattr(r, n) for r in rows] for n in names}
