"""FI-LoCoMo metrics, computed in one place from per-case records.

Every metric is a micro-average, a ratio of sums over cases (as in the MeClear paper, Appendix D.3): a case contributes
a numerator and a denominator, and the metric is sum(numerators) / sum(denominators). Keeping the per-case
contributions, not just the ratio, is what lets the cluster bootstrap resample cases and recompute the ratio correctly,
and lets paired differences be taken per case before resampling.

Metrics (M = the injected faults of a case, C = the memories the clearance removed, R = the method's FULL ranking of
all K memories, most harmful first, ties broken at random with the case seed: see `full_ranking`):
- recall_at_m: Recall@|M| as the MeClear paper defines it, a ranking-quality measure: |R[:|M|] ∩ M| / |M| (micro:
  summed over cases). Every memory is ranked, so a memory the method scores harmless can still count.
- recall_at_m_thresholded: the same over the thresholded harmful list only (the memories the method flags, phi < -tau);
  a list shorter than |M| counts its missing slots as misses. This was `recall_at_m` before the full-ranking version.
- rank1_coverage, rank2_coverage, rank3_coverage: the paper's rank-r coverage, the share of fault memories found at
  rank <= r of R: sum over cases of |R[:r] ∩ M| divided by sum of |M|. With |M| = 2, rank-1 coverage is at most 1/2
  per case; rank-r coverage for r >= |M| is at least recall_at_m.
- complete_set_recall: fraction of cases with M ⊆ C.
- exact_set_match: fraction of cases with C == M (as sets).
- task_recovery: fraction of cases whose answer on the cleared context is the gold one (Binary Task Recovery).
- extra_background: mean |C minus M| per case, the background (non-fault) memories cleared.
- residual_error_risk: fraction of cases where the task was NOT recovered AND the cleared context still holds at least
  one fault (M not ⊆ C): the method left harm in the active context and the answer is still wrong. Failures with every
  fault removed (over-truncation) are excluded, since no harm is left to blame. The paper reports 13.3% residual risk
  next to 82.3% recovery, so its risk counts a strict subset of the 17.7% failures, which this definition matches;
  1 - complete_set_recall would count recovered cases too, and could not sit below the failure rate in general.
- evaluations_per_case: mean number of distinct coalitions (agent calls) the method spent per case.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from pipeline.bench.faults import MECHANISMS
from pipeline.core.errors import MeClearError

METRICS = (
    "recall_at_m",
    "recall_at_m_thresholded",
    "rank1_coverage",
    "rank2_coverage",
    "rank3_coverage",
    "complete_set_recall",
    "exact_set_match",
    "task_recovery",
    "extra_background",
    "residual_error_risk",
    "evaluations_per_case",
)

MemoryId = str | int


class BenchError(MeClearError, ValueError):
    """Malformed benchmark records: names the case (or cases) and the field, and what is allowed."""

    exit_code = 2


@dataclass(frozen=True)
class CaseResult:
    """One method's outcome on one fault-injected case, the unit every metric is computed from."""

    case_id: str
    conversation: str  # the cluster: cases from one LoCoMo conversation share their memory pool
    mechanism: str  # "direct" | "redundant" | "joint"
    method: str
    utility: str  # utility mode name
    faults: tuple[MemoryId, ...]  # M, the injected harmful memories
    ranking: tuple[MemoryId, ...]  # the method's thresholded harmful ranking, most harmful first
    cleared: tuple[MemoryId, ...]  # the memories the clearance actually removed
    recovered: bool  # the agent's answer on the cleared context is the gold one
    evaluations: int  # distinct coalitions the method evaluated for this case
    full_ranking: tuple[MemoryId, ...] = ()  # every memory of the context, most harmful first; () = `ranking` only

    def __post_init__(self) -> None:
        where = f"case {self.case_id!r} ({self.method}/{self.utility})"
        if self.mechanism not in MECHANISMS:
            raise BenchError(f"{where}: mechanism={self.mechanism!r}; allowed {MECHANISMS}")
        if not self.faults:
            raise BenchError(f"{where}: faults is empty; every fault-injected case has at least one fault")
        for name in ("faults", "ranking", "cleared", "full_ranking"):
            ids = getattr(self, name)
            if len(set(ids)) != len(ids):
                raise BenchError(f"{where}: {name}={ids!r} repeats a memory id; each id may appear once")
        if self.evaluations < 0:
            raise BenchError(f"{where}: evaluations={self.evaluations}; must be >= 0")

    @property
    def ranked(self) -> tuple[MemoryId, ...]:
        """The full ranking (the thresholded list where a record carries none)."""
        return self.full_ranking or self.ranking

    @property
    def group(self) -> tuple[str, str]:
        """(method, utility): cases of one group are averaged together."""
        return (self.method, self.utility)


