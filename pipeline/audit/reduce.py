"""Per-case reduction: a case's value table -> attributions, interactions and the verified clearance (as rows)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pipeline.audit.cases import Case
from pipeline.game import (
    GamePlan,
    clearance_coalitions,
    harmful_ranking,
    interaction_labels,
    interactions_exact,
    interactions_from_evaluated,
    loo_effects,
    select_clearance,
)
from pipeline.game.adaptive import DEFAULT_Z
from pipeline.game.clearance import (
    Candidate,
    Clearance,
    affordable,
    candidate_family,
    kept_coalitions,
    select_best,
    verification_rankings,
)
from pipeline.game.estimators import (
    SURROGATES,
    Estimator,
    EstimatorRun,
    clearance_reserve,
    get_estimator,
    split_budget,
)
from pipeline.game.plan import loo_coalitions, sampled_touch_bound
from pipeline.game.sparse import SparseTable
from pipeline.store.rows import AttributionRow, ClearanceRow, InteractionRow

# A value table: dense (exact plans, 2^K floats) or sparse (sampled plans: only the coalitions evaluated).
ValueTable = np.ndarray | SparseTable


@dataclass
class CaseState:
    """What is known about one case while its coalitions are evaluated (in the worker that runs it,
    `pipeline.audit.worker.run_cases`). The Shapley estimate comes from the estimator contract
    (`pipeline.game.estimators`) in its ask/tell form: the worker batches every case's asks into one agent call."""

    case: Case
    plan: GamePlan
    tau: float = 0.0  # the harm threshold (the adaptive estimator's stopping rule needs it)
    z: float = DEFAULT_Z
    # the rankings the clearance draws candidates from (pipeline.game.clearance.clearance_rankings): ("shapley",) is
    # the paper's one nested chain; more add their prefixes and every single removal, inside the budget
    rankings: tuple[str, ...] = ("shapley",)
    # the ranking whose candidates are preferred (pipeline.game.clearance.primary_ranking; None: the whole family)
    primary: str | None = None
    values: ValueTable = field(init=False)  # NaN = not evaluated
    correct: ValueTable = field(init=False)
    answers: dict[int, str] = field(default_factory=dict)  # coalition -> the agent's answer
    phi: np.ndarray | None = None
    se: np.ndarray | None = None
    ranking: np.ndarray | None = None
    clear_ranking: np.ndarray | None = None  # the ranking's prefix the clearance checks (all of it, budget allowing)
    family: list[Candidate] | None = None  # several rankings: the candidates the clearance checks (budget allowing)
    used: int = 0  # permutations drawn (0 for exact and the regression/surrogate estimators)
    stop: str | None = None  # why the estimator stopped (pipeline.game.estimators.Attribution.stop)
    run: EstimatorRun = field(init=False, repr=False)
    anchors: bool = field(init=False, repr=False)

    def __post_init__(self) -> None:
        k = self.case.k
        if self.plan.estimator == "exact":  # every coalition is evaluated: a dense array is the smallest table
            self.values, self.correct = np.full(1 << k, np.nan), np.zeros(1 << k, dtype=bool)
        else:  # sampled: only what the estimator asks (pipeline.game.sparse)
            self.values, self.correct = SparseTable(k), SparseTable(k, fill=False, dtype=bool)
        estimator, budget = plan_estimator(self.plan, self.tau, self.z)
        self.anchors = estimator.anchors
        self.run = estimator.start(k, budget, np.random.default_rng(self.plan.seed))

    def record(self, masks: np.ndarray, utility: np.ndarray, correct: np.ndarray, answers=None) -> None:
        self.values[masks] = utility
        self.correct[masks] = correct
        if answers is not None:
            self.answers.update(zip(np.asarray(masks).tolist(), answers))

    def missing(self, masks: np.ndarray) -> np.ndarray:
        masks = np.unique(np.asarray(masks, dtype=np.int64))
        return masks[np.isnan(self.values[masks])]

    def estimator_needs(self) -> np.ndarray:
        """Tell the estimator every value it asked for that is in; return what it still needs (empty: it is done)."""
        while len(ask := self.run.ask()):
            if len(need := self.missing(ask)):
                return need
            self.run.tell(ask, self.values[ask])
        return ask

    @property
    def stored(self) -> int:
        """Coalitions with a value, reused ones included."""
        stored = self.values.stored if isinstance(self.values, SparseTable) else self.values
        return int(np.count_nonzero(~np.isnan(stored)))

    @property
    def evaluations(self) -> int:
        """Distinct coalitions this case used: what the estimator asked, LOO and the clearance's candidates so far.
        Values reused from an earlier run that this case did not need are not counted (they cost it nothing)."""
        used = self.asked()
        if self.clear_ranking is not None:
            used = np.union1d(used, self.clearance_coalitions())
        return int(np.count_nonzero(~np.isnan(self.values[used])))

    def asked(self) -> np.ndarray:
        """The coalitions this case's attribution asked for: the estimator's and LOO's (not values merely reused)."""
        if not self.plan.loo:
            return np.asarray(self.run.values.keys, dtype=np.int64)
        return np.union1d(self.run.values.keys, loo_coalitions(self.plan.k))

    def loo(self) -> np.ndarray | None:
        """LOO effects v(N) - v(N minus i); None where the plan does not measure them (`GamePlan.loo`)."""
        return loo_effects(self.values) if self.plan.loo else None

    def clearance_coalitions(self) -> np.ndarray:
        """The kept-context coalitions of the candidates the clearance checks (after `attribute`)."""
        if self.family is not None:
            return kept_coalitions(self.plan.k, self.family)
        return clearance_coalitions(self.plan.k, self.clear_ranking)

    @property
    def complete(self) -> bool:
        """Attributed, and every coalition its clearance needs is in: ready for `finalize`."""
        return self.clear_ranking is not None and not len(self.missing(self.clearance_coalitions()))


