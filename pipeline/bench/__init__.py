"""FI-LoCoMo benchmark library: metrics from per-case records, the two-level cluster bootstrap, attribution baselines.

Pure numpy (scikit-learn for the ContextCite and ProxySPEX baselines, imported lazily); no Ray here.
"""

from pipeline.bench.bootstrap import (
    bootstrap,
    bootstrap_groups,
    bootstrap_table,
    paired_difference,
    resample_weights,
)
from pipeline.bench.metrics import (
    MECHANISMS,
    METRICS,
    BenchError,
    CaseResult,
    CaseTable,
    case_table,
    full_ranking,
    group_cases,
    metrics,
    paired_table,
)

__all__ = [
    "MECHANISMS",
    "METRICS",
    "BenchError",
    "CaseResult",
    "CaseTable",
    "bootstrap",
    "bootstrap_groups",
    "bootstrap_table",
    "case_table",
    "full_ranking",
    "group_cases",
    "metrics",
    "paired_difference",
    "paired_table",
    "resample_weights",
]
