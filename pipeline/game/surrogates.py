"""The surrogate baselines behind the estimator contract (issue 16): ContextCite's Lasso and ProxySPEX's Fourier proxy.

Both fit a model to `budget` uniformly random coalitions (each memory kept with probability 1/2) and read an
attribution off it; neither asks the K+2 anchors (`anchors = False`), so a caller that needs LOO evaluates it itself
(pipeline.audit.reduce). Their arithmetic lives here, in the game core; `pipeline.bench.baselines` keeps only the
benchmark's adapters (oracles, result records). scikit-learn is imported lazily (the `eval` extra).

- ContextCite (Cohen-Wang et al., 2024, "ContextCite: Attributing Model Generation to Context"): random ablations,
  sparse linear surrogate on standardised features, logit target, as in the released solver. Its weights are scores
  in logit units, not Shapley values (SE: NaN).
- ProxySPEX (Butler et al., 2025, "ProxySPEX: Inference-Efficient Interpretability via Sparse Feature Interactions in
  LLMs"): gradient-boosted-tree proxy, its exact Fourier transform, Shapley values of that transform.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from pipeline.core.errors import ConfigError, MeClearError
from pipeline.game.estimators import Steps, _Base, _Run, register
from pipeline.game.plan import MAX_PLAYERS

DEFAULT_MASKS = 64
# ContextCite's released solver fits sklearn's Lasso with alpha=0.01 on standardised ablation indicators.
CONTEXTCITE_ALPHA = 0.01


class SurrogateError(MeClearError, ValueError):
    """A surrogate got an invalid option or a model it cannot read."""

    exit_code = 2


def random_masks(k: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """n coalitions, each memory kept independently with probability 1/2 (uniform over all 2^K coalitions)."""
    if n < 1:
        raise SurrogateError(f"number of random masks n={n}; must be >= 1")
    # endpoint=True: at K=63 the exclusive bound 2^63 is not an int64
    return rng.integers(0, (1 << k) - 1, size=n, dtype=np.int64, endpoint=True)


def keep_indicators(masks: np.ndarray, k: int) -> np.ndarray:
    """(n, K) float64 matrix, column i = 1 where memory i is kept."""
    return ((np.asarray(masks, dtype=np.int64)[:, None] >> np.arange(k)) & 1).astype(np.float64)


LOGIT_CLIP = 1e-6  # probabilities are clipped to [1e-6, 1 - 1e-6] before the logit, so 0 and 1 stay finite (+-13.8)


def logit(p: np.ndarray, clip: float = LOGIT_CLIP) -> np.ndarray:
    p = np.clip(np.asarray(p, dtype=np.float64), clip, 1.0 - clip)
    return np.log(p) - np.log1p(-p)


def contextcite_fit(sample: np.ndarray, util: np.ndarray, k: int, alpha: float = CONTEXTCITE_ALPHA
                    ) -> tuple[np.ndarray, float]:
    """ContextCite (Cohen-Wang et al., 2024) as released (MadryLab/context-cite, `solver.LassoRegression`) on the
    ablations `sample` and their utilities: mask features standardised (StandardScaler), Lasso with alpha 0.01 and an
    intercept on the standardised features, weights rescaled back to the 0/1 mask scale (coef / scale); the target
    is the logit of the probability. Returns (weights, intercept); weights are attributions, negative = harmful.

    Differences from the release, stated: (1) the probability is P(gold option) under the utility mode, where the
    release uses the probability of the model's own generated response; (2) in `correct` mode the utility is the 0/1
    outcome, whose clipped logit is +-13.8, an affine rescaling of the outcome; (3) duplicated ablations are
    evaluated once but stay regression rows, as in the release; (4) our own code, no dependency on their package."""
    from sklearn.linear_model import (
        Lasso,  # lazy: scikit-learn is in the `eval` extra only
    )

    if alpha < 0:
        raise SurrogateError(f"ContextCite Lasso alpha={alpha}; must be >= 0")
    y = logit(util)
    x = keep_indicators(sample, k)
    mean, scale = x.mean(axis=0), x.std(axis=0)
    scale = np.where(scale == 0.0, 1.0, scale)  # a memory kept (or dropped) in every draw: StandardScaler's rule
    if np.ptp(y) == 0.0:  # a constant surrogate: every weight is zero (Lasso would warn and say the same)
        return np.zeros(k), float(y[0])
    model = Lasso(alpha=alpha, fit_intercept=True, random_state=0, max_iter=10_000, tol=1e-6)
    model.fit((x - mean) / scale, y)
    weights = model.coef_.astype(np.float64) / scale
    return weights, float(model.intercept_) - float((mean / scale) @ model.coef_)


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
            raise SurrogateError(
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
    return 1.0 - 2.0 * (np.bitwise_count(overlap) & 1)


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



def proxyspex_fourier(sample: np.ndarray, util: np.ndarray, k: int, seed: int = 0, max_depth: int = 3,
                      n_estimators: int = 200, learning_rate: float = 0.1, energy: float = 1.0) -> dict[int, float]:
    """ProxySPEX (Butler et al., 2025), native: a gradient-boosted tree proxy fitted to the ablations `sample`
    (sklearn GradientBoostingRegressor, fixed depth/rounds instead of the paper's 5-fold grid search: at small K
    there are too few rows for a meaningful CV); the proxy's exact Fourier transform, tree by tree; with energy < 1,
    the fewest coefficients holding `energy` of the non-constant mass, refit by ridge regression on the samples
    (RidgeCV, as the reference does). Returns the Fourier coefficients; `fourier_shapley` gives the attributions.

    energy defaults to 1.0: keep every coefficient the trees produced, unrefit. The reference code truncates at 0.95,
    which at K=5 drops weak but real first-order terms; energy=0.95 reproduces the reference."""
    if not 0.0 < energy <= 1.0:
        raise SurrogateError(f"ProxySPEX energy={energy}; must be in (0, 1]")
    if max_depth < 1 or n_estimators < 1 or learning_rate <= 0:
        raise SurrogateError(
            f"ProxySPEX trees: max_depth={max_depth}, n_estimators={n_estimators}, learning_rate={learning_rate}; "
            "need max_depth >= 1, n_estimators >= 1, learning_rate > 0"
        )
    if np.ptp(util) == 0.0:  # a constant game: no tree can split, every Shapley value is zero
        return {0: float(util[0])}
    from sklearn.ensemble import (
        GradientBoostingRegressor,  # lazy: scikit-learn is in the `eval` extra only
    )
    from sklearn.linear_model import RidgeCV

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
        return dict(raw)  # the proxy's own transform; a ridge refit on the full support only overfits the samples
    support = _energy_support(raw, energy)
    basis = fourier_basis(sample, support)
    ridge = RidgeCV(alphas=np.logspace(-6, 6, 100), fit_intercept=False).fit(basis, util)
    return {int(t): float(c) for t, c in zip(support, ridge.coef_, strict=True)}


# --- the contract ----------------------------------------------------------------------------------------------------
class _Surrogate(_Base):
    """`budget` uniformly random masks (duplicates evaluated once: distinct coalitions <= budget), one fit."""

    anchors = False

    def __init__(self, seed: int | None = None):
        self.seed = seed  # ProxySPEX: the trees' random_state (the masks come from the rng given to start)

    def start(self, k: int, budget: int, rng: np.random.Generator) -> _Run:
        if not 1 <= k <= MAX_PLAYERS:
            raise ConfigError(f"{self.name}: K={k} players is out of range; allowed 1..{MAX_PLAYERS}")
        if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)) or budget < 1:
            raise ConfigError(f"{self.name} budget={budget!r}: must be an integer >= 1 (random masks)")
        return _Run(k, int(budget), lambda run: self._steps(run, rng))

    def _steps(self, run: _Run, rng: np.random.Generator) -> Steps:
        sample = random_masks(run.k, run.budget, rng)
        yield sample
        values = self.fit(sample, run.values[sample], run.k)
        return run.attribution(values, np.full(run.k, np.nan), "fit", self.name)

    def fit(self, sample: np.ndarray, util: np.ndarray, k: int) -> np.ndarray:
        raise NotImplementedError


class ContextCite(_Surrogate):
    name = "contextcite"

    def __init__(self, alpha: float = CONTEXTCITE_ALPHA, seed: int | None = None):
        super().__init__(seed)
        self.alpha = alpha

    def fit(self, sample: np.ndarray, util: np.ndarray, k: int) -> np.ndarray:
        return contextcite_fit(sample, util, k, self.alpha)[0]


class ProxySPEX(_Surrogate):
    name = "proxyspex"

    def __init__(self, max_depth: int = 3, n_estimators: int = 200, learning_rate: float = 0.1, energy: float = 1.0,
                 seed: int | None = None):
        super().__init__(seed)
        self.trees = {"max_depth": max_depth, "n_estimators": n_estimators, "learning_rate": learning_rate,
                      "energy": energy}

    def fit(self, sample: np.ndarray, util: np.ndarray, k: int) -> np.ndarray:
        return fourier_shapley(proxyspex_fourier(sample, util, k, seed=self.seed or 0, **self.trees), k)


register("contextcite", ContextCite)
register("proxyspex", ProxySPEX)
