"""Attribution baselines for FI-LoCoMo, on the same value oracle MeClear uses.

Each baseline gets a K-player case as a batched oracle `evaluate(masks) -> (utilities, correct)` over int64 coalition
bitmasks (bit i = context position i kept) and returns a BaselineResult: an attribution vector (K,), negative meaning
harmful, and the number of distinct coalitions it evaluated. Rankings and clearance then go through the same
`pipeline.game.clearance` code as MeClear, so methods differ only in their attributions.

- LOO: v(N) - v(N minus i).
- ContextCite (Cohen-Wang et al., 2024, "ContextCite: Attributing Model Generation to Context"): random ablations,
  sparse linear surrogate on standardised features, logit target, as in the released solver.
- ProxySPEX (Butler et al., 2025, "ProxySPEX: Inference-Efficient Interpretability via Sparse Feature Interactions in
  LLMs"): gradient-boosted-tree proxy, its exact Fourier transform, Shapley values of that transform.
- relevance_filter: the direct filter on retrieval relevance, which spends no agent calls on attribution.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from pipeline.errors import MeClearError, MissingDependencyError
from pipeline.game.plan import MAX_PLAYERS, full_mask, loo_coalitions

Oracle = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]

DEFAULT_MASKS = 64
# ContextCite's released solver fits sklearn's Lasso with alpha=0.01 on standardised ablation indicators.
CONTEXTCITE_ALPHA = 0.01


class BaselineError(MeClearError, ValueError):
    """A baseline got an invalid option or an oracle answer of the wrong shape."""

    exit_code = 2


@dataclass(frozen=True)
class BaselineResult:
    """What a baseline found for one case: plain data, no behaviour."""

    name: str
    attribution: np.ndarray  # (K,) float64, negative = harmful
    evaluations: int  # distinct coalitions evaluated
    extras: dict[str, object] = field(default_factory=dict)  # diagnostics of the estimator (masks, fits), not read


@dataclass(frozen=True)
class FilterResult(BaselineResult):
    """A filter's result: besides its attribution, what it removed and whether that recovered the answer."""

    cleared: tuple[int, ...] = ()  # positions removed, in the order the filter ranks them
    recovered: bool = False
    cleared_utility: float = float("nan")


