"""The benchmarked methods, run on one fault-injected case: attribution, harmful ranking, clearance, recovery.

Every method sees the case only through a counting oracle (`CachedOracle`) in one utility mode, so its reported
`evaluations` are the distinct coalitions it asked for, clearance checks included. The agent itself answers each
coalition once per case (`CaseOutcomes`); both utility modes and all methods read from that table.

- meclear_l{L}: the contract's permutation estimator with L permutations fixed (pipeline.game.estimators), plus the
  LOO coalitions it always holds; meclear_exact: the contract's exact enumeration, all 2^K coalitions. Shapley
  values, harmful ranking (phi < -tau, ties by LOO), nested verified clearance. Pairwise interactions are diagnostics in
  MeClear and do not enter the ranking or the clearance, so the benchmark does not compute them.
- loo: rank by LOO effect, same nested clearance; loo_threshold: remove every memory with loo < -tau at once.
- contextcite, proxyspex: the contract's surrogates (`pipeline.game.surrogates`), same ranking rule (without LOO
  tie-break: it would cost evaluations they do not make) and the same nested clearance.
- filter: the agent's own `drop_memories` (LLM agents) or, for agents without one, the relevance-threshold filter on
  lexical relevance (the fraction of the question's content words a memory contains); no nested search. The LLM
  filter's own generation call counts as one agent evaluation.
- Controls, through the same nested clearance over ALL K memories (no attribution; any method must beat them to earn
  its agent calls): position (retrieval order, most relevant first), random (a seeded permutation per case), oracle
  (the true fault set first, then retrieval order: the ceiling of a ranking-then-clearance method).

Every outcome also carries the method's FULL ranking of the K memories (its scores, ascending, ties broken at random
with the case seed: `pipeline.bench.metrics.full_ranking`), which full-ranking Recall@|M| and rank-r coverage read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import numpy as np

from pipeline.agents.base import Agent
from pipeline.audit.settings import (
    DEFAULT_KAPPA,
    DEFAULT_TAU,
    check_number,
    check_setting,
)
from pipeline.bench.baselines import CachedOracle, loo, relevance_filter
from pipeline.bench.builder import BenchCase
from pipeline.bench.metrics import full_ranking
from pipeline.bench.outcomes import CaseOutcomes
from pipeline.core.errors import ConfigError
from pipeline.core.text import tokens
from pipeline.game import harmful_ranking, select_clearance
from pipeline.game.clearance import clearance_coalitions
from pipeline.game.plan import full_mask, loo_coalitions
from pipeline.game.sparse import SparseTable

FAMILIES = ("meclear", "loo", "contextcite", "proxyspex", "filter")
CONTROLS = ("position", "random", "oracle")
DEFAULT_BUDGETS = (4, 8, 16)
METHOD_FAMILIES = (*FAMILIES, "loo_threshold", *CONTROLS)  # what a Method's family may be
BASELINE_ESTIMATORS = ("contextcite", "proxyspex")  # surrogates behind the estimator contract, benchmarked as baselines
# Exact enumeration costs 2^K agent calls per case: 4,096 at K=12 is the most the benchmark affords (the line);
# above it exact never runs, and "same harmful set as exact" is not reported.
EXACT_MAX_K = 12
_ALLOWED = (f"allowed {FAMILIES}, loo_threshold, meclear_exact, meclear_l<L>, <estimator>_b<B> (estimators of "
            f"pipeline.game.estimators, contextcite_b<B>, proxyspex_b<B>), controls, {', '.join(CONTROLS)}")
_BUDGETED = re.compile(r"^([a-z][a-z0-9_]*?)_b([0-9]+)$")


def meclear_estimators() -> tuple[str, ...]:
    """The audit's MeClear estimators (the contract's registry, less exact enumeration and the surrogate baselines),
    each of which the budgeted benchmark runs at every budget."""
    from pipeline.game.estimators import ESTIMATOR_NAMES

    return tuple(n for n in ESTIMATOR_NAMES if n != "exact" and n not in BASELINE_ESTIMATORS)


DEFAULT_METHODS = ("meclear", "loo", "contextcite", "proxyspex", "filter", "controls")  # CLI words, see expand_methods


@dataclass(frozen=True)
class MethodConfig:
    tau: float = DEFAULT_TAU
    kappa: float = DEFAULT_KAPPA  # LOO screen tolerance; recorded, it does not change a ranking or a clearance
    contextcite_masks: int = 64
    proxyspex_masks: int = 64
    filter_threshold: float = 0.5  # relevance filter: drop memories with fewer than this share of question words

    def __post_init__(self) -> None:
        check_setting("tau", self.tau, "method config")  # the audit's rules (pipeline.audit.settings.SETTING_RULES)
        check_setting("kappa", self.kappa, "method config")
        check_number(self.filter_threshold, "method config", "filter_threshold")
        for name in ("contextcite_masks", "proxyspex_masks"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ConfigError(f"method config: {name}={v!r}; must be an integer >= 1")


def _positive_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


@dataclass(frozen=True)
class Method:
    """One benchmarked method: its family and, for MeClear, the permutation budget L (None: exact enumeration).

    A budgeted method (`evals` set) is a contract estimator (`estimator`: a MeClear estimator name, or the family for
    contextcite/proxyspex) run at a budget of `evals` distinct agent evaluations per case, clearance checks included.
    """

    family: str  # meclear, loo, loo_threshold, contextcite, proxyspex, filter, or a control
    budget: int | None = None
    estimator: str | None = None  # budgeted MeClear: the contract estimator's name
    evals: int | None = None  # budgeted methods: evaluations per case

    def __post_init__(self) -> None:
        if self.evals is not None:
            ok = (_positive_int(self.evals) and self.budget is None
                  and ((self.family == "meclear" and bool(self.estimator))
                       or (self.family in BASELINE_ESTIMATORS and self.estimator is None)))
        else:
            ok = self.estimator is None and (self.budget is None or (self.family == "meclear"
                                                                     and _positive_int(self.budget)))
        if self.family not in METHOD_FAMILIES or not ok:
            raise ConfigError(f"methods: family {self.family!r} with budget {self.budget!r}, estimator "
                              f"{self.estimator!r}, evaluations {self.evals!r} is not a method; {_ALLOWED}")

    @property
    def name(self) -> str:
        """The method's name in cases.parquet and the summary: meclear_l<L>, meclear_exact, <estimator>_b<B>,
        contextcite_b<B>, proxyspex_b<B>, or the family."""
        if self.evals is not None:
            return f"{self.estimator or self.family}_b{self.evals}"
        if self.family != "meclear":
            return self.family
        return "meclear_exact" if self.budget is None else f"meclear_l{self.budget}"

    @property
    def curve(self) -> str:
        """The curve a method belongs to in the budget curves: the name less its budget (`adaptive`, `contextcite`)."""
        return self.name if self.evals is None else (self.estimator or self.family)

    @classmethod
    def parse(cls, name: str) -> "Method":
        """The method a single name stands for (meclear_l8, meclear_exact, adaptive_b64, contextcite_b64, ...)."""
        if name == "meclear_exact":
            return cls("meclear")
        digits = name.removeprefix("meclear_l") if name.startswith("meclear_l") else ""
        if digits.isdigit() and int(digits) >= 1:
            return cls("meclear", int(digits))
        if name != "meclear" and name in METHOD_FAMILIES:
            return cls(name)
        hit = _BUDGETED.match(name)
        if hit and int(hit.group(2)) >= 1:
            est, b = hit.group(1), int(hit.group(2))
            if est in BASELINE_ESTIMATORS:
                return cls(est, evals=b)
            if est in meclear_estimators() or est == "auto":
                return cls("meclear", estimator=est, evals=b)
        raise ConfigError(f"methods: {name!r} is not a method; {_ALLOWED}")


def expand_methods(names: list[str] | tuple[str, ...], budgets: tuple[int, ...] = DEFAULT_BUDGETS,
                   eval_budgets: tuple[int, ...] = (), top_k: int = 0) -> tuple[str, ...]:
    """Method names from CLI words: 'meclear' -> meclear_l<L> for each budget + meclear_exact, 'loo' -> loo +
    loo_threshold, 'controls' -> position + random + oracle; single names (meclear_l8, meclear_exact, loo_threshold,
    position, ...) pass through. Order kept, no repeats.

    With `eval_budgets` (the budgeted benchmark, `--budgets`): 'meclear' -> every contract MeClear estimator at every
    budget (<estimator>_b<B>) + meclear_exact, 'contextcite' -> contextcite_b<B>, 'proxyspex' -> proxyspex_b<B>.
    meclear_exact is left out of 'meclear' above EXACT_MAX_K, and asking for it by name there is an error.
    """
    out: list[Method] = []
    exact_ok = not top_k or top_k <= EXACT_MAX_K
    for n in names:
        if n == "meclear" and eval_budgets:
            out += [Method("meclear", estimator=e, evals=b) for e in meclear_estimators() for b in eval_budgets]
            out += [Method("meclear")] if exact_ok else []
        elif n == "meclear":
            out += [Method("meclear", b) for b in budgets] + ([Method("meclear")] if exact_ok else [])
        elif n in BASELINE_ESTIMATORS and eval_budgets:
            out += [Method(n, evals=b) for b in eval_budgets]
        elif n == "loo":
            out += [Method("loo"), Method("loo_threshold")]
        elif n == "controls":
            out += [Method(c) for c in CONTROLS]
        else:
            out.append(Method.parse(n))
    if not exact_ok and Method("meclear") in out:
        raise ConfigError(f"methods: meclear_exact at K={top_k} would evaluate 2^{top_k} coalitions per case; exact "
                          f"enumeration runs only for K <= {EXACT_MAX_K}")
    return tuple(dict.fromkeys(m.name for m in out))


@dataclass(frozen=True)
class Outcome:
    """One method's result on one case in one utility mode (positions in the frozen context)."""

    ranking: tuple[int, ...]  # thresholded harmful list (controls: the full ranking)
    cleared: tuple[int, ...]
    recovered: bool
    evaluations: int
    baseline_utility: float | None
    cleared_utility: float | None
    estimator: str
    full_ranking: tuple[int, ...] = ()  # all K positions, most harmful first (seeded ties)
    permutations: int | None = None  # MeClear's permutation budget L (None: exact enumeration, or not MeClear)


