"""The benchmarked methods, run on one fault-injected case: attribution, harmful ranking, clearance, recovery.

Every method sees the case only through a counting oracle (`CachedOracle`) in one utility mode, so its reported
`evaluations` are the distinct coalitions it asked for, clearance checks included. The agent itself answers each
coalition once per case (`CaseOutcomes`); both utility modes and all methods read from that table.

- meclear_l{L}: L permutations forced (make_plan(..., estimator="permutation")), plus the LOO coalitions the plan
  always holds; meclear_exact: all 2^K coalitions. Shapley values, harmful ranking (phi < -tau, ties by LOO), nested
  verified clearance. Pairwise interactions are diagnostics in MeClear and do not enter the ranking or the clearance,
  so the benchmark does not compute them.
- loo: rank by LOO effect, same nested clearance; loo_threshold: remove every memory with loo < -tau at once.
- contextcite, proxyspex: `pipeline.bench.baselines`, same ranking rule (without LOO tie-break: it would cost
  evaluations they do not make) and the same nested clearance.
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

from dataclasses import dataclass, replace

import numpy as np

from pipeline.agents.base import Agent
from pipeline.bench.baselines import CachedOracle, context_cite, loo, proxyspex, relevance_filter
from pipeline.bench.builder import BenchCase
from pipeline.bench.metrics import full_ranking
from pipeline.bench.outcomes import CaseOutcomes
from pipeline.errors import ConfigError
from pipeline.game import harmful_ranking, make_plan, select_clearance, shapley_exact, shapley_permutation
from pipeline.game.attribution import loo_effects
from pipeline.game.clearance import clearance_coalitions
from pipeline.game.plan import DEFAULT_PERMUTATIONS, full_mask
from pipeline.settings import DEFAULT_KAPPA, DEFAULT_TAU, check_number, check_setting
from pipeline.text import tokens

FAMILIES = ("meclear", "loo", "contextcite", "proxyspex", "filter")
CONTROLS = ("position", "random", "oracle")
DEFAULT_BUDGETS = (4, 8, 16)
METHOD_FAMILIES = (*FAMILIES, "loo_threshold", *CONTROLS)  # what a Method's family may be
_ALLOWED = f"allowed {FAMILIES}, loo_threshold, meclear_exact, meclear_l<L>, controls, {', '.join(CONTROLS)}"
DEFAULT_METHODS = ("meclear", "loo", "contextcite", "proxyspex", "filter", "controls")  # CLI words, see expand_methods


@dataclass(frozen=True)
class MethodConfig:
    tau: float = DEFAULT_TAU
    kappa: float = DEFAULT_KAPPA  # LOO screen tolerance; recorded, it does not change a ranking or a clearance
    contextcite_masks: int = 64
    proxyspex_masks: int = 64
    filter_threshold: float = 0.5  # relevance filter: drop memories with fewer than this share of question words

    def __post_init__(self) -> None:
        check_setting("tau", self.tau, "method config")  # the audit's rules (pipeline.settings.SETTING_RULES)
        check_setting("kappa", self.kappa, "method config")
        check_number(self.filter_threshold, "method config", "filter_threshold")
        for name in ("contextcite_masks", "proxyspex_masks"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ConfigError(f"method config: {name}={v!r}; must be an integer >= 1")


@dataclass(frozen=True)
class Method:
    """One benchmarked method: its family and, for MeClear, the permutation budget L (None: exact enumeration)."""

    family: str  # meclear, loo, loo_threshold, contextcite, proxyspex, filter, or a control
    budget: int | None = None

    def __post_init__(self) -> None:
        budget_ok = self.budget is None or (self.family == "meclear" and isinstance(self.budget, int)
                                            and not isinstance(self.budget, bool) and self.budget >= 1)
        if self.family not in METHOD_FAMILIES or not budget_ok:
            raise ConfigError(f"methods: family {self.family!r} with budget {self.budget!r} is not a method; {_ALLOWED}")

    @property
    def name(self) -> str:
        """The method's name in cases.parquet and the summary: meclear_l<L>, meclear_exact, or the family."""
        if self.family != "meclear":
            return self.family
        return "meclear_exact" if self.budget is None else f"meclear_l{self.budget}"

    @classmethod
    def parse(cls, name: str) -> "Method":
        """The method a single name stands for (meclear_l8, meclear_exact, loo_threshold, position, ...)."""
        if name == "meclear_exact":
            return cls("meclear")
        digits = name.removeprefix("meclear_l") if name.startswith("meclear_l") else ""
        if digits.isdigit() and int(digits) >= 1:
            return cls("meclear", int(digits))
        if name != "meclear" and name in METHOD_FAMILIES:
            return cls(name)
        raise ConfigError(f"methods: {name!r} is not a method; {_ALLOWED}")


