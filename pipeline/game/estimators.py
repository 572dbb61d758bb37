"""One estimator contract for the audit and the benchmark (issue 16), in the spirit of shapiq's
`approximate(budget, game)`: `estimate(game, budget, rng) -> Attribution`.

- A `Game` is a batched coalition oracle over int64 bitmasks (bit i = memory i kept).
- An `Estimator` asks the game for at most `budget` distinct coalitions (never 2^K unless budget >= 2^K) and returns
  an `Attribution`: values, standard errors, evaluations spent, why it stopped, whether the values are estimated.
- `start(k, budget, rng)` gives the same estimator in ask/tell form (`EstimatorRun`), so the audit can batch the
  coalitions of many cases into one engine call (pipeline.audit.worker.run_cases) while the benchmark calls `estimate`.
  `estimate` is exactly `while len(m := run.ask()): run.tell(m, game(m))`, so both give identical attributions for
  the same case and seed.

The budget counts distinct agent evaluations per query, clearance checks included: `split_budget(budget, k)` is the
part an estimator may spend, the rest is kept for the clearance's checks (`pipeline.game.clearance`). Every Shapley
estimator here first asks the K+2 "anchor" coalitions (the empty set, the full context and the full context minus
each memory: LOO and the clearance's first candidate come free), which is why the smallest budget is K+2.

Estimators are implemented as generators that yield the coalitions they need next and read the values told back from
a sparse table (`pipeline.game.sparse`): the ask/tell form and the one-call form are the same code.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass
from itertools import combinations
from math import comb
from typing import Protocol, runtime_checkable

import numpy as np

from pipeline.core.errors import ConfigError
from pipeline.game.adaptive import DEFAULT_Z, separated
from pipeline.game.attribution import (
    permutation_contributions,
    shapley_exact,
    shapley_least_squares,
    shapley_permutation,
)
from pipeline.game.plan import (  # noqa: F401  (BudgetError, min_budget, check_budget: part of the contract)
    ADAPTIVE_CAP,
    ADAPTIVE_CHECK_AFTER,
    ADAPTIVE_ROUND,
    ADAPTIVE_RULE,
    ADAPTIVE_RULES,
    MAX_EXACT_PLAYERS,
    MAX_PLAYERS,
    BudgetError,
    anchor_coalitions,
    check_budget,
    full_mask,
    loo_coalitions,
    min_budget,
    prefix_masks,
)
from pipeline.game.restricted import certify, observed_marginals
from pipeline.game.sparse import SparseTable

EMPTY = np.zeros(0, dtype=np.int64)


# --------------------------------------------------------------------------------------------------- the contract
@runtime_checkable
class Game(Protocol):
    """A batched coalition oracle: one utility per bitmask. Implementations cache (asking twice costs one call)."""

    n_players: int

    def __call__(self, masks: np.ndarray) -> np.ndarray: ...


@dataclass(frozen=True)
class Attribution:
    """What an estimator found for one game."""

    values: np.ndarray  # (K,) Shapley estimates (a surrogate's attribution scores); negative = harmful
    se: np.ndarray  # (K,) standard errors; 0 for exact; NaN where the method has none
    evaluations: int  # distinct coalitions this estimator asked the game for
    stop: str  # "exact", "budget", "separation", "cap", "permutations", "fit", ...
    estimated: bool  # False only for exact enumeration
    method: str  # the estimator's name
    draws: int = 0  # permutations drawn (0 for exact and the regression/surrogate estimators)


class EstimatorRun(Protocol):
    def ask(self) -> np.ndarray: ...  # the coalitions needed next; empty when done

    def tell(self, masks: np.ndarray, values: np.ndarray) -> None: ...

    def result(self) -> Attribution: ...


@runtime_checkable
class Estimator(Protocol):
    name: str
    anchors: bool  # True: its first ask holds the K+2 anchor coalitions (LOO and the empty set)

    def estimate(self, game: Game, budget: int, rng: np.random.Generator) -> Attribution: ...

    def start(self, k: int, budget: int, rng: np.random.Generator) -> EstimatorRun: ...


# Coalitions kept back from the estimator for the clearance's checks. The clearance checks N minus each prefix of the
# harmful ranking; N and N minus the top memory are anchors, so only |H| - 1 more can be needed. Harmful sets at K=10
# on LoCoMo hold 1-3 memories, so 2 are kept back (never more than K - 2, never below the K+2 the estimator needs);
# whatever an estimator leaves unspent (adaptive stops early) also goes to the clearance, and a clearance that cannot
# afford a candidate does not check it (pipeline.audit.reduce).
CLEARANCE_RESERVE = 2


def clearance_reserve(k: int, budget: int, utility: str = "probability") -> int:
    """Evaluations of a per-query budget kept back for the verified clearance, by utility mode (measured with
    jobs/bench_split.py: the reader on all ten LoCoMo conversations, FI-LoCoMo fault cases, what `meclear audit
    --budget B` ships replayed with reserves 0-32 on the same cases; docs/method.md "Splitting the budget").

    `correct`: min(K - 2, B // 8). The clearance there checks several rankings (`clearance_rankings`), and a reserve
    of 2 left most of their candidates unchecked: at K=20 recovery rose from 61.3% / 84.4% / 96.3% (B=64 / 128 / 256)
    to 81.4% / 99.4% / 100% with this rule, exact-set match -0.6 / +3.1 / +1.8 pp; at K=10 from 91.8% / 98.7% to
    99.2% / 100% (B=64 / 128), exact-set +1.3 / -0.2 pp. `probability`: CLEARANCE_RESERVE. Its clearance prefers the
    Shapley chain, whose continuous gains make a longer checked prefix a larger set (exact-set match fell 9-14 pp
    with any larger reserve at K=20, recovery already 99.4-100%, measured with the chain alone).

    Checked again with `sparseshap` (issue 30 item 2): a smaller reserve from B=128 (min(K-2, 8, 512 // B)) looked
    better on the tuned pair and was level or worse on all ten conversations (K=32 B=128: Recall@|M| +1.5 pp,
    recovery -2.2 pp), so the rule stands (docs/method.md "A sparse surrogate's Shapley values")."""
    if utility == "correct":
        return max(CLEARANCE_RESERVE, min(k - 2, budget // 8))
    return CLEARANCE_RESERVE


def split_budget(budget: int, k: int, reserve: int = CLEARANCE_RESERVE) -> int:
    """The part of a per-query `budget` (distinct agent evaluations, clearance checks included) an estimator may
    spend. One function for the audit and the benchmark, so "budget" means the same in both. `reserve`: what is kept
    back for the clearance (`clearance_reserve`), never below the K+2 anchors the estimator needs, never above K-2
    (the most one nested chain needs beyond the anchors is K-2; more rankings are checked inside the same cap)."""
    check_budget(budget, k)
    reserve = max(0, min(reserve, max(k - 2, 0), budget - min_budget(k)))
    return budget - reserve


class CachedGame:
    """A `Game` over a plain function `f(masks) -> values`, evaluating each distinct coalition once and counting."""

    def __init__(self, k: int, f: Callable[[np.ndarray], np.ndarray]):
        if not 1 <= k <= MAX_PLAYERS:
            raise ConfigError(f"game: K={k} players is out of range; allowed 1..{MAX_PLAYERS}")
        self.n_players = k
        self._f = f
        self._cache: dict[int, float] = {}

    @property
    def evaluations(self) -> int:
        return len(self._cache)

    @property
    def asked(self) -> np.ndarray:
        return np.array(sorted(self._cache), dtype=np.int64)

    def __call__(self, masks: np.ndarray) -> np.ndarray:
        masks = np.asarray(masks, dtype=np.int64)
        new = np.array(sorted({int(m) for m in masks.ravel()} - self._cache.keys()), dtype=np.int64)
        if new.size:
            if new.min() < 0 or new.max() > full_mask(self.n_players):
                raise ValueError(f"masks must lie in 0..{full_mask(self.n_players)}; got {new.min()}..{new.max()}")
            self._cache.update(zip(new.tolist(), np.asarray(self._f(new), dtype=np.float64).tolist()))
        return np.array([self._cache[int(m)] for m in masks.ravel()], dtype=np.float64).reshape(masks.shape)


def table_game(values: np.ndarray) -> CachedGame:
    """A game over a full 2^K table (tests, the benchmark's exact tables)."""
    values = np.asarray(values, dtype=np.float64)
    k = int(values.size).bit_length() - 1
    return CachedGame(k, lambda m: values[m])


# ------------------------------------------------------------------------------------------------ shared machinery
Steps = Generator[np.ndarray, None, Attribution]


class _Run:
    """An `EstimatorRun` driven by a generator that yields the coalitions it needs and returns the Attribution.

    `ask` returns only what was not told yet; `tell` stores into a sparse table the generator reads (`self.values`).
    The budget is enforced here for every estimator: a generator that asks past it is a bug and raises."""

    def __init__(self, k: int, budget: int, steps: Callable[["_Run"], Steps]):
        self.k, self.budget = k, budget
        self.values = SparseTable(k)
        self._gen = steps(self)
        self._need: np.ndarray | None = None
        self._result: Attribution | None = None

    @property
    def evaluations(self) -> int:
        return int(self.values.keys.size)

    def missing(self, masks: Iterable[int] | np.ndarray) -> np.ndarray:
        masks = np.unique(np.asarray(masks, dtype=np.int64))
        return masks[np.isnan(self.values[masks])]

    def ask(self) -> np.ndarray:
        while self._result is None:
            if self._need is not None and len(miss := self.missing(self._need)):
                if self.evaluations + miss.size > self.budget:
                    raise RuntimeError(f"estimator asked for {self.evaluations + miss.size} coalitions, "
                                       f"over its budget {self.budget} (a bug)")
                return miss
            try:
                self._need = next(self._gen)
            except StopIteration as done:
                self._result = done.value
        return EMPTY

    def tell(self, masks: np.ndarray, values: np.ndarray) -> None:
        self.values[np.asarray(masks, dtype=np.int64)] = np.asarray(values, dtype=np.float64)

    def result(self) -> Attribution:
        if self._result is None:
            raise RuntimeError("result() before the run is done: ask() until it returns no coalitions")
        return self._result

    def attribution(self, values, se, stop: str, method: str, estimated: bool = True, draws: int = 0) -> Attribution:
        return Attribution(np.asarray(values, dtype=np.float64), np.asarray(se, dtype=np.float64), self.evaluations,
                           stop, estimated, method, draws)


class _Base:
    """`estimate` as the ask/tell loop, so the two forms cannot drift apart."""

    name = "base"
    anchors = True

    def start(self, k: int, budget: int, rng: np.random.Generator) -> _Run:
        if not 1 <= k <= MAX_PLAYERS:
            raise ConfigError(f"{self.name}: K={k} players is out of range; allowed 1..{MAX_PLAYERS}")
        budget = check_budget(budget, k, f"{self.name} budget")
        return _Run(k, budget, lambda run: self._steps(run, rng))

    def estimate(self, game: Game, budget: int, rng: np.random.Generator) -> Attribution:
        run = self.start(game.n_players, budget, rng)
        while len(m := run.ask()):
            run.tell(m, game(m))
        return run.result()

    def _steps(self, run: _Run, rng: np.random.Generator) -> Steps:
        raise NotImplementedError


def _draw_permutations(k: int, n: int, rng: np.random.Generator, antithetic: bool) -> np.ndarray:
    """n permutations (n even if antithetic: each followed by its reverse). The same draws as
    `pipeline.game.plan.make_plan` for the same generator state, so the audit's former plans are reproduced."""
    if antithetic:
        half = rng.permuted(np.tile(np.arange(k), (n // 2, 1)), axis=1)
        perms = np.empty((n, k), dtype=np.int64)
        perms[0::2], perms[1::2] = half, half[:, ::-1]
        return perms
    return rng.permuted(np.tile(np.arange(k), (n, 1)), axis=1).astype(np.int64)


def _fit_permutations(k: int, perms: np.ndarray, budget: int, known: set[int], step: int) -> int:
    """How many of `perms` (taken `step` at a time: 2 for antithetic pairs) fit in `budget` distinct coalitions on top
    of `known`. Prefixes are known before anything is evaluated, so this is decided without spending a call."""
    seen = set(known)
    used = 0
    for j in range(0, len(perms), step):
        new = set(prefix_masks(perms[j:j + step]).ravel().tolist()) - seen
        if len(seen) + len(new) > budget:
            break
        seen |= new
        used = j + step
    return used


# ------------------------------------------------------------------------------------------------------ estimators
class Exact(_Base):
    """All 2^K coalitions, exact Shapley values by enumeration. Refuses a budget below 2^K (never silently 2^K)."""

    name = "exact"

    def _steps(self, run: _Run, rng: np.random.Generator) -> Steps:
        k = run.k
        if k > MAX_EXACT_PLAYERS:
            raise ConfigError(f"exact enumeration is capped at K={MAX_EXACT_PLAYERS} (dense tables of 2^K values); "
                              f"K={k}: use a sampled estimator")
        if run.budget < 1 << k:
            raise BudgetError(f"exact enumeration at K={k} needs 2^{k} = {1 << k:,} evaluations; budget is "
                              f"{run.budget:,} (use a sampled estimator, or raise the budget)")
        yield np.arange(1 << k, dtype=np.int64)
        dense = run.values[np.arange(1 << k, dtype=np.int64)]
        return run.attribution(shapley_exact(dense), np.zeros(k), "exact", self.name, estimated=False)


class Permutation(_Base):
    """Permutation sampling (Castro et al. 2009): each permutation's marginal contributions are an unbiased draw of
    phi. `permutations=L` fixes L (the paper's setting; the budget is then only a cap it is checked against);
    `permutations=0` draws as many permutations as the budget holds (their prefixes are known in advance, so the
    count is exact). `antithetic` pairs each permutation with its reverse (the pair's mean is one draw)."""

    name = "permutation"

    def __init__(self, permutations: int = 0, antithetic: bool = False):
        if permutations < 0 or (antithetic and permutations % 2):
            raise ConfigError(f"{self.name}: permutations={permutations}; must be >= 0 (0: as many as the budget "
                              "holds), and even with antithetic pairs")
        self.permutations, self.antithetic = permutations, antithetic

    def _steps(self, run: _Run, rng: np.random.Generator) -> Steps:
        k, step = run.k, 2 if self.antithetic else 1
        anchors = anchor_coalitions(k)
        if self.permutations:
            perms = _draw_permutations(k, self.permutations, rng, self.antithetic)
            coalitions = np.union1d(prefix_masks(perms).ravel(), loo_coalitions(k))
            if coalitions.size > run.budget:
                raise BudgetError(f"{self.name}: {self.permutations} permutations at K={k} need {coalitions.size} "
                                  f"evaluations; budget is {run.budget}")
            stop = "permutations"
        else:
            # Enough draws for any budget: a permutation adds at least one new coalition until all 2^K are in.
            n = min(run.budget, 4 * (1 << k)) + step
            perms = _draw_permutations(k, n + n % step, rng, self.antithetic)
            used = _fit_permutations(k, perms, run.budget, set(anchors.tolist()), step)
            perms = perms[:max(used, 0)]
            coalitions = np.union1d(prefix_masks(perms).ravel(), anchors) if len(perms) else anchors
            stop = "budget"
        yield coalitions
        if not len(perms):  # the budget holds only the anchors: LOO-scaled split of the total
            return _anchor_only(run, self.name)
        phi, se = shapley_permutation(run.values, perms, self.antithetic)
        return run.attribution(phi, se, stop, self.name, draws=len(perms))


class Antithetic(Permutation):
    name = "antithetic"

    def __init__(self, permutations: int = 0):
        super().__init__(permutations, antithetic=True)


def _anchor_only(run: _Run, name: str) -> Attribution:
    """With only the anchors evaluated: the least-squares fit to them (LOO effects rescaled to efficiency)."""
    phi = shapley_least_squares(run.values, run.values.keys)
    return run.attribution(phi, np.full(run.k, np.nan), "budget", name)


# What an undecided adaptive case reports. "auto": the least-squares fit at the cap (L permutations: ~500 coalitions
# at K=10, a well-determined fit; measured better than the mean, README "Adaptive estimator"), the permutation mean
# at a budget stop (~150 coalitions: there the fit was worse in both utility modes, 89.8% vs 91.1% and 80.9% vs
# 86.8% of harmful sets equal to exact on conv-26/30 at --budget 150; jobs/bench_adaptive.py).
ADAPTIVE_FALLBACKS = ("auto", "fit", "mean", "hybrid")


class Adaptive(_Base):
    """Antithetic permutation pairs in rounds until every Shapley value is separated from the harm threshold -tau
    (pipeline.game.adaptive: |phi + tau| > z * SE), at most `cap` permutations or the budget. An undecided case
    (cap or budget) reports the least-squares fit to every coalition it evaluated or the permutation mean
    (`fallback`, see ADAPTIVE_FALLBACKS). With `rule="check"` (the default, ADAPTIVE_RULES) the rounds end at
    separation or after `check_after` permutations and the case stops on the restricted-game check instead.

    `prior` (issue 16 item 5) guards against a zero SE taken as certainty: in `correct` mode the game is {0, 1} and a
    memory's marginals are often exactly 0 in the first few pairs although it matters in some permutation. The
    sample variance is shrunk towards a prior variance with `prior` pseudo-draws: s^2 -> ((n-1) s^2 + prior * s0^2)
    / (n - 1 + prior), with s0^2 = (range of the case's evaluated utilities)^2 / 4, the largest variance of a
    draw bounded by that range divided by 4 (a Bernoulli(1/2)-like draw for a {0,1} game), so a player needs enough
    identical draws before its SE shrinks. prior=0 is the former rule."""

    name = "adaptive"

    def __init__(self, tau: float = 0.0, cap: int = ADAPTIVE_CAP, round_size: int = ADAPTIVE_ROUND,
                 z: float = DEFAULT_Z, prior: float = 0.0, min_rounds: int = 1, fallback: str = "auto",
                 rule: str = ADAPTIVE_RULE, check_after: int = ADAPTIVE_CHECK_AFTER):
        if rule not in ADAPTIVE_RULES:
            raise ConfigError(f"adaptive: rule={rule!r}; allowed {ADAPTIVE_RULES}")
        if check_after < 2 or check_after % 2:
            raise ConfigError(f"adaptive: check_after={check_after}; must be an even integer >= 2")
        self.rule, self.check_after = rule, check_after
        if cap < 2 or cap % 2 or round_size < 2 or round_size % 2:
            raise ConfigError(f"adaptive: cap={cap}, round_size={round_size}; both must be even integers >= 2 "
                              "(antithetic pairs)")
        if z <= 0 or prior < 0 or tau < 0 or min_rounds < 1:
            raise ConfigError(f"adaptive: z={z}, prior={prior}, tau={tau}, min_rounds={min_rounds}; need z > 0, "
                              "prior >= 0, tau >= 0, min_rounds >= 1")
        self.tau, self.cap, self.round_size, self.z = tau, cap, round_size, z
        if fallback not in ADAPTIVE_FALLBACKS:
            raise ConfigError(f"adaptive: fallback={fallback!r}; allowed {ADAPTIVE_FALLBACKS}")
        self.prior, self.min_rounds, self.fallback = prior, min_rounds, fallback

    def _se(self, run: _Run, perms: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
        contrib = permutation_contributions(run.values, perms)
        pairs = 0.5 * (contrib[0::2] + contrib[1::2])
        n = pairs.shape[0]
        phi = pairs.mean(axis=0)
        if n < 2:
            return phi, np.zeros(phi.shape), n
        sd = pairs.std(axis=0, ddof=1)
        if self.prior:
            span = float(np.ptp(run.values.stored)) if run.values.stored.size else 0.0
            sd = np.sqrt(((n - 1) * sd * sd + self.prior * span * span / 4) / (n - 1 + self.prior))
        return phi, sd / np.sqrt(n), n  # sd / sqrt(n), as pipeline.game.adaptive.estimate computes it

    def _steps(self, run: _Run, rng: np.random.Generator) -> Steps:
        k = run.k
        perms = _draw_permutations(k, self.cap, rng, antithetic=True)
        anchors = loo_coalitions(k)  # the former plan's LOO set; the empty set is every permutation's first prefix
        fits = _fit_permutations(k, perms, run.budget, set(anchors.tolist()) | {0}, 2)
        limit = min(self.cap, fits)
        used = min(self.round_size, limit)
        min_draws = self.round_size * self.min_rounds
        while True:
            if used:
                yield np.union1d(prefix_masks(perms[:used]).ravel(), anchors)
            else:
                yield anchor_coalitions(k)
                return _anchor_only(run, self.name)
            phi, se, _ = self._se(run, perms[:used])
            done = used >= min(min_draws, limit) and bool(separated(phi, se, self.tau, self.z).all())
            if self.rule == "check" and (done or used >= min(self.check_after, limit)):
                # the rounds were the screen; the check decides (pipeline.game.restricted)
                marg = observed_marginals(run.values, k, perms[:used])
                phi, stop, _ = yield from certify(run, marg, phi, self.tau)
                return run.attribution(phi, se, stop, self.name, draws=used)
            if done:
                return run.attribution(phi, se, "separation", self.name, draws=used)
            if used >= limit:
                stop = "cap" if limit == self.cap else "budget"
                fallback = self.fallback if self.fallback != "auto" else ("fit" if stop == "cap" else "mean")
                if fallback != "mean":  # hybrid: the fit only where the mean was not separated
                    fit = shapley_least_squares(run.values, run.values.keys)
                    keep = separated(phi, se, self.tau, self.z) if fallback == "hybrid" else False
                    phi = np.where(keep, phi, fit)
                return run.attribution(phi, se, stop, self.name, draws=used)
            used = min(used + self.round_size, limit)


class KernelSHAP(_Base):
    """Least-squares Shapley values (Lundberg & Lee 2017) with paired sampling (Covert & Lee 2021) and border
    enumeration (shapiq's CoalitionSampler, after Fumagalli et al. 2023).

    Coalition sizes are drawn with probability proportional to the Shapley kernel's mass of the size,
    (K-1)/(s(K-s)); a size whose expected number of draws reaches its number of coalitions is enumerated whole
    instead (the border trick; repeated until no size qualifies), then each drawn coalition comes with its complement
    (paired). Draws are without replacement: a coalition already asked is redrawn. The fit is
    `shapley_least_squares` (the kernel's mass of a size spread evenly over its evaluated coalitions, efficiency
    exact), which for an enumerated size weighs it exactly as the kernel does. The anchors come first (sizes 0, K-1
    and K). SE: NaN (no closed form for the constrained fit)."""

    name = "kernelshap"
    size_weights = "kernel"

    def _size_probs(self, k: int) -> np.ndarray:
        s = np.arange(k + 1, dtype=float)
        w = np.zeros(k + 1)
        if k >= 2:
            if self.size_weights == "kernel":
                w[1:k] = (k - 1) / (s[1:k] * (k - s[1:k]))
            elif self.size_weights == "binomial":  # every coalition alike: each memory kept with probability 1/2
                w[1:k] = [comb(k, int(x)) for x in s[1:k]]
            else:
                w[1:k] = 1.0
        return w

    border_first = True  # enumerate the size-1 layer right after the anchors (the paired border of size K-1)
    loo_anchors = True  # False: the anchors are the empty set and the full context only (no LOO screen)

    def _steps(self, run: _Run, rng: np.random.Generator) -> Steps:
        k = run.k
        yield from self._sample(run, rng)
        phi = shapley_least_squares(run.values, run.values.keys)
        stop = "exact" if run.evaluations == 1 << k else "budget"
        return run.attribution(phi, np.full(k, np.nan), stop, self.name, estimated=stop != "exact")

    def _sample(self, run: _Run, rng: np.random.Generator) -> Generator[np.ndarray, None, None]:
        """The anchors, then paired draws by size (`_size_probs`) with the border trick, inside the budget."""
        k = run.k
        anchors = anchor_coalitions(k, self.loo_anchors)
        yield anchors
        chosen = set(anchors.tolist())
        left = run.budget - len(chosen)
        w = self._size_probs(k)
        if self.loo_anchors:
            w[k - 1] = 0.0  # enumerated by the anchors
        if self.border_first:
            w[1] = 0.0  # enumerated next
        counts = np.array([comb(k, s) for s in range(k + 1)], dtype=float)
        if k >= 2 and left >= k and self.border_first:  # size 1 pairs with the anchors' size K-1: border first
            chosen |= {1 << i for i in range(k)}
            left -= k
        elif k >= 2 and self.border_first:  # too small a budget for the size-1 layer: sample it (K-1 is in already)
            w[1] = self._size_probs(k)[1]
        # border trick: enumerate any size (with its complement) whose expected draws reach its coalition count
        while w.sum() > 0:
            p = w / w.sum()
            full = [s for s in range(1, k) if w[s] > 0 and left * p[s] >= counts[s]
                    and left >= counts[s] + (counts[k - s] if k - s != s else 0)]
            if not full:
                break
            for s in full:
                for t in {s, k - s}:
                    if w[t] > 0:
                        chosen |= set(_all_of_size(k, t).tolist())
                        w[t] = 0.0
            left = run.budget - len(chosen)
        # paired sampling without replacement over the remaining sizes; a draw already asked is redrawn, and
        # sampling ends when the budget is spent or draws keep repeating (the sampled sizes are exhausted)
        if w.sum() > 0:
            p = w / w.sum()
            misses = 0
            while left > 0 and misses < 200:
                m = _random_of_size(k, int(rng.choice(k + 1, p=p)), rng)
                new = [x for x in dict.fromkeys((m, full_mask(k) & ~m)) if x not in chosen][:left]
                misses = 0 if new else misses + 1
                chosen.update(new)
                left -= len(new)
        yield np.array(sorted(chosen), dtype=np.int64)


class LeverageSHAP(KernelSHAP):
    """Leverage SHAP (Musco & Witter, ICLR 2025, "Provably Accurate Shapley Value Estimation via Leverage Score
    Sampling"): KernelSHAP's regression, but coalitions sampled by their leverage scores, which in closed form are
    1/C(K, |S|): every size 1..K-1 gets the same probability mass (uniform over sizes), where KernelSHAP's kernel
    puts most of it at the borders. With paired sampling and sampling without replacement as in the paper; the
    regression is the same constrained fit as `kernelshap` (per-size weights = the kernel's mass of the size spread
    over its evaluated coalitions, the ratio form of the paper's importance weights kernel(S)/p(S))."""

    name = "leverage"
    size_weights = "uniform"


def _all_of_size(k: int, s: int) -> np.ndarray:
    """Every coalition of size s, by combinations (never a 2^K array: only called for a layer the budget holds)."""
    return np.array([sum(1 << i for i in c) for c in combinations(range(k), s)], dtype=np.int64)


def _random_of_size(k: int, s: int, rng: np.random.Generator) -> int:
    idx = rng.choice(k, size=s, replace=False)
    return int(np.sum(np.left_shift(np.int64(1), idx.astype(np.int64))))


# --------------------------------------------------------------------------------------------------------- registry
_REGISTRY: dict[str, Callable[..., _Base]] = {
    "exact": Exact,
    "permutation": Permutation,
    "antithetic": Antithetic,
    "adaptive": Adaptive,
    "kernelshap": KernelSHAP,
    "leverage": LeverageSHAP,
}
# + the registered ones
ESTIMATOR_NAMES: tuple[str, ...] = tuple(_REGISTRY) + ("screened", "adjusted", "sparseshap", "contextcite", "proxyspex")
SURROGATES = ("contextcite", "proxyspex")  # baselines behind the same contract (pipeline.game.surrogates)


def register(name: str, factory: Callable[..., object]) -> None:
    """Add an estimator (the surrogate baselines register themselves from pipeline.game.surrogates)."""
    _REGISTRY[name] = factory


def get_estimator(name: str, **options) -> Estimator:
    """The estimator `name` with `options` (constructor keywords). Unknown names and options are ConfigError."""
    if name not in _REGISTRY:
        raise ConfigError(f"estimator {name!r} is unknown; allowed {tuple(_REGISTRY)}")
    try:
        return _REGISTRY[name](**options)
    except TypeError as err:
        raise ConfigError(f"estimator {name!r}: bad options {sorted(options)} ({err})") from err