def affordable(k: int, ranking: np.ndarray, ev: CachedOracle, budget: int | None) -> np.ndarray:
    """The longest prefix of `ranking` whose nested clearance candidates fit in what is left of `budget` (distinct
    evaluations; coalitions the method already evaluated are free). None: the whole ranking."""
    ranking = np.asarray(ranking, dtype=np.int64)
    if budget is None:
        return ranking
    kept = clearance_coalitions(k, ranking)
    new = np.cumsum(~ev.seen(kept))  # new[j]: evaluations the first j+1 candidates add
    fits = np.flatnonzero(ev.evaluations + new <= budget)
    return ranking[: int(fits[-1])] if fits.size else ranking[:0]


def _clear(k: int, ranking: np.ndarray, ev: CachedOracle,
           budget: int | None = None) -> tuple[tuple[int, ...], bool, float, float]:
    """Nested verified clearance over `ranking` (cut to what `budget` affords), evaluating its candidates through `ev`.
    Values are held sparsely: never a 2^K table."""
    ranking = affordable(k, ranking, ev, budget)
    kept = clearance_coalitions(k, ranking)
    util, ok = ev(kept)
    values, correct = SparseTable(k), SparseTable(k, fill=False, dtype=bool)
    values[kept], correct[kept] = util, ok
    c = select_clearance(k, ranking, values, correct)
    return c.removed, c.recovered, c.baseline_utility, c.cleared_utility


