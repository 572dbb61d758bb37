"""Arrow schemas of every dataset the pipeline writes, defined once. The README lists them column by column.

Every output dataset is a folder of Parquet files that `polars.scan_parquet(folder)` reads directly. Rows say how they
were made: run_id keys the run's config, agent is the agent fingerprint.
"""

from __future__ import annotations

import pyarrow as pa

CONTEXTS = pa.schema(
    [
        ("run_id", pa.string()),
        ("pool_id", pa.string()),
        ("query_id", pa.string()),
        ("context_hash", pa.string()),
        ("position", pa.int32()),  # 0-based retrieval rank; bit `position` of a coalition mask
        ("memory_id", pa.string()),
        ("text", pa.string()),  # the memory's text as the agent saw it, so a run explains itself without the inputs
        ("retrieval_score", pa.float64()),  # fused reciprocal-rank score
        ("bm25_rank", pa.int32()),  # 1-based rank under BM25 alone
        ("dense_rank", pa.int32()),  # 1-based rank under MiniLM alone; null when dense retrieval is off
    ]
)

UTILITIES = pa.schema(
    [
        ("run_id", pa.string()),
        ("pool_id", pa.string()),
        ("query_id", pa.string()),
        ("context_hash", pa.string()),
        ("coalition", pa.int64()),  # bit i set = memory at context position i kept
        ("size", pa.int32()),
        ("utility", pa.float64()),
        ("correct", pa.bool_()),
        ("utility_mode", pa.string()),
        ("agent", pa.string()),  # agent fingerprint, e.g. reader-3f2a9c1b0d4e
        ("answer", pa.string()),
        ("gold_prob", pa.float64()),  # P(gold option); null for open answers
        ("stage", pa.string()),  # "plan" (LOO + Shapley) or "clearance" (second pass)
        ("prompt_tokens", pa.int64()),
        ("cached_tokens", pa.int64()),
        ("latency_s", pa.float64()),
    ]
)

ATTRIBUTIONS = pa.schema(
    [
        ("run_id", pa.string()),
        ("pool_id", pa.string()),
        ("query_id", pa.string()),
        ("memory_id", pa.string()),
        ("position", pa.int32()),
        ("loo", pa.float64()),  # v(N) - v(N minus i); null where `auto` dropped the LOO screen (small budgets)
        ("loo_inconclusive", pa.bool_()),  # |loo| <= kappa: LOO alone cannot tell; null with loo
        ("shapley", pa.float64()),
        ("shapley_se", pa.float64()),  # 0 when exact
        ("harmful", pa.bool_()),  # shapley < -tau
        ("rank", pa.int32()),  # 1 = most harmful; null when not harmful
        ("estimator", pa.string()),  # "exact" or "permutation"
        ("permutations", pa.int32()),  # L used (0 when exact; adaptive: the permutations it stopped at)
        ("stop_reason", pa.string()),  # the estimator's stop (adaptive: "separation"/"cap", screened: "explained"/...)
    ]
)

INTERACTIONS = pa.schema(
    [
        ("run_id", pa.string()),
        ("pool_id", pa.string()),
        ("query_id", pa.string()),
        ("memory_a", pa.string()),
        ("memory_b", pa.string()),
        ("position_a", pa.int32()),
        ("position_b", pa.int32()),
        ("interaction", pa.float64()),  # pairwise Shapley interaction index; NaN when not estimable
        ("label", pa.string()),  # substitution | complementarity | joint_interference | independent | unknown
        ("support", pa.int32()),  # sets S behind the estimate (2^(K-2) when exact)
    ]
)

CLEARANCES = pa.schema(
    [
        ("run_id", pa.string()),
        ("pool_id", pa.string()),
        ("query_id", pa.string()),
        ("context_hash", pa.string()),
        ("question", pa.string()),
        ("gold", pa.string()),  # the gold answer
        ("options", pa.list_(pa.string())),  # empty for open answers
        ("answer_before", pa.string()),  # the agent's answer on the full context
        ("answer_after", pa.string()),  # ... on the selected (cleared) context; = answer_before when nothing is cleared
        ("cleared", pa.list_(pa.string())),  # memory ids suppressed for this query only, most harmful first
        ("baseline_utility", pa.float64()),
        ("cleared_utility", pa.float64()),
        ("gain", pa.float64()),
        ("baseline_correct", pa.bool_()),
        ("recovered", pa.bool_()),  # was wrong on the full context, is right after clearance; null when never wrong
        # why nothing was cleared: no harmful memory | already correct | no admissible candidate
        ("reason", pa.string()),
        ("harmful", pa.int32()),  # |H|
        ("candidates", pa.int32()),  # |H| + 1 nested candidates checked
        ("evaluations", pa.int32()),  # distinct coalitions evaluated for the case
        ("estimator", pa.string()),
        # the ranking that proposed the chosen candidate (pipeline.game.clearance): shapley | surrogate | loo |
        # single | unchanged (nothing cleared); null in parts written before the column existed
        ("source", pa.string()),
    ]
)

ERRORS = pa.schema(
    [
        ("run_id", pa.string()),
        ("pool_id", pa.string()),
        ("query_id", pa.string()),
        ("context_hash", pa.string()),
        ("stage", pa.string()),  # "plan" or "clearance"
        ("coalition", pa.int64()),  # the offending coalition; null when the whole batch failed
        ("kind", pa.string()),  # non_finite_utility | utility_out_of_range | agent_error
        ("reason", pa.string()),
    ]
)
UTILITY_KEY = ("pool_id", "query_id", "context_hash", "coalition", "agent", "utility_mode")

# Columns added within schema version 1, at the end of their dataset: a part written before one existed lacks it, and
# readers fill it with nulls (`pipeline.store.parts`), so an older run folder still resumes, reports and serves as
# `--previous`. Anything else missing or retyped is a SchemaVersionError.
ADDED_COLUMNS: dict[str, tuple[str, ...]] = {"clearances": ("source",)}

DATASETS: dict[str, pa.Schema] = {
    "contexts": CONTEXTS,
    "utilities": UTILITIES,
    "attributions": ATTRIBUTIONS,
    "interactions": INTERACTIONS,
    "clearances": CLEARANCES,
    "errors": ERRORS,  # cases that failed for a data reason; empty on a clean run
}