class CachedOracle:
    """Evaluates each distinct coalition once and remembers it: a baseline's spend is its number of distinct masks."""

    def __init__(self, k: int, evaluate: Oracle):
        if not 1 <= k <= MAX_PLAYERS:
            raise BaselineError(f"K={k} players is out of range; allowed 1..{MAX_PLAYERS}")
        self.k = k
        self._evaluate = evaluate
        self._utility: dict[int, float] = {}
        self._correct: dict[int, bool] = {}

    @property
    def evaluations(self) -> int:
        return len(self._utility)

    def seen(self, masks: np.ndarray) -> np.ndarray:
        """Per mask: already evaluated (free to ask again)."""
        return np.array([int(m) in self._utility for m in np.asarray(masks).ravel()], dtype=bool)

    def __call__(self, masks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        masks = np.asarray(masks, dtype=np.int64)
        if masks.size and (masks.min() < 0 or masks.max() > full_mask(self.k)):
            raise BaselineError(
                f"masks must lie in 0..{full_mask(self.k)} for K={self.k}; got {masks.min()}..{masks.max()}"
            )
        new = np.array(sorted({int(m) for m in masks.ravel()} - self._utility.keys()), dtype=np.int64)
        if new.size:
            util, ok = self._evaluate(new)
            util, ok = np.asarray(util, dtype=np.float64), np.asarray(ok, dtype=bool)
            if util.shape != new.shape or ok.shape != new.shape:
                raise BaselineError(
                    f"oracle answered shapes {util.shape} and {ok.shape} for {new.size} masks; "
                    f"expected ({new.size},) each"
                )
            for m, u, c in zip(new.tolist(), util.tolist(), ok.tolist(), strict=True):
                self._utility[m], self._correct[m] = u, c
        flat = masks.ravel().tolist()
        util = np.array([self._utility[m] for m in flat], dtype=np.float64).reshape(masks.shape)
        ok = np.array([self._correct[m] for m in flat], dtype=bool).reshape(masks.shape)
        return util, ok


def random_masks(k: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """n coalitions, each memory kept independently with probability 1/2 (uniform over all 2^K coalitions)."""
    if n < 1:
        raise BaselineError(f"number of random masks n={n}; must be >= 1")
    return rng.integers(0, 1 << k, size=n, dtype=np.int64)


def keep_indicators(masks: np.ndarray, k: int) -> np.ndarray:
    """(n, K) float64 matrix, column i = 1 where memory i is kept."""
    return ((np.asarray(masks, dtype=np.int64)[:, None] >> np.arange(k)) & 1).astype(np.float64)


def loo(k: int, evaluate: Oracle) -> BaselineResult:
    """Leave-one-out: loo_i = v(N) - v(N minus i), K+1 evaluations."""
    oracle = CachedOracle(k, evaluate)
    util, _ = oracle(loo_coalitions(k))
    return BaselineResult("loo", util[0] - util[1:], oracle.evaluations)


LOGIT_CLIP = 1e-6  # probabilities are clipped to [1e-6, 1 - 1e-6] before the logit, so 0 and 1 stay finite (+-13.8)


def logit(p: np.ndarray, clip: float = LOGIT_CLIP) -> np.ndarray:
    p = np.clip(np.asarray(p, dtype=np.float64), clip, 1.0 - clip)
    return np.log(p) - np.log1p(-p)


def context_cite(
    k: int, evaluate: Oracle, masks: int = DEFAULT_MASKS, alpha: float = CONTEXTCITE_ALPHA, seed: int = 0
) -> BaselineResult:
    """ContextCite (Cohen-Wang et al., 2024) as released (MadryLab/context-cite, `solver.LassoRegression`): `masks`
    random ablations (each memory kept with probability 1/2, the released default), mask features standardised
    (StandardScaler), Lasso with alpha 0.01 and an intercept on the standardised features, weights rescaled back to
    the 0/1 mask scale (coef / scale); the target is the logit of the probability.

    Remaining differences, stated: (1) the probability is P(gold option) under the oracle's utility mode, where the
    release uses the probability of the model's own generated response (our utility is about the gold answer, the
    same quantity every other method sees); the released per-token averaging is moot for one option. (2) In `correct`
    mode the utility is the 0/1 outcome; its clipped logit is +-13.8, an affine rescaling of the outcome (the Lasso
    penalty then bites 27.6 times less than on the 0/1 scale). (3) Duplicated ablations are evaluated once but stay
    regression rows, as in the release. (4) Our own code; no dependency on their package.
    Lasso weights = attributions (negative = harmful), in logit units.
    """
    from sklearn.linear_model import Lasso  # lazy: scikit-learn is in the `eval` extra only

    if alpha < 0:
        raise BaselineError(f"ContextCite Lasso alpha={alpha}; must be >= 0")
    oracle = CachedOracle(k, evaluate)
    sample = random_masks(k, masks, np.random.default_rng(seed))
    util, _ = oracle(sample)
    y = logit(util)
    x = keep_indicators(sample, k)
    mean, scale = x.mean(axis=0), x.std(axis=0)
    scale = np.where(scale == 0.0, 1.0, scale)  # a memory kept (or dropped) in every draw: StandardScaler's rule
    if np.ptp(y) == 0.0:  # a constant surrogate: every weight is zero (Lasso would warn and say the same)
        weights, intercept = np.zeros(k), float(y[0])
    else:
        model = Lasso(alpha=alpha, fit_intercept=True, random_state=0, max_iter=10_000, tol=1e-6)
        model.fit((x - mean) / scale, y)
        weights = model.coef_.astype(np.float64) / scale
        intercept = float(model.intercept_) - float((mean / scale) @ model.coef_)
    return BaselineResult(
        "contextcite", weights, oracle.evaluations,
        {"intercept": intercept, "masks": masks, "alpha": alpha, "target": "logit"},
    )


def relevance_filter(
    relevance: np.ndarray, threshold: float, evaluate: Oracle
) -> FilterResult:
    """The direct filter: drop every memory whose retrieval relevance is below `threshold`, in one step.

    Attribution is relevance - threshold, so the harmful set {attribution < 0} is exactly the dropped set and
    `harmful_ranking(attribution, tau=0)` lists it by ascending relevance. No attribution calls are spent; the one
    evaluation is the final check of the filtered context (`cleared`, `recovered`, `cleared_utility`). Unlike
    MeClear's nested search, the filter does not try smaller removals: it keeps whatever the threshold gives.
    """
    rel = np.asarray(relevance, dtype=np.float64)
    if rel.ndim != 1 or rel.size == 0 or np.isnan(rel).any():
        raise BaselineError(f"relevance must be a non-empty 1-D array of numbers; got {rel!r}")
    k = rel.size
    oracle = CachedOracle(k, evaluate)
    attribution = rel - threshold
    order = np.lexsort((np.arange(k), rel))  # ascending relevance, ties by position
    cleared = tuple(int(i) for i in order if attribution[i] < 0)
    kept = full_mask(k) & ~sum(1 << i for i in cleared)
    util, ok = oracle(np.array([kept], dtype=np.int64))
    return FilterResult(
        "relevance_filter",
        attribution,
        oracle.evaluations,
        {"threshold": threshold},
        cleared=cleared,
        recovered=bool(ok[0]),
        cleared_utility=float(util[0]),
    )


# --- ProxySPEX -------------------------------------------------------------------------------------------------------
#
# Fourier (Walsh) basis on x in {0,1}^K: chi_T(x) = prod_{j in T} (-1)^{x_j}, sets T as bitmasks. A function is
# f(x) = sum_T F[T] chi_T(x). Its Shapley value follows from symmetry, null players and efficiency applied to each basis
# game: chi_T treats the members of T alike, ignores everyone else, and moves from chi_T(empty) = 1 to
# chi_T(N) = (-1)^|T|, so each member of T gets ((-1)^|T| - 1) / |T|: -2/|T| for odd |T|, nothing for even |T|.
# Pairwise interactions go through the Moebius form instead: chi_T = prod_{j in T} (1 - 2 x_j) expands to
# sum_{U subset of T} (-2)^|U| prod_{j in U} x_j, so m(U) = (-2)^|U| sum_{T superset of U} F[T], and the Shapley
# interaction index of a pair is sum_{U superset of pair} m(U) / (|U| - 1) (Grabisch, 1997).

PROXYSPEX_BACKENDS = ("native", "shapiq")


def _popcount(x: int) -> int:
    return int(x).bit_count()


def tree_fourier(tree: object) -> dict[int, float]:
    """Exact Fourier coefficients of one fitted sklearn regression tree over binary features.

    A split on j sends x_j = 0 left (threshold 0.5) and x_j = 1 right; with 1[x_j = 0] = (1 + chi_j) / 2 the node is
    (L + R) / 2 + chi_j (L - R) / 2. Multiplying by chi_j is a symmetric difference of sets (chi_j^2 = 1), which stays
    exact even if a path split on the same feature twice.
    """
    t = tree.tree_  # type: ignore[attr-defined]
    left, right, feature, threshold = t.children_left, t.children_right, t.feature, t.threshold
    value = t.value[:, 0, 0]

    def walk(node: int) -> dict[int, float]:
        if left[node] == -1:
            return {0: float(value[node])}
        if not 0.0 < threshold[node] < 1.0:
            raise BaselineError(
                f"tree split at {threshold[node]} on feature {feature[node]}; binary features split at 0.5"
            )
        lo, hi, bit = walk(left[node]), walk(right[node]), 1 << int(feature[node])
        out: dict[int, float] = defaultdict(float)
        for key in lo.keys() | hi.keys():
            a, b = lo.get(key, 0.0), hi.get(key, 0.0)
            out[key] += (a + b) / 2.0
            out[key ^ bit] += (a - b) / 2.0
        return out

    return dict(walk(0))


def fourier_basis(masks: np.ndarray, support: np.ndarray) -> np.ndarray:
    """(n, |support|) matrix of chi_T(x) for coalitions `masks` and frequency sets `support` (both bitmasks)."""
    overlap = np.asarray(masks, dtype=np.int64)[:, None] & np.asarray(support, dtype=np.int64)[None, :]
    parity = np.zeros(overlap.shape, dtype=np.int64)
    for b in range(MAX_PLAYERS):
        parity ^= (overlap >> b) & 1
    return 1.0 - 2.0 * parity


def fourier_shapley(coeffs: dict[int, float], k: int) -> np.ndarray:
    """Shapley values of f = sum_T F[T] chi_T: each member of T gets F[T] ((-1)^|T| - 1) / |T|."""
    phi = np.zeros(k)
    for t, f in coeffs.items():
        size = _popcount(t)
        if size % 2:
            for j in range(k):
                if t >> j & 1:
                    phi[j] += -2.0 * f / size
    return phi


def fourier_moebius(coeffs: dict[int, float]) -> dict[int, float]:
    """Moebius coefficients m(U) = (-2)^|U| sum_{T superset of U} F[T] of a sparse Fourier function."""
    out: dict[int, float] = defaultdict(float)
    for t, f in coeffs.items():
        sub = t
        while True:  # every subset U of T, by the standard submask walk
            out[sub] += (-2.0) ** _popcount(sub) * f
            if sub == 0:
                break
            sub = (sub - 1) & t
    return dict(out)


def moebius_pair_interactions(moebius: dict[int, float], k: int) -> np.ndarray:
    """(K, K) pairwise Shapley interaction index from Moebius coefficients (diagonal 0)."""
    out = np.zeros((k, k))
    for u, m in moebius.items():
        size = _popcount(u)
        if size < 2:
            continue
        members = [j for j in range(k) if u >> j & 1]
        for a in range(size):
            for b in range(a + 1, size):
                out[members[a], members[b]] += m / (size - 1)
                out[members[b], members[a]] += m / (size - 1)
    return out


def _energy_support(coeffs: dict[int, float], energy: float) -> np.ndarray:
    """The constant term plus the fewest non-constant coefficients holding `energy` of their squared mass."""
    keys = np.array([t for t in coeffs if t != 0], dtype=np.int64)
    if keys.size == 0:
        return np.array([0], dtype=np.int64)
    sq = np.array([coeffs[int(t)] ** 2 for t in keys])
    order = np.argsort(-sq, kind="stable")
    total = sq.sum()
    if total == 0.0:
        return np.array([0], dtype=np.int64)
    n_keep = int(np.searchsorted(np.cumsum(sq[order]) / total, energy - 1e-12)) + 1
    return np.concatenate([[0], keys[order[: min(n_keep, keys.size)]]]).astype(np.int64)


def proxyspex(
    k: int,
    evaluate: Oracle,
    masks: int = DEFAULT_MASKS,
    seed: int = 0,
    max_depth: int = 3,
    n_estimators: int = 200,
    learning_rate: float = 0.1,
    energy: float = 1.0,
    backend: str = "native",
) -> BaselineResult:
    """ProxySPEX (Butler et al., 2025): Shapley values of a sparse Fourier proxy learned from random ablations.

    native (default) follows the published algorithm: `masks` uniform random coalitions; a gradient-boosted tree proxy
    (sklearn GradientBoostingRegressor, fixed depth/rounds instead of the paper's 5-fold grid search: with K=5 there
    are only 32 coalitions, too few rows for a meaningful CV); the proxy's exact Fourier transform, tree by tree; with
    energy < 1, the fewest coefficients holding `energy` of the non-constant mass, their values refit by ridge
    regression on the samples (RidgeCV, as the reference does); Shapley values of that Fourier function, exactly.
    Extras carry the pairwise Shapley interaction index of the proxy and its Fourier coefficients.

    energy defaults to 1.0: keep every coefficient the trees produced, unrefit. The reference code truncates at 0.95,
    which at K=5 drops weak but real first-order terms (a memory worth 0.1 in an otherwise 0.4-scale game gets exactly
    0); refitting the full support instead interpolates ~25 distinct samples with ~25 coefficients and invents
    interactions. energy=0.95 reproduces the reference. The default keeps the baseline as strong as its proxy allows.

    shapiq wraps shapiq 1.4.1's ProxySPEX (index "SV", max_order 1; first-order values are the attributions). It needs
    lightgbm, and at K=5 its energy truncation fails (it samples at most 2^K distinct coalitions and then indexes past
    its coefficient list); kept for cross-checks at larger K.
    """
    if backend not in PROXYSPEX_BACKENDS:
        raise BaselineError(f"ProxySPEX backend={backend!r}; allowed {PROXYSPEX_BACKENDS}")
    if not 0.0 < energy <= 1.0:
        raise BaselineError(f"ProxySPEX energy={energy}; must be in (0, 1]")
    if max_depth < 1 or n_estimators < 1 or learning_rate <= 0:
        raise BaselineError(
            f"ProxySPEX trees: max_depth={max_depth}, n_estimators={n_estimators}, learning_rate={learning_rate}; "
            "need max_depth >= 1, n_estimators >= 1, learning_rate > 0"
        )
    oracle = CachedOracle(k, evaluate)
    if backend == "shapiq":
        return _proxyspex_shapiq(k, oracle, masks, seed)

    from sklearn.ensemble import GradientBoostingRegressor  # lazy: scikit-learn is in the `eval` extra only
    from sklearn.linear_model import RidgeCV

    sample = random_masks(k, masks, np.random.default_rng(seed))
    util, _ = oracle(sample)
    if np.ptp(util) == 0.0:  # a constant game: no tree can split, every Shapley value is zero
        coeffs = {0: float(util[0])}
    else:
        gbr = GradientBoostingRegressor(
            n_estimators=n_estimators, max_depth=max_depth, learning_rate=learning_rate, random_state=seed
        ).fit(keep_indicators(sample, k), util)
        raw: dict[int, float] = defaultdict(float)
        for est in gbr.estimators_[:, 0]:
            for t, f in tree_fourier(est).items():
                raw[t] += learning_rate * f
        # The boosting's initial constant, read off the proxy itself rather than from sklearn internals.
        x0 = keep_indicators(sample[:1], k)
        keys, vals = np.array(list(raw), dtype=np.int64), np.array(list(raw.values()))
        raw[0] += float(gbr.predict(x0)[0]) - float(fourier_basis(sample[:1], keys)[0] @ vals)
        if energy >= 1.0:
            coeffs = dict(raw)  # the proxy's own transform; a ridge refit on the full support only overfits the samples
        else:
            support = _energy_support(raw, energy)
            basis = fourier_basis(sample, support)
            ridge = RidgeCV(alphas=np.logspace(-6, 6, 100), fit_intercept=False).fit(basis, util)
            coeffs = {int(t): float(c) for t, c in zip(support, ridge.coef_, strict=True)}
    phi = fourier_shapley(coeffs, k)
    return BaselineResult(
        "proxyspex",
        phi,
        oracle.evaluations,
        {
            "interactions": moebius_pair_interactions(fourier_moebius(coeffs), k),
            "fourier": coeffs,
            "masks": masks,
            "backend": backend,
        },
    )


def _proxyspex_shapiq(k: int, oracle: CachedOracle, masks: int, seed: int) -> BaselineResult:
    try:
        import lightgbm  # noqa: F401  (shapiq's ProxySPEX imports it itself; fail here with our hint)
        from shapiq.approximator.sparse import ProxySPEX
    except ImportError as err:
        raise MissingDependencyError(
            f"ProxySPEX backend='shapiq' needs shapiq==1.4.1 and lightgbm ({err}); install them with "
            "`pip install shapiq==1.4.1 lightgbm`, or use backend='native'"
        ) from err
    weights = np.left_shift(np.int64(1), np.arange(k, dtype=np.int64))

    def game(coalitions: np.ndarray) -> np.ndarray:
        return oracle(np.asarray(coalitions, dtype=np.int64) @ weights)[0]

    try:
        iv = ProxySPEX(n=k, index="SV", max_order=1, random_state=seed).approximate(masks, game)
    except IndexError as err:
        raise BaselineError(
            f"shapiq ProxySPEX failed at K={k}, budget {masks} ({err}): its energy truncation indexes past a short "
            "coefficient list, as it does at small K; use backend='native'"
        ) from err
    phi = np.array([float(iv[(i,)]) for i in range(k)])
    return BaselineResult("proxyspex", phi, oracle.evaluations, {"masks": masks, "backend": "shapiq"})