def _full(scores: np.ndarray, seed: int) -> tuple[int, ...]:
    return tuple(int(i) for i in full_ranking(scores, seed))


def _ranked(k: int, attribution: np.ndarray, ev: CachedOracle, tau: float, name: str, seed: int,
            loo_tie: np.ndarray | None = None, budget: int | None = None) -> Outcome:
    ranking = harmful_ranking(attribution, tau, loo_tie)
    removed, recovered, base, cleared = _clear(k, ranking, ev, budget)
    return Outcome(tuple(int(i) for i in ranking), removed, recovered, ev.evaluations, base, cleared, name,
                   _full(attribution, seed))


def control(name: str, k: int, ev: CachedOracle, seed: int, faults: tuple[int, ...]) -> Outcome:
    """A control ranking of all K memories, then the same nested verified clearance (K+1 candidates)."""
    if name == "position":
        scores = np.arange(k, dtype=np.float64)  # most relevant (position 0) first
    elif name == "random":
        scores = np.random.default_rng([seed, 1]).permutation(k).astype(np.float64)
    else:  # oracle: faults first (ties among them by the case seed), then retrieval order
        scores = np.arange(k, dtype=np.float64)
        scores[list(faults)] = -1.0
    ranking = np.array(_full(scores, seed), dtype=np.int64)
    removed, recovered, base, cleared = _clear(k, ranking, ev)
    r = tuple(int(i) for i in ranking)
    return Outcome(r, removed, recovered, ev.evaluations, base, cleared, name, r)


