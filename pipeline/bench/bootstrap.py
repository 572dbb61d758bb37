"""Two-level cluster bootstrap for the micro-averaged metrics, with paired differences against a reference method.

Cases from one LoCoMo conversation share a memory pool and are not independent, so the resampling is hierarchical (as
in the MeClear paper, Appendix D.3): draw conversations with replacement, then, inside each drawn conversation, draw its
cases with replacement. A replicate is a vector of case weights (how often each case was drawn); each metric's replicate
is sum(w * num) / sum(w * den), so every metric of every group costs one matrix product. Percentile intervals.

Inside one conversation drawn c times, the c * n_c case draws are uniform over its n_c cases, so their counts are one
multinomial draw of size c * n_c: that is what makes the weights cheap to sample for all replicates at once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from pipeline.bench.metrics import (
    BenchError,
    CaseResult,
    CaseTable,
    case_table,
    paired_table,
)

DEFAULT_REPLICATES = 2000
DEFAULT_LEVEL = 0.95

Interval = dict[str, float]  # {"value", "ci_low", "ci_high"}


def _check(replicates: int, level: float) -> None:
    if replicates < 1:
        raise BenchError(f"bootstrap: replicates={replicates}; must be >= 1")
    if not 0.0 < level < 1.0:
        raise BenchError(f"bootstrap: level={level}; must be strictly between 0 and 1 (0.95 for 95% intervals)")


def resample_weights(clusters: np.ndarray, replicates: int = DEFAULT_REPLICATES, seed: int = 0) -> np.ndarray:
    """(replicates, n_cases) float64 counts: how often each case is drawn in each two-level replicate.

    `clusters` holds the cluster code of each case. Seeded by `seed` through a local generator only.
    """
    clusters = np.asarray(clusters)
    if clusters.ndim != 1 or clusters.size == 0:
        raise BenchError(f"bootstrap: clusters must be a non-empty 1-D array; got shape {clusters.shape}")
    rng = np.random.default_rng(seed)
    codes, members = np.unique(clusters, return_inverse=True)
    n_clusters = codes.size
    # Level 1: how often each conversation is drawn, per replicate.
    drawn = rng.multinomial(n_clusters, np.full(n_clusters, 1.0 / n_clusters), size=replicates)
    weights = np.zeros((replicates, clusters.size))
    for c in range(n_clusters):
        idx = np.flatnonzero(members == c)
        # Level 2: drawn[:, c] copies of the conversation, each redrawing its idx.size cases.
        weights[:, idx] = rng.multinomial(drawn[:, c] * idx.size, np.full(idx.size, 1.0 / idx.size))
    return weights


def _intervals(table: CaseTable, weights: np.ndarray, level: float) -> dict[str, Interval]:
    if weights.shape[1] != table.n_cases:
        raise BenchError(f"bootstrap: weights cover {weights.shape[1]} cases, the table has {table.n_cases}")
    value = table.values()
    with np.errstate(invalid="ignore", divide="ignore"):
        reps = (weights @ table.numerators) / (weights @ table.denominators)  # (B, n_metrics)
    alpha = (1.0 - level) / 2.0
    low, high = np.quantile(reps, [alpha, 1.0 - alpha], axis=0)
    out: dict[str, Interval] = {}
    for j, name in enumerate(table.metrics):
        v = value[name]
        # Identical replicates (degenerate data) must give a zero-width interval exactly at the value; quantile
        # interpolation could otherwise be off by rounding.
        lo, hi = (v, v) if np.all(reps[:, j] == reps[0, j]) else (float(low[j]), float(high[j]))
        out[name] = {"value": v, "ci_low": lo, "ci_high": hi}
    return out


def bootstrap_table(
    table: CaseTable, replicates: int = DEFAULT_REPLICATES, seed: int = 0, level: float = DEFAULT_LEVEL
) -> dict[str, Interval]:
    """Point value and percentile interval of every metric in `table`."""
    _check(replicates, level)
    return _intervals(table, resample_weights(table.clusters, replicates, seed), level)


def bootstrap(
    cases: Sequence[CaseResult], replicates: int = DEFAULT_REPLICATES, seed: int = 0, level: float = DEFAULT_LEVEL
) -> dict[str, Interval]:
    """Every metric of one (method, utility) group, with its two-level cluster-bootstrap interval."""
    return bootstrap_table(case_table(cases), replicates, seed, level)


def paired_difference(
    cases: Sequence[CaseResult],
    reference: Sequence[CaseResult],
    replicates: int = DEFAULT_REPLICATES,
    seed: int = 0,
    level: float = DEFAULT_LEVEL,
) -> dict[str, Interval]:
    """metric(cases) - metric(reference) on a paired cohort: differences per case first, then the same resampling."""
    return bootstrap_table(paired_table(cases, reference), replicates, seed, level)


def bootstrap_groups(
    groups: Mapping[tuple[str, str], Sequence[CaseResult]],
    reference_method: str | None = "loo",
    replicates: int = DEFAULT_REPLICATES,
    seed: int = 0,
    level: float = DEFAULT_LEVEL,
) -> dict[tuple[str, str], dict[str, dict[str, Interval]]]:
    """Intervals for every (method, utility) group, plus paired differences versus `reference_method` (same utility).

    Returns {group: {"metrics": {...}, "vs_reference": {...}}}; "vs_reference" is absent for the reference itself and
    for groups whose utility mode has no reference run. Groups covering the same cases share one set of resampling
    weights (same seed, same sorted case order), so their intervals are paired draws too.
    """
    _check(replicates, level)
    weights_cache: dict[bytes, np.ndarray] = {}

    def weights_for(table: CaseTable) -> np.ndarray:
        key = repr(table.case_ids).encode() + table.clusters.tobytes()
        if key not in weights_cache:
            weights_cache[key] = resample_weights(table.clusters, replicates, seed)
        return weights_cache[key]

    out: dict[tuple[str, str], dict[str, dict[str, Interval]]] = {}
    for (method, utility), cases in groups.items():
        table = case_table(cases)
        entry = {"metrics": _intervals(table, weights_for(table), level)}
        ref = groups.get((reference_method, utility)) if reference_method is not None else None
        if ref is not None and method != reference_method:
            diff = paired_table(cases, ref)
            entry["vs_reference"] = _intervals(diff, weights_for(diff), level)
        out[(method, utility)] = entry
    return out