@dataclass(frozen=True)
class CaseTable:
    """Per-case contributions of one group of cases, sorted by case_id (so tables of a paired cohort line up).

    numerators and denominators are (n_cases, n_metrics), column j for METRICS[j]; metric j is
    numerators[:, j].sum() / denominators[:, j].sum().
    """

    case_ids: tuple[str, ...]
    clusters: np.ndarray  # (n,) int64 cluster code per case (codes of the sorted conversation ids)
    numerators: np.ndarray
    denominators: np.ndarray
    metrics: tuple[str, ...] = METRICS

    @property
    def n_cases(self) -> int:
        return len(self.case_ids)

    def values(self) -> dict[str, float]:
        """The micro-averaged metrics of this table."""
        ratio = self.numerators.sum(axis=0) / self.denominators.sum(axis=0)
        return {name: float(ratio[j]) for j, name in enumerate(self.metrics)}


def contributions(case: CaseResult) -> tuple[np.ndarray, np.ndarray]:
    """(numerator, denominator) of every metric, in METRICS order, for one case."""
    faults = set(case.faults)
    cleared = set(case.cleared)
    m = len(faults)
    complete = faults <= cleared
    full = case.ranked
    num = np.array(
        [
            len(faults.intersection(full[:m])),
            len(faults.intersection(case.ranking[:m])),
            len(faults.intersection(full[:1])),
            len(faults.intersection(full[:2])),
            len(faults.intersection(full[:3])),
            float(complete),
            float(cleared == faults),
            float(case.recovered),
            len(cleared - faults),
            float(not case.recovered and not complete),
            case.evaluations,
        ],
        dtype=np.float64,
    )
    den = np.array([m, m, m, m, m, 1, 1, 1, 1, 1, 1], dtype=np.float64)
    return num, den


def full_ranking(scores: np.ndarray, seed: int) -> np.ndarray:
    """Every position ranked by ascending score (most harmful = most negative first); ties in a random order drawn
    from `seed` (the case seed), so tied memories are neither favoured nor penalised by their context position.

    A NaN score ranks last (as +inf). The tie order is a seeded permutation used as the secondary sort key.
    """
    s = np.nan_to_num(np.asarray(scores, dtype=np.float64), nan=np.inf)
    tie = np.random.default_rng(seed).permutation(s.size)
    return np.lexsort((tie, s)).astype(np.int64)


def case_table(cases: Iterable[CaseResult]) -> CaseTable:
    """Contributions of one group's cases. Raises BenchError on an empty group, mixed groups or repeated case ids."""
    cases = sorted(cases, key=lambda c: c.case_id)
    if not cases:
        raise BenchError("no cases: a metric needs at least one case")
    groups = {c.group for c in cases}
    if len(groups) > 1:
        raise BenchError(f"cases mix method/utility groups {sorted(groups)}; split them with group_cases() first")
    ids = [c.case_id for c in cases]
    repeated = sorted(i for i, n in Counter(ids).items() if n > 1)
    if repeated:
        raise BenchError(f"group {cases[0].group}: case ids {repeated[:5]} appear more than once; each case once")
    _, clusters = np.unique([c.conversation for c in cases], return_inverse=True)
    pairs = [contributions(c) for c in cases]
    return CaseTable(
        case_ids=tuple(ids),
        clusters=clusters.astype(np.int64),
        numerators=np.stack([p[0] for p in pairs]),
        denominators=np.stack([p[1] for p in pairs]),
    )


def metrics(cases: Iterable[CaseResult]) -> dict[str, float]:
    """Every metric, micro-averaged over the cases of one (method, utility) group."""
    return case_table(cases).values()


def group_cases(cases: Iterable[CaseResult]) -> dict[tuple[str, str], list[CaseResult]]:
    """Split records by (method, utility), the unit a metric is averaged over."""
    out: dict[tuple[str, str], list[CaseResult]] = {}
    for c in cases:
        out.setdefault(c.group, []).append(c)
    return out


def paired_table(
    cases: Sequence[CaseResult], reference: Sequence[CaseResult]
) -> CaseTable:
    """Per-case differences (cases minus reference), matched by case_id, before any resampling.

    A ratio metric's difference on a paired cohort is sum(num_a - num_b) / sum(den): both methods see the same faults,
    so the denominators agree case by case (checked). Both groups must cover the same case ids.
    """
    a, b = case_table(cases), case_table(reference)
    if a.case_ids != b.case_ids:
        only_a = sorted(set(a.case_ids) - set(b.case_ids))
        only_b = sorted(set(b.case_ids) - set(a.case_ids))
        raise BenchError(
            f"paired difference needs the same cases in both groups; only in {cases[0].group}: {only_a[:5]}, "
            f"only in reference {reference[0].group}: {only_b[:5]}"
        )
    by_id = {c.case_id: c for c in reference}
    for c in cases:
        r = by_id[c.case_id]
        if c.conversation != r.conversation or set(c.faults) != set(r.faults):
            raise BenchError(
                f"case {c.case_id!r}: conversation/faults differ between {c.group} and reference {r.group} "
                f"({c.conversation!r}, {c.faults!r} vs {r.conversation!r}, {r.faults!r}); a paired cohort shares them"
            )
    return CaseTable(
        case_ids=a.case_ids,
        clusters=a.clusters,
        numerators=a.numerators - b.numerators,
        denominators=a.denominators,
    )