def meclear(k: int, ev: CachedOracle, budget: int | None, seed: int, tau: float) -> Outcome:
    """MeClear with L=budget permutations (the contract's `permutation` estimator with L fixed, the paper's setting),
    or exact enumeration (budget None); ranking ties broken by LOO, whose coalitions both always evaluate."""
    from pipeline.game.estimators import get_estimator

    if budget is None:
        est, cap = get_estimator("exact"), 1 << k
    else:  # L permutations touch at most L*(K-1)+2 prefixes, plus the K LOO coalitions
        est, cap = get_estimator("permutation", permutations=budget), min(1 << k, budget * (k - 1) + 2 + k)
    attr = est.estimate(OracleGame(k, ev), cap, np.random.default_rng(seed))
    util, _ = ev(loo_coalitions(k))  # already evaluated: no new agent call
    out = _ranked(k, attr.values, ev, tau, "exact" if budget is None else "permutation", seed, util[0] - util[1:])
    return replace(out, permutations=budget)


class OracleGame:
    """The estimator contract's `Game` over a method's counting oracle: utilities only, each coalition evaluated once
    (the oracle caches), so an estimator's spend is the oracle's distinct coalitions."""

    def __init__(self, k: int, ev: CachedOracle):
        self.n_players, self.ev = k, ev

    def __call__(self, masks: np.ndarray) -> np.ndarray:
        return self.ev(np.asarray(masks, dtype=np.int64))[0]


def budgeted(method: Method, k: int, ev: CachedOracle, seed: int, tau: float) -> Outcome:
    """A contract estimator at `method.evals` evaluations per case: the estimator gets `split_budget(B, K)` of them
    (the audit's split), the nested clearance what is left (its ranking cut to fit, `affordable`), so the total
    never exceeds B. Ranked by the estimate alone (no LOO tie-break: LOO would cost evaluations the budget lacks)."""
    from pipeline.game.estimators import split_budget

    name = method.estimator or method.family
    values = _estimate(name, k, ev, split_budget(method.evals, k), seed, tau)
    return _ranked(k, values, ev, tau, name, seed, budget=method.evals)


# What `shipped(clearance=...)` may replay instead of the audit's rule (jobs/bench_split.py measures them side by side):
# the Shapley chain alone, or the whole family with no preferred ranking.
CLEARANCE_VARIANTS = ("audit", "chain", "family")


