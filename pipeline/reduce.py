"""Per-case reduction: a case's value table -> attributions, interactions and the verified clearance (as rows)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np

from pipeline.cases import Case
from pipeline.game import (
    GamePlan,
    clearance_coalitions,
    harmful_ranking,
    interaction_labels,
    interactions_exact,
    interactions_from_evaluated,
    loo_effects,
    select_clearance,
    shapley_exact,
    shapley_least_squares,
    shapley_permutation,
)
from pipeline.game.adaptive import DEFAULT_Z, estimate, stop_reason
from pipeline.game.clearance import Clearance
from pipeline.game.sparse import SparseTable

# A value table: dense (exact plans, 2^K floats) or sparse (sampled plans: only the coalitions evaluated).
ValueTable = np.ndarray | SparseTable


@dataclass
class CaseState:
    """What is known about one case while its coalitions are evaluated (in the worker that runs it,
    `pipeline.evaluate.run_cases`)."""

    case: Case
    plan: GamePlan
    values: ValueTable = field(init=False)  # NaN = not evaluated
    correct: ValueTable = field(init=False)
    answers: dict[int, str] = field(default_factory=dict)  # coalition -> the agent's answer
    phi: np.ndarray | None = None
    se: np.ndarray | None = None
    ranking: np.ndarray | None = None
    used: int = 0  # adaptive: permutations in play so far (rounds planned); otherwise the plan's L
    stop: str | None = None  # adaptive: "separation" or "cap" once it stopped

    def __post_init__(self) -> None:
        k = self.case.k
        if self.plan.estimator == "exact":  # every coalition is evaluated: a dense array is the smallest table
            self.values, self.correct = np.full(1 << k, np.nan), np.zeros(1 << k, dtype=bool)
        else:  # sampled: at most L*(K-1)+2 of the 2^K coalitions (pipeline.game.sparse)
            self.values, self.correct = SparseTable(k), SparseTable(k, fill=False, dtype=bool)
        adaptive = self.plan.estimator == "adaptive"
        self.used = min(self.plan.round_size, self.plan.budget) if adaptive else len(self.plan.permutations)

    def plan_coalitions(self) -> np.ndarray:
        """The first-pass coalitions planned so far (an adaptive case's grow round by round)."""
        if self.plan.estimator == "adaptive":
            return self.plan.round_coalitions(self.used)
        return self.plan.coalitions

    def next_round(self, tau: float, z: float = DEFAULT_Z) -> np.ndarray:
        """Adaptive only, once the planned rounds are evaluated: stop (returns no coalitions; `stop` says why) or add
        rounds of permutations until one needs coalitions not yet evaluated, and return those."""
        plan = self.plan
        empty = np.zeros(0, dtype=np.int64)
        if plan.estimator != "adaptive":
            return empty
        while self.stop is None:
            phi, se, _ = estimate(self.values, plan.permutations[: self.used], plan.antithetic)
            self.stop = stop_reason(phi, se, tau, self.used, plan.budget, plan.round_size, z)
            if self.stop is None:
                self.used = min(self.used + plan.round_size, plan.budget)
                if len(need := self.missing(plan.round_coalitions(self.used))):
                    return need
        return empty

    def record(self, masks: np.ndarray, utility: np.ndarray, correct: np.ndarray, answers=None) -> None:
        self.values[masks] = utility
        self.correct[masks] = correct
        if answers is not None:
            self.answers.update(zip(np.asarray(masks).tolist(), answers))

    def missing(self, masks: np.ndarray) -> np.ndarray:
        masks = np.unique(np.asarray(masks, dtype=np.int64))
        return masks[np.isnan(self.values[masks])]

    @property
    def evaluations(self) -> int:
        stored = self.values.stored if isinstance(self.values, SparseTable) else self.values
        return int(np.count_nonzero(~np.isnan(stored)))

    @property
    def complete(self) -> bool:
        """Attributed, and every coalition its clearance needs is in: ready for `finalize`."""
        return self.ranking is not None and not len(self.missing(clearance_coalitions(self.plan.k, self.ranking)))


@dataclass(frozen=True)
class Need:
    """Coalitions a case needs evaluated next (always by the worker that ran its earlier passes: a case runs whole in
    one worker, whose prefix cache holds its prompt prefix)."""

    masks: np.ndarray
    stage: str  # "plan" or "clearance"


def advance(state: CaseState, tau: float, z: float) -> Need | None:
    """Move a case forward after new values arrived: its plan, then (adaptive) further rounds, then attribution and
    the clearance's second pass. Returns the coalitions it needs next, or None: it is then `complete`."""
    if state.phi is not None:
        return None
    if len(need := state.missing(state.plan_coalitions())):
        return Need(need, "plan")
    # Adaptive estimator: rounds of permutations. When a round is in, the case either stops (next_round returns
    # nothing) or asks for the next round's missing prefixes; everything after (attribute, clearance) is unchanged.
    if len(need := state.next_round(tau, z)):
        return Need(need, "plan")
    if len(need := attribute(state, tau)):
        return Need(need, "clearance")
    return None


def attribute(state: CaseState, tau: float) -> np.ndarray:
    """Shapley values (and SEs) from the plan's coalitions; returns the coalitions the clearance still needs."""
    plan = state.plan
    if plan.estimator == "exact":
        state.phi, state.se = shapley_exact(state.values), np.zeros(plan.k)
    elif plan.estimator == "adaptive":
        state.phi, state.se, _ = estimate(state.values, plan.permutations[: state.used], plan.antithetic)
        if state.stop == "cap":  # not separated: report the fit to every evaluated coalition (pipeline.game.adaptive)
            state.phi = shapley_least_squares(state.values, plan.round_coalitions(state.used))
    else:
        state.phi, state.se = shapley_permutation(state.values, plan.permutations, plan.antithetic)
    state.ranking = harmful_ranking(state.phi, tau, loo_effects(state.values))
    return state.missing(clearance_coalitions(plan.k, state.ranking))


def no_clearance_reason(result: Clearance, harmful: int) -> str | None:
    """Why the context was left unchanged (None when a clearance was chosen)."""
    if result.removed:
        return None
    if harmful == 0:
        return "no harmful memory"
    # harmful memories exist but no nested candidate had positive gain with the gold answer
    return "already correct" if result.baseline_correct else "no admissible candidate"


@dataclass(frozen=True)
class ClearanceRow:
    """One query's clearance decision, typed until the writer makes it a row of `clearances/` (`as_row`). Fields in
    the order of `pipeline.schemas.CLEARANCES`, whose comments say what each holds; a test keeps the two in step."""

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

    def as_row(self) -> dict:
        # Shallow: `dataclasses.asdict` deep-copies the lists and took 0.63 ms a case, more than the rest of streaming
        # the case out; the row goes straight to the writer, which copies it into Arrow.
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class CaseRows:
    attributions: list[dict]
    interactions: list[dict]
    clearance: ClearanceRow
    result: Clearance


def finalize(state: CaseState, run_id: str, tau: float, kappa: float) -> CaseRows:
    case, plan = state.case, state.plan
    q, ctx = case.query, case.context
    assert state.phi is not None and state.se is not None and state.ranking is not None
    loo = loo_effects(state.values)
    rank_of = {int(p): r + 1 for r, p in enumerate(state.ranking)}
    base = {"run_id": run_id, "pool_id": q.pool_id, "query_id": q.query_id}
    attributions = [
        {
            **base,
            "memory_id": ctx.memory_ids[i],
            "position": i,
            "loo": float(loo[i]),
            "loo_inconclusive": bool(abs(loo[i]) <= kappa),
            "shapley": float(state.phi[i]),
            "shapley_se": float(state.se[i]),
            "harmful": i in rank_of,
            "rank": rank_of.get(i),
            "estimator": plan.estimator,
            "permutations": 0 if plan.estimator == "exact" else state.used,
            "stop_reason": state.stop,
        }
        for i in range(plan.k)
    ]
    if plan.estimator == "exact" or state.evaluations == 1 << plan.k:
        inter = interactions_exact(state.values)
        support = np.full((plan.k, plan.k), 1 << max(plan.k - 2, 0))
    else:
        inter, support = interactions_from_evaluated(state.values)
    labels = interaction_labels(inter, state.phi, tau)
    interactions = [
        {
            **base,
            "memory_a": ctx.memory_ids[i],
            "memory_b": ctx.memory_ids[j],
            "position_a": i,
            "position_b": j,
            "interaction": float(inter[i, j]),
            "label": str(labels[i, j]),
            "support": int(support[i, j]),
        }
        for i in range(plan.k)
        for j in range(i + 1, plan.k)
    ]
    result = select_clearance(plan.k, state.ranking, state.values, state.correct)
    full = (1 << plan.k) - 1
    clearance = ClearanceRow(
        run_id=run_id,
        pool_id=q.pool_id,
        query_id=q.query_id,
        context_hash=ctx.context_hash,
        question=q.question,
        gold=q.answer,
        options=list(q.options),
        answer_before=state.answers.get(full),
        answer_after=state.answers.get(full & ~result.removed_mask),
        cleared=[ctx.memory_ids[i] for i in result.removed],
        baseline_utility=result.baseline_utility,
        cleared_utility=result.cleared_utility,
        gain=result.gain,
        baseline_correct=result.baseline_correct,
        recovered=None if result.baseline_correct else result.recovered,
        reason=no_clearance_reason(result, len(state.ranking)),
        harmful=len(state.ranking),
        candidates=result.candidates,
        evaluations=state.evaluations,
        estimator=plan.estimator,
    )
    return CaseRows(attributions, interactions, clearance, result)


@dataclass
class ClearanceSummary:
    """What the CLI summary prints about clearances, kept as counts while rows stream to `clearances/`: the driver
    holds at most `limit` example rows of each kind, not one row per query (22 KB a query in all, before streaming)."""

    limit: int = 64  # rows kept per kind; the CLI prints 12, and the sample pool's 36 queries fit whole
    recovered: int = 0
    unrecovered: dict[str, int] = field(default_factory=dict)  # reason -> count
    improved: int = 0  # answered right already, and the clearance raised the utility
    rows: list[ClearanceRow] = field(default_factory=list)
    _kept: dict[str, int] = field(default_factory=dict, repr=False)

    def add(self, row: ClearanceRow) -> None:
        kind = {True: "recovered", False: "unrecovered"}.get(row.recovered, "improved" if row.cleared else "other")
        if kind == "recovered":
            self.recovered += 1
        elif kind == "unrecovered":
            reason = row.reason or "cleared, still wrong"
            self.unrecovered[reason] = self.unrecovered.get(reason, 0) + 1
        elif kind == "improved":
            self.improved += 1
        if self._kept.get(kind, 0) < self.limit:
            self._kept[kind] = self._kept.get(kind, 0) + 1
            self.rows.append(row)

    @classmethod
    def of(cls, rows: list[ClearanceRow]) -> "ClearanceSummary":
        s = cls(limit=max(len(rows), 1))
        for r in rows:
            s.add(r)
        return s