def plan_estimator(plan: GamePlan, tau: float, z: float) -> tuple[Estimator, int]:
    """The contract's estimator for a planned case, and the budget it may spend.

    With a per-query budget (`plan.eval_budget`, clearance checks included) the estimator gets
    `split_budget(budget, K)`; a surrogate, which does not ask the LOO coalitions itself, K+1 fewer (the audit
    evaluates them for its `loo` column). Without one (the paper's setting) the permutation estimators draw exactly
    `plan.budget` = L permutations, adaptive at most L, and the regression estimators as many coalitions as L
    permutations could touch, L*(K-1)+2 (never above 2^K)."""
    k, est = plan.k, plan.estimator
    opts: dict = {}
    if est == "permutation" and plan.antithetic:
        est = "antithetic"
    if est in ("permutation", "antithetic") and not plan.eval_budget:
        opts = {"permutations": plan.budget}
    elif est == "adaptive":
        opts = {"tau": tau, "z": z, "cap": plan.budget, "round_size": plan.round_size, "prior": plan.prior,
                "rule": plan.rule}
    elif est == "screened":
        opts = {"tau": tau}  # its relevance and explanation tolerance default to the harm threshold
    elif est in SURROGATES:
        opts = {"seed": plan.seed}
    if not plan.loo:  # `auto` dropped the LOO screen (pipeline.game.plan.auto_measures_loo): its anchors go too
        opts["loo"] = False
    estimator = get_estimator(est, **opts)
    if plan.eval_budget:
        budget = split_budget(plan.eval_budget, k, clearance_reserve(k, plan.eval_budget, plan.utility))
        return estimator, budget if estimator.anchors else max(budget - (k + 1), 1)
    # screened bounds itself (anchors, its screen and at most 2^(max_relevant + grow) coalitions)
    return estimator, 1 << k if est in ("exact", "permutation", "antithetic", "adaptive", "screened") else min(
        sampled_touch_bound(k, plan.budget), 1 << k)


@dataclass(frozen=True)
class Need:
    """Coalitions a case needs evaluated next (always by the worker that ran its earlier passes: a case runs whole in
    one worker, whose prefix cache holds its prompt prefix)."""

    masks: np.ndarray
    stage: str  # "plan" or "clearance"


def advance(state: CaseState, tau: float, z: float) -> Need | None:
    """Move a case forward after new values arrived: the estimator's asks (all of them at once, or round by round for
    the adaptive estimator), the LOO coalitions, then attribution and the clearance's second pass. Returns the
    coalitions it needs next, or None: it is then `complete`."""
    if state.phi is not None:
        return None
    if len(need := state.estimator_needs()):
        return Need(need, "plan")
    if state.plan.loo and len(need := state.missing(loo_coalitions(state.plan.k))):  # only a surrogate leaves any
        return Need(need, "plan")
    if len(need := attribute(state, tau)):
        return Need(need, "clearance")
    return None