def shipped(method: Method, k: int, ev: CachedOracle, seed: int, tau: float, utility: str,
            reserve: int | None = None, clearance: str = "audit", loo: bool | None = None) -> Outcome:
    """What `meclear audit --budget B` ships (`auto_b<B>`): the `auto` estimator for this K, budget and utility mode
    on the attribution part of B, then the verified clearance on what is left: in `correct` mode over several
    rankings (Shapley, the free sparse surrogate, LOO, single removals: `pipeline.game.clearance.candidate_family`);
    in `probability` mode the Shapley chain is preferred and the others are a fallback (`primary_ranking`). Its
    rankings are those of the ranking whose candidate was chosen (Shapley's when none was). `reserve`: evaluations
    kept back from the estimator for the clearance (None: the audit's, `clearance_reserve`); `clearance`: one of
    CLEARANCE_VARIANTS (the audit's rule, the Shapley chain alone, the whole family without a preferred ranking);
    `loo`: whether the LOO anchors are evaluated (None: the audit's rule, `auto_measures_loo`).
    jobs/bench_split.py measures all three."""
    from pipeline.game.clearance import affordable as fits
    from pipeline.game.clearance import (
        candidate_family,
        clearance_rankings,
        kept_coalitions,
        primary_ranking,
        select_best,
        verification_rankings,
    )
    from pipeline.game.estimators import clearance_reserve, split_budget
    from pipeline.game.linear import surrogate_scores
    from pipeline.game.plan import AUTO_SURROGATE, auto_estimator, auto_measures_loo

    budget = int(method.evals)
    name = auto_estimator(k, budget, utility)
    if reserve is None:
        reserve = clearance_reserve(k, budget, utility)
    # only the sparse surrogate can go without its LOO anchors; the other estimators' designs need them
    measures_loo = auto_measures_loo(k, budget, utility) if loo is None else loo or name != AUTO_SURROGATE
    phi = _estimate(name, k, ev, split_budget(budget, k, reserve), seed, tau, measures_loo)
    anchors = loo_coalitions(k)
    loo_scores = None
    if measures_loo and ev.seen(anchors).all():
        util, _ = ev(anchors)
        loo_scores = util[0] - util[1:]
    masks, vals = ev.evaluated()
    if clearance not in CLEARANCE_VARIANTS:
        raise ValueError(f"clearance {clearance!r} is unknown; allowed {CLEARANCE_VARIANTS}")
    sources = ("shapley",) if clearance == "chain" else clearance_rankings(utility, budgeted=True)
    preferred = primary_ranking(utility) if clearance == "audit" else None
    rankings = verification_rankings(k, phi, tau, loo_scores, masks, vals, sources)
    family = fits(k, candidate_family(k, rankings, singles=len(sources) > 1 and loo_scores is not None), ev.seen,
                  budget - ev.evaluations)
    kept = kept_coalitions(k, family)
    util, ok = ev(kept)
    values, correct = SparseTable(k), SparseTable(k, fill=False, dtype=bool)
    values[kept], correct[kept] = util, ok
    c = select_best(k, family, values, correct, preferred)
    scores = surrogate_scores(masks, vals, k) if c.source == "surrogate" else (
        loo_scores if c.source == "loo" else phi)
    primary = dict(rankings)["shapley"]
    ranked = dict(rankings).get(c.source, primary)
    return Outcome(tuple(int(i) for i in ranked), c.removed, c.recovered, ev.evaluations, c.baseline_utility,
                   c.cleared_utility, f"auto:{name}:{c.source}", _full(scores, seed))


def _estimate(name: str, k: int, ev: CachedOracle, budget: int, seed: int, tau: float, loo: bool = True
              ) -> np.ndarray:
    """The contract estimator `name`'s values over `ev` within `budget`, seeded by the case: the audit's options
    (adaptive stops on separation from -tau; a surrogate's trees take the case seed, its masks come from the rng;
    `loo` False: no LOO anchors, as `auto` plans where `pipeline.game.plan.auto_measures_loo` says so)."""
    from pipeline.game.estimators import get_estimator

    tau_first = ("adaptive", "screened")
    options = {"tau": tau} if name in tau_first else {"seed": seed} if name in BASELINE_ESTIMATORS else {}
    if not loo:
        options["loo"] = False
    attr = get_estimator(name, **options).estimate(OracleGame(k, ev), budget, np.random.default_rng(seed))
    return np.asarray(attr.values, dtype=np.float64)


def _lexical_relevance(question: str, texts: tuple[str, ...]) -> np.ndarray:
    q = set(tokens(question))
    return np.array([len(q & set(tokens(t))) / max(len(q), 1) for t in texts])


