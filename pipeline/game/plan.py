"""Coalition planning: which coalitions a case needs, each listed once.

A plan is either exact enumeration (all 2^K coalitions) or L seeded permutations whose prefixes are the coalitions to
evaluate. `auto` enumerates when 2^K is no more than what the sampled plan may touch: L permutations touch at most
L*(K-1)+2 distinct prefixes (the empty and the full coalition are shared by all). The bound, not the realised count,
decides, so the choice does not depend on the seed. With K=5, L=16: 32 <= 66, so exact enumeration.
The LOO coalitions (the full context and the full context minus each memory) are always in the plan.

`adaptive` (the paper's Appendix B) always draws antithetic pairs (a permutation, then its reverse: their prefixes are
complementary coalitions) and plans only the first round of `round_size` of them; `pipeline.game.adaptive` decides
after each round whether to stop (every Shapley value separated from the harm threshold) or to evaluate the next
round's prefixes, up to all L. Pairs, because on 96 LoCoMo queries at K=10 (cap 64) they cut the evaluations per case
from 151 to 116 and raised harmful-set agreement with exact from 89% to 92% (mean over 4 seeds; jobs/bench_adaptive.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipeline.core.errors import ConfigError

# "auto" and the contract's names (pipeline.game.estimators.ESTIMATOR_NAMES)
ESTIMATORS = ("auto", "exact", "permutation", "antithetic", "adaptive", "kernelshap", "leverage", "screened",
              "adjusted", "sparseshap", "contextcite", "proxyspex")
DEFAULT_PERMUTATIONS = 16  # permutation budget L: the audit's default, and the adaptive estimator's default cap
# The adaptive estimator's cap when none is given: measured at K=10 on three disjoint 96-query LoCoMo subsets
# (jobs/bench_adaptive.py, README "Adaptive estimator"), L=96 stops after 112-134 evaluations per case on average with
# 95.8-97.9% of harmful sets equal to exact; L=64 agreed in 89-96%. A cap is only reached by undecided cases.
ADAPTIVE_CAP = 96
ADAPTIVE_ROUND = 8  # permutations per round of the adaptive estimator (and the fewest it ever stops at)
# Coalitions are int64 bitmasks (bit i = memory i kept): in Arrow/Parquet, numpy and the sparse tables alike. A
# signed 64-bit mask holds 63 players with every mask non-negative (sorting, `searchsorted`, `bitwise_count` and
# range checks all assume that), so K tops out at 63 under a sampled estimator. Agents retrieve 20-50 memories; a
# 64th would need unsigned masks in every stored run, for one player. Nothing allocates 2^K under a sampled plan:
# value tables are sparse (pipeline.game.sparse), and the clearance's candidates are K+1 nested sets.
MAX_PLAYERS = 63
# Exact enumeration keeps dense tables of 2^K floats (8 MiB at K=20, and 2^(K-1) rows per player in the index).
MAX_EXACT_PLAYERS = 20


class BudgetError(ConfigError):
    """A budget an estimator cannot work with (too small for the method, or not an integer)."""


def min_budget(k: int) -> int:
    """The smallest useful budget: the empty set, the full context and the full context minus each memory (at K=1
    the full context minus its one memory is the empty set: 2 coalitions, all there are)."""
    return min(k + 2, 1 << k)


def check_budget(budget: object, k: int, where: str = "budget") -> int:
    """`budget` as an int: distinct agent evaluations per query, at least K+2 (pipeline.game.estimators)."""
    if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)):
        raise BudgetError(f"{where}={budget!r}: must be an integer count of agent evaluations per query")
    if budget < min_budget(k):
        raise BudgetError(f"{where}={budget} is below K+2 = {min_budget(k)} at K={k} (the empty set, the full context "
                          "and the full context minus each memory)")
    return int(budget)


def full_mask(k: int) -> int:
    return (1 << k) - 1


def members(mask: int, k: int) -> list[int]:
    return [i for i in range(k) if mask >> i & 1]


def popcount(masks: np.ndarray) -> np.ndarray:
    """Number of set bits of each mask, as int64. One vectorised pass (numpy >= 2.0 `bitwise_count`); the former
    21-pass shift-and-add loop cost 2.2 s of a 20 s K=5 LoCoMo evaluation phase in the driver."""
    return np.bitwise_count(np.asarray(masks, dtype=np.int64)).astype(np.int64)


def loo_coalitions(k: int) -> np.ndarray:
    full = full_mask(k)
    return np.array([full] + [full & ~(1 << i) for i in range(k)], dtype=np.int64)


def anchor_coalitions(k: int, loo: bool = True) -> np.ndarray:
    """The coalitions a regression estimator asks first, sorted: the empty set, the K leave-one-out sets and N, or,
    where the LOO screen is dropped (`auto_measures_loo`), the empty set and N only."""
    return (np.union1d(loo_coalitions(k), [0]) if loo else np.unique([0, full_mask(k)])).astype(np.int64)


def prefix_masks(permutations: np.ndarray) -> np.ndarray:
    """(L, K+1) masks: column j is the set of the first j players of each permutation."""
    perms = np.asarray(permutations, dtype=np.int64)
    bits = np.left_shift(np.int64(1), perms)
    out = np.zeros((perms.shape[0], perms.shape[1] + 1), dtype=np.int64)
    np.cumsum(bits, axis=1, out=out[:, 1:])  # distinct bits, so a running sum is a running OR
    return out


def sampled_touch_bound(k: int, permutations: int) -> int:
    return permutations * max(k - 1, 0) + 2


@dataclass(frozen=True)
class GamePlan:
    """The coalitions one case needs in its first pass, and how its Shapley values will be estimated."""

    k: int
    estimator: str  # "exact", "permutation" or "adaptive" (never "auto" once planned)
    budget: int  # L, the permutation budget asked for
    antithetic: bool
    seed: int
    permutations: np.ndarray  # (L, K) int64; empty (0, K) for exact enumeration
    coalitions: np.ndarray  # sorted, unique int64 masks (adaptive: the first round's only)
    round_size: int = 0  # adaptive: permutations per round; 0 otherwise
    eval_budget: int = 0  # distinct agent evaluations per query, clearance checks included; 0 = none (L decides)
    utility: str = "probability"  # the utility mode: it sets the clearance's share of eval_budget (clearance_reserve)
    prior: float = 0.0  # adaptive: variance pseudo-draws (pipeline.game.estimators.Adaptive)
    rule: str = "check"  # adaptive: how a case stops (ADAPTIVE_RULES)
    loo: bool = True  # the audit measures the K leave-one-out coalitions (False: `auto_measures_loo` said no)

    def round_coalitions(self, used: int) -> np.ndarray:
        """Coalitions of the first `used` permutations (and LOO): what an adaptive case needs after `used`."""
        return np.union1d(prefix_masks(self.permutations[:used]).ravel(), loo_coalitions(self.k))

    @property
    def n_coalitions(self) -> int:
        return int(self.coalitions.size)


# `auto` under a budget (issue 16 item 7): exact enumeration when the budget holds all 2^K coalitions, otherwise the
# sampled estimator that measured best at equal budget, which depends on the utility mode (README "Estimators and the
# budget"; jobs/bench_adaptive.py, LoCoMo K=10, reader, budget 128, harmful sets equal to exact, tuned conv-26/30 and
# held-out conv-41/44/47): `probability` (smooth values) -> least squares, kernelshap 93.1% / 94.8% (permutation
# 86.5% / 90.4%, adaptive 90.5% / 92.8%); `correct` ({0,1} values, most marginals exactly 0) -> the permutation
# mean, 88.5% / 93.7% (kernelshap 80.9% / 85.2%: the fit smears a few non-zero coalitions over every memory).
# Checked on FI-LoCoMo fault cases (docs/benchmark.md "K=10 (probability mode)", 478 cases, 10 conversations, B=16-256):
# in `probability` kernelshap is best or level on exact-set match, Recall@|M| and recovery from B=32 (+9.6 pp exact-set
# over adaptive at 32, held-out too), level on harmful-set agreement at 128; adaptive agrees with exact more at 32-64
# (+7.5 / +10.7 pp) and needs ~27% fewer calls at 128, so it is the documented option, not the default.
# In `correct` mode the evidence moved (docs/method.md "Estimators and the budget"): on the clearance, the audit's
# verified output, kernelshap beats the permutation mean at equal budget wherever the budget buys more than the
# anchors. Paired, exact-set match, kernelshap minus permutation: SmolLM2-135M-Instruct at K=10 (81 cases, all ten
# conversations) +25.9 pp [+13.8, +38.5] at B=32 (held-out conversations alone +26.2), +4.9 [-2.7, +12.7] at 64;
# reader at K=10 (478 cases) +7.5 [+3.4, +11.7] at 32, +8.2 at 64, +5.4 [+1.2, +9.7] at 128, held-out too; reader at
# K=20 (488 cases) +4.5 to +7.4 from B=64, held-out too. The mean keeps the better agreement with exact Shapley values
# on the reader at K=10 (83.9% vs 64.6% same harmful set at 128): `--estimator permutation` for that. Where the budget
# buys fewer than K samples beyond the K+2 anchors and the clearance's reserve (N < 2K + 4: K=10 B=16, K=20 B=32) both
# are LOO in effect and the mean was level or ahead on exact-set match (SmolLM2 K=10 B=16: -3.7 [-10.8, +0.0] for
# kernelshap; reader K=10 B=16: -0.4 [-2.9, +1.9]; reader K=20 B=32: -1.0 [-3.2, +1.0], though kernelshap recovered
# 3-5 pp more there), so auto keeps the mean there, up to K=20. Above K=20 it does not: the mean under a budget draws
# only whole permutations (K-1 new coalitions each), so at K=32 and B=64 it spends 35 of 64 evaluations (LOO and one
# permutation), and kernelshap, which spends them all, was ahead on every measure (reader, K=32, all ten
# conversations, 496 FI-LoCoMo cases, `correct`, paired: recovery +6.7 pp [+3.7, +10.2], Recall@|M| +9.9
# [+5.7, +13.7], exact-set match +1.0 [-1.4, +3.5]; docs/benchmark.md "K=32").
#
# Issue 30 item 2: below a quarter of the game (B < 2^K / 4, so always from K=13 on) `auto` takes `sparseshap`, the
# Shapley values of a sparse order-2 surrogate fitted to the anchors and paired coalitions drawn with each memory kept
# with probability 1/2 (pipeline.game.adjusted). Tuned on conv-26 and conv-30 (reader, B=64-256), then measured on all
# ten conversations against ContextCite (docs/method.md "A sparse surrogate's Shapley values"): at K=20 B=64 `correct`
# Recall@|M| 48.2% -> 73.4% on the tuned pair (ContextCite 79.9%), recovery 79.0% -> 95.2%; at K=10 B=64 82.5% ->
# 90.6% (ContextCite 92.5%). From a quarter of the table on kernelshap was level or ahead on Recall@|M| (K=10 B=256
# `correct`: 95.0% against 93.1%) and it is consistent (exact with the whole table), so it stays there.
AUTO_SAMPLED = {"probability": "kernelshap", "correct": "kernelshap"}
# In `probability` mode the surrogate needs more draws per memory. On the tuned pair: at K=20 B=64 (3.2 per memory)
# kernelshap ranked the faults better (Recall@|M| 93.5% against 86.3%, exact-set 56.5% against 61.3%), at K=32 B=64
# (2 per memory) too (surrogate minus kernelshap, Recall@|M| -3.7 pp, exact-set +14.5); at K=32 B=128 (4 per memory)
# the surrogate was ahead (+8.1 / +19.7 pp), at K=10 B=64 and K=20 B=128 (6.4) level on Recall@|M| and ahead on
# exact-set. Hence 4 evaluations per memory. `correct` mode has no such floor: kernelshap's border-heavy draws were the
# weak point there at every budget below a quarter of the game (K=32 B=64: Recall@|M| +16.1 pp for the surrogate).
AUTO_SURROGATE = "sparseshap"
SURROGATE_SHARE = 4  # `auto` takes AUTO_SURROGATE while budget * SURROGATE_SHARE < 2^K
SURROGATE_PER_PLAYER = {"probability": 4, "correct": 0}  # ... and budget >= this many evaluations per memory
FEW_SAMPLES_MAX_K = 20  # the largest K where the permutation mean was measured level or ahead with few samples


def few_samples(k: int, budget: int) -> bool:
    """Whether `budget` buys fewer than K coalitions beyond the K+2 anchors and the clearance's reserve of 2, at a K
    where that makes the permutation mean the better choice (K <= FEW_SAMPLES_MAX_K; see above)."""
    return k <= FEW_SAMPLES_MAX_K and budget < 2 * k + 4


ADAPTIVE_PRIOR = 0.0  # adaptive: variance pseudo-draws by default (pipeline.game.estimators.Adaptive)
# How an adaptive case stops. "separation": when every value is z standard errors from -tau (the paper's Appendix B;
# in `correct` mode a run of identical {0,1} draws gives SE 0 and is taken as certainty). "check": the rounds are a
# screen that ends at separation or after `check_after` permutations, and the case stops when the game restricted to
# the players whose marginals exceed tau explains every coalition evaluated (pipeline.game.restricted), which no
# run of zeros can fake. Measured per conversation on all ten (docs/method.md "The adaptive estimator").
ADAPTIVE_RULES = ("check", "separation")
ADAPTIVE_RULE = "check"
ADAPTIVE_CHECK_AFTER = 16


# Issue 30: at a few evaluations per memory the K leave-one-out anchors are most of what the estimator sees (K=20,
# B=64, `correct`: 22 of 56 coalitions), and they are a poor design for a sparse fit: in a {0, 1} game N minus one
# memory mostly gives the full context's answer, and redundant copies give LOO 0 each. `auto` then drops them:
# sparseshap draws every coalition from ContextCite's design (the empty set and N, then paired draws keeping each
# memory with probability 1/2), the `loo` column is null and the clearance checks the Shapley and surrogate chains
# without the (no longer free) single removals. Measured with the audit's rule on all ten conversations, reader,
# FI-LoCoMo, `correct` (`jobs/bench_split.py --loo on,off`; docs/method.md "Dropping the LOO screen at small
# budgets"), LOO anchors -> none, exact-set match / recovery / Recall@|M|: K=32 B=64 26.4/88.5/60.6 -> 32.9/89.9/74.9,
# B=128 43.3/99.4/88.5 -> 45.4/99.8/90.2; K=20 B=64 38.5/95.7/78.9 -> 45.7/96.1/86.5; from about 6 evaluations per
# memory level (K=20 B=128 51.8/99.6/93.4 -> 51.4/100/93.6, K=10 B=64 54.4/99.6/93.3 -> 55.0/99.6/93.7), and at K=10
# B=128 (12.8 per memory) behind (58.4/96.3 -> 57.3/95.2 exact-set / Recall@|M|). Hence below 8 per memory.
# `probability` keeps them: its clearance needs LOO's fallback candidates (K=10 B=64 recovery 99.2% -> 86.8%).
# `--estimator sparseshap` (named, not `auto`) always keeps the LOO screen.
LOO_SCREEN_PER_PLAYER = {"correct": 8, "probability": 0}  # `auto` measures LOO from this many evaluations per memory


def auto_measures_loo(k: int, budget: int, utility: str = "probability") -> bool:
    """Whether an `auto` case under `budget` evaluates the K leave-one-out coalitions (see LOO_SCREEN_PER_PLAYER)."""
    if not budget or auto_estimator(k, budget, utility) != AUTO_SURROGATE:
        return True
    return budget >= LOO_SCREEN_PER_PLAYER.get(utility, 0) * k


def auto_estimator(k: int, budget: int, utility: str = "probability") -> str:
    """`--estimator auto` under a budget: exact when all 2^K coalitions fit, else the sampled estimator measured best
    for this utility mode, K and budget (see AUTO_SAMPLED, AUTO_SURROGATE and `few_samples` above)."""
    if budget >= 1 << k and k <= MAX_EXACT_PLAYERS:
        return "exact"
    if utility == "correct" and few_samples(k, budget):
        return "permutation"
    if budget * SURROGATE_SHARE < 1 << k and budget >= SURROGATE_PER_PLAYER.get(utility, 0) * k:
        return AUTO_SURROGATE
    return AUTO_SAMPLED.get(utility, "kernelshap")


def make_plan(
    k: int,
    permutations: int = DEFAULT_PERMUTATIONS,
    estimator: str = "auto",
    antithetic: bool = False,
    seed: int = 0,
    round_size: int = ADAPTIVE_ROUND,
    budget: int = 0,
    prior: float = ADAPTIVE_PRIOR,
    utility: str = "probability",
    rule: str = ADAPTIVE_RULE,
) -> GamePlan:
    """Plan a case with K players. Permutations come from a local generator seeded by `seed` (per case).

    `budget` > 0: distinct agent evaluations per query, clearance checks included (pipeline.game.estimators); the
    estimator then spends at most `split_budget(budget, K)` and `permutations` is only the adaptive cap."""
    if not 1 <= k <= MAX_PLAYERS:
        raise ConfigError(f"game plan: K={k} players is out of range; allowed 1..{MAX_PLAYERS}")
    if permutations < 1:
        raise ConfigError(f"game plan: permutations={permutations}; must be >= 1")
    if antithetic and permutations % 2:
        raise ConfigError("game plan: antithetic sampling pairs permutations; "
                          f"permutations={permutations} must be even")
    if estimator not in ESTIMATORS:
        raise ConfigError(f"game plan: estimator={estimator!r}; allowed {ESTIMATORS}")
    loo = True
    if budget:
        check_budget(budget, k)
        if estimator == "auto":
            loo = auto_measures_loo(k, budget, utility)
            estimator = auto_estimator(k, budget, utility)
        if estimator == "exact" and budget < 1 << k and k <= MAX_EXACT_PLAYERS:
            raise ConfigError(f"game plan: estimator 'exact' at K={k} needs 2^{k} = {1 << k:,} evaluations; "
                              f"budget={budget:,} (use 'auto' or a sampled estimator, or raise the budget)")
    if estimator == "auto":
        estimator = "exact" if 2**k <= sampled_touch_bound(k, permutations) else "permutation"
    if estimator == "exact" and k > MAX_EXACT_PLAYERS:
        raise ConfigError(f"game plan: estimator 'exact' at K={k}: exact enumeration is capped at "
                          f"K={MAX_EXACT_PLAYERS} (2^K coalitions); use 'auto' or a sampled estimator with a budget")
    if estimator == "antithetic":
        antithetic = True
    if estimator == "adaptive":
        antithetic = True
        if round_size < 2 or round_size % 2 or permutations % 2:
            raise ConfigError(f"game plan: adaptive draws antithetic pairs; round_size={round_size} and "
                              f"permutations={permutations} must be even (round_size >= 2)")
    if rule not in ADAPTIVE_RULES:
        raise ConfigError(f"game plan: adaptive rule={rule!r}; allowed {ADAPTIVE_RULES}")
    extra = {"eval_budget": budget, "prior": prior, "utility": utility, "rule": rule, "loo": loo}
    if estimator == "exact":
        return GamePlan(k, estimator, permutations, antithetic, seed, np.zeros((0, k), dtype=np.int64),
                        np.arange(2**k, dtype=np.int64), **extra)
    if estimator not in ("permutation", "antithetic", "adaptive") or (budget and estimator != "adaptive"):
        # Drawn by the estimator itself (pipeline.game.estimators); the first pass starts with the anchors (the LOO
        # coalitions and the empty set, or only the empty set and N where the LOO screen is dropped).
        return GamePlan(k, estimator, permutations, antithetic, seed, np.zeros((0, k), dtype=np.int64),
                        anchor_coalitions(k, loo), **extra)
    rng = np.random.default_rng(seed)
    if antithetic:
        half = rng.permuted(np.tile(np.arange(k), (permutations // 2, 1)), axis=1)
        perms = np.empty((permutations, k), dtype=np.int64)
        perms[0::2], perms[1::2] = half, half[:, ::-1]  # each permutation followed by its reverse
    else:
        perms = rng.permuted(np.tile(np.arange(k), (permutations, 1)), axis=1).astype(np.int64)
    coalitions = np.union1d(prefix_masks(perms).ravel(), loo_coalitions(k))
    if estimator == "adaptive":
        first = min(round_size, permutations)
        coalitions = np.union1d(prefix_masks(perms[:first]).ravel(), loo_coalitions(k))
        return GamePlan(k, estimator, permutations, antithetic, seed, perms, coalitions, round_size, **extra)
    return GamePlan(k, estimator, permutations, antithetic, seed, perms, coalitions, **extra)