def expand_methods(names: list[str] | tuple[str, ...], budgets: tuple[int, ...] = DEFAULT_BUDGETS) -> tuple[str, ...]:
    """Method names from CLI words: 'meclear' -> meclear_l<L> for each budget + meclear_exact, 'loo' -> loo +
    loo_threshold, 'controls' -> position + random + oracle; single names (meclear_l8, meclear_exact, loo_threshold,
    position, ...) pass through. Order kept, no repeats."""
    out: list[Method] = []
    for n in names:
        if n == "meclear":
            out += [Method("meclear", b) for b in budgets] + [Method("meclear")]
        elif n == "loo":
            out += [Method("loo"), Method("loo_threshold")]
        elif n == "controls":
            out += [Method(c) for c in CONTROLS]
        else:
            out.append(Method.parse(n))
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


def _clear(k: int, ranking: np.ndarray, ev: CachedOracle) -> tuple[tuple[int, ...], bool, float, float]:
    """Nested verified clearance over `ranking`, evaluating its candidates through `ev`."""
    kept = clearance_coalitions(k, ranking)
    util, ok = ev(kept)
    values = np.full(1 << k, np.nan)
    correct = np.zeros(1 << k, dtype=bool)
    values[kept], correct[kept] = util, ok
    c = select_clearance(k, ranking, values, correct)
    return c.removed, c.recovered, c.baseline_utility, c.cleared_utility


def _full(scores: np.ndarray, seed: int) -> tuple[int, ...]:
    return tuple(int(i) for i in full_ranking(scores, seed))


def _ranked(k: int, attribution: np.ndarray, ev: CachedOracle, tau: float, name: str, seed: int,
            loo_tie: np.ndarray | None = None) -> Outcome:
    ranking = harmful_ranking(attribution, tau, loo_tie)
    removed, recovered, base, cleared = _clear(k, ranking, ev)
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
    """MeClear with L=budget forced permutations, or exact enumeration (budget None)."""
    plan = make_plan(k, budget or DEFAULT_PERMUTATIONS, "exact" if budget is None else "permutation", seed=seed)
    util, _ = ev(plan.coalitions)
    values = np.full(1 << k, np.nan)
    values[plan.coalitions] = util
    phi = shapley_exact(values) if budget is None else shapley_permutation(values, plan.permutations)[0]
    return replace(_ranked(k, phi, ev, tau, plan.estimator, seed, loo_effects(values)), permutations=budget)


def _lexical_relevance(question: str, texts: tuple[str, ...]) -> np.ndarray:
    q = set(tokens(question))
    return np.array([len(q & set(tokens(t))) / max(len(q), 1) for t in texts])


def run_method(method: Method, bc: BenchCase, agent: Agent, oracle: CaseOutcomes, utility: str, cfg: MethodConfig,
               drop: list[int] | None = None) -> Outcome:
    """One method on one case in one utility mode. `drop`: the LLM filter's answer (mode-independent, asked once)."""
    case, k, family = bc.case, bc.case.k, method.family
    ev = CachedOracle(k, oracle.mode(utility))
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
    if family == "contextcite":
        a = context_cite(k, ev, cfg.contextcite_masks, seed=case.seed).attribution
        return _ranked(k, a, ev, cfg.tau, family, case.seed)
    if family == "proxyspex":
        a = proxyspex(k, ev, cfg.proxyspex_masks, seed=case.seed).attribution
        return _ranked(k, a, ev, cfg.tau, family, case.seed)
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
    if Method("meclear") in parsed:
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