def run_method(method: Method, bc: BenchCase, agent: Agent, oracle: CaseOutcomes, utility: str, cfg: MethodConfig,
               drop: list[int] | None = None) -> Outcome:
    """One method on one case in one utility mode. `drop`: the LLM filter's answer (mode-independent, asked once)."""
    case, k, family = bc.case, bc.case.k, method.family
    ev = CachedOracle(k, oracle.mode(utility))
    if method.evals is not None and method.estimator == "auto":
        return shipped(method, k, ev, case.seed, cfg.tau, utility)
    if method.evals is not None:
        return budgeted(method, k, ev, case.seed, cfg.tau)
    if family == "meclear":
        return meclear(k, ev, method.budget, case.seed, cfg.tau)
    if family in CONTROLS:
        return control(family, k, ev, case.seed, bc.fault_positions)
    if family in ("loo", "loo_threshold"):
        a = loo(k, ev).attribution
        if family == "loo":
            return _ranked(k, a, ev, cfg.tau, "loo", case.seed, a)
        ranking = harmful_ranking(a, cfg.tau, a)
        kept = full_mask(k) & ~sum(1 << int(i) for i in ranking)
        util, ok = ev(np.array([full_mask(k), kept]))
        r = tuple(int(i) for i in ranking)
        return Outcome(r, r, bool(ok[1]), ev.evaluations, float(util[0]), float(util[1]), "loo", _full(a, case.seed))
    if family in BASELINE_ESTIMATORS:  # the contract's surrogates, `masks` random ablations (distinct <= masks)
        masks = cfg.contextcite_masks if family == "contextcite" else cfg.proxyspex_masks
        return _ranked(k, _estimate(family, k, ev, masks, case.seed, cfg.tau), ev, cfg.tau, family, case.seed)
    if family == "filter":
        if drop is not None:  # the LLM filter: drop what the model says, check the result once
            r = tuple(sorted(int(i) for i in drop))
            kept = full_mask(k) & ~sum(1 << i for i in r)
            util, ok = ev(np.array([kept]))
            scores = np.zeros(k)
            scores[list(r)] = -1.0  # dropped first; within each group ties by the case seed
            # +1: the filter's own generation call is an agent evaluation too.
            return Outcome(r, r, bool(ok[0]), ev.evaluations + 1, None, float(util[0]), "llm_filter",
                           _full(scores, case.seed))
        rel = _lexical_relevance(case.query.question, case.context.texts)
        res = relevance_filter(rel, cfg.filter_threshold, ev)
        return Outcome(res.cleared, res.cleared, res.recovered, ev.evaluations, None, res.cleared_utility,
                       "relevance_filter", _full(res.attribution, case.seed))
    raise ConfigError(f"methods: {method.name!r} is not a method")


def run_case(bc: BenchCase, agent: Agent, methods: tuple[str, ...], utilities: tuple[str, ...],
             cfg: MethodConfig) -> list[tuple[str, str, Outcome]] | None:
    """Every (method, utility mode) on one case: [(method name, utility, outcome)], or None when the case is excluded.

    The full context is re-evaluated first, in this phase: an LLM's answer can change with batching, and a case whose
    full context now comes back correct has nothing to recover, so it is excluded from every method's metrics.
    """
    parsed = [Method.parse(m) for m in methods]
    oracle = CaseOutcomes(agent, bc.case)
    if bool(oracle.outcome(np.array([full_mask(bc.case.k)]))[0]):
        return None
    if Method("meclear") in parsed and bc.case.k <= EXACT_MAX_K:
        oracle.fetch(np.arange(1 << bc.case.k))  # all of them are needed anyway: one agent batch
    drop = None
    if Method("filter") in parsed and hasattr(agent, "drop_memories"):
        from pipeline.agents.llm_filter import filter_memories

        q = bc.case.query
        drop = filter_memories(agent, q.question, q.options, bc.case.context.texts)  # type: ignore[arg-type]
    with _fast_sklearn():
        return [(m.name, u, run_method(m, bc, agent, oracle, u, cfg, drop)) for u in utilities for m in parsed]


def _fast_sklearn():
    """sklearn without per-call input and parameter validation: ProxySPEX fits 200 boosting stages per case and mode,
    and validation was a third of that time. Inputs here are finite 0/1 matrices and utilities made by this module."""
    try:
        import sklearn
    except ImportError:
        from contextlib import nullcontext

        return nullcontext()
    return sklearn.config_context(assume_finite=True, skip_parameter_validation=True)