def attribute(state: CaseState, tau: float) -> np.ndarray:
    """Shapley values (and SEs) from the estimator; returns the coalitions the clearance still needs.

    Under a budget the clearance checks the longest prefix of the harmful ranking whose candidates fit what is left
    (candidates are nested: N minus the top 1, 2, ... memories); the attribution rows keep the whole ranking."""
    plan = state.plan
    result = state.run.result()
    state.phi, state.se, state.used, state.stop = result.values, result.se, result.draws, result.stop
    loo = state.loo()
    state.ranking = harmful_ranking(state.phi, tau, loo)
    left = plan.eval_budget - state.evaluations  # before the clearance is set: the estimator's and LOO's spend
    state.clear_ranking = state.ranking
    if state.rankings != ("shapley",):
        # Several rankings (Theorem 2 holds for any family with the unchanged context): the surrogate is fitted to
        # the coalitions this case used (what the estimator asked, and LOO), never to values reused from other
        # runs that it did not ask, so a case's clearance does not depend on what else a --reuse folder held.
        used = state.asked()
        used = used[~np.isnan(state.values[used])]
        rankings = verification_rankings(plan.k, state.phi, tau, loo, used, state.values[used], state.rankings)
        # single removals are free only where their coalitions (the LOO anchors) were evaluated
        family = candidate_family(plan.k, rankings, singles=loo is not None)
        state.family = affordable(plan.k, family, lambda m: ~np.isnan(state.values[m]),
                                  left if plan.eval_budget else None)
        return state.missing(state.clearance_coalitions())
    if plan.eval_budget:
        for n in range(len(state.ranking), -1, -1):
            if len(state.missing(clearance_coalitions(plan.k, state.ranking[:n]))) <= left:
                state.clear_ranking = state.ranking[:n]
                break
    return state.missing(clearance_coalitions(plan.k, state.clear_ranking))


def no_clearance_reason(result: Clearance, harmful: int) -> str | None:
    """Why the context was left unchanged (None when a clearance was chosen)."""
    if result.removed:
        return None
    if harmful == 0:
        return "no harmful memory"
    # harmful memories exist but no nested candidate had positive gain with the gold answer
    return "already correct" if result.baseline_correct else "no admissible candidate"


@dataclass(frozen=True)
class CaseRows:
    attributions: list[AttributionRow]
    interactions: list[InteractionRow]
    clearance: ClearanceRow
    result: Clearance


def finalize(state: CaseState, run_id: str, tau: float, kappa: float) -> CaseRows:
    case, plan = state.case, state.plan
    q, ctx = case.query, case.context
    assert state.phi is not None and state.se is not None and state.ranking is not None
    loo = state.loo()
    rank_of = {int(p): r + 1 for r, p in enumerate(state.ranking)}
    # The paper's settings (exact; L fixed permutations) keep a null stop reason, as their rows always had.
    legacy = not plan.eval_budget and plan.estimator in ("exact", "permutation")
    stop_reason = None if legacy else state.stop
    base = {"run_id": run_id, "pool_id": q.pool_id, "query_id": q.query_id}
    attributions = [
        AttributionRow(
            **base,
            memory_id=ctx.memory_ids[i],
            position=i,
            loo=None if loo is None else float(loo[i]),
            loo_inconclusive=None if loo is None else bool(abs(loo[i]) <= kappa),
            shapley=float(state.phi[i]),
            shapley_se=float(state.se[i]),
            harmful=i in rank_of,
            rank=rank_of.get(i),
            estimator=plan.estimator,
            permutations=state.used,
            stop_reason=stop_reason,
        )
        for i in range(plan.k)
    ]
    if plan.estimator == "exact" or state.stored == 1 << plan.k:
        inter = interactions_exact(state.values)
        support = np.full((plan.k, plan.k), 1 << max(plan.k - 2, 0))
    else:
        inter, support = interactions_from_evaluated(state.values)
    labels = interaction_labels(inter, state.phi, tau)
    interactions = [
        InteractionRow(
            **base,
            memory_a=ctx.memory_ids[i],
            memory_b=ctx.memory_ids[j],
            position_a=i,
            position_b=j,
            interaction=float(inter[i, j]),
            label=str(labels[i, j]),
            support=int(support[i, j]),
        )
        for i in range(plan.k)
        for j in range(i + 1, plan.k)
    ]
    if state.family is not None:
        result = select_best(plan.k, state.family, state.values, state.correct, state.primary)
    else:
        result = select_clearance(plan.k, state.clear_ranking, state.values, state.correct)
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
        source=result.source,
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
    sources: dict[str, int] = field(default_factory=dict)  # ranking -> clearances it proposed (non-empty ones)
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
        if row.cleared:
            self.sources[row.source] = self.sources.get(row.source, 0) + 1
        if self._kept.get(kind, 0) < self.limit:
            self._kept[kind] = self._kept.get(kind, 0) + 1
            self.rows.append(row)

    @classmethod
    def of(cls, rows: list[ClearanceRow]) -> "ClearanceSummary":
        s = cls(limit=max(len(rows), 1))
        for r in rows:
            s.add(r)
        return s
