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

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from pipeline.core.errors import MissingDependencyError
from pipeline.game.plan import MAX_PLAYERS, full_mask, loo_coalitions
from pipeline.game.surrogates import (  # noqa: F401  (the arithmetic lives in the game core; names kept for callers)
    CONTEXTCITE_ALPHA,
    DEFAULT_MASKS,
    LOGIT_CLIP,
    SurrogateError,
    contextcite_fit,
    fourier_basis,
    fourier_moebius,
    fourier_shapley,
    keep_indicators,
    logit,
    moebius_pair_interactions,
    proxyspex_fourier,
    random_masks,
    tree_fourier,
)

Oracle = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]



BaselineError = SurrogateError  # one error for the baselines and their arithmetic (pipeline.game.surrogates)


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

    def evaluated(self) -> tuple[np.ndarray, np.ndarray]:
        """(masks, utilities) of every coalition evaluated so far, in mask order."""
        masks = np.array(sorted(self._utility), dtype=np.int64)
        return masks, np.array([self._utility[int(m)] for m in masks], dtype=np.float64)

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


def loo(k: int, evaluate: Oracle) -> BaselineResult:
    """Leave-one-out: loo_i = v(N) - v(N minus i), K+1 evaluations."""
    oracle = CachedOracle(k, evaluate)
    util, _ = oracle(loo_coalitions(k))
    return BaselineResult("loo", util[0] - util[1:], oracle.evaluations)


def context_cite(
    k: int, evaluate: Oracle, masks: int = DEFAULT_MASKS, alpha: float = CONTEXTCITE_ALPHA, seed: int = 0
) -> BaselineResult:
    """ContextCite on `masks` random ablations; the fit is `pipeline.game.surrogates.contextcite_fit` (the
    estimator contract's "contextcite"). Lasso weights = attributions (negative = harmful), in logit units."""
    oracle = CachedOracle(k, evaluate)
    sample = random_masks(k, masks, np.random.default_rng(seed))
    util, _ = oracle(sample)
    weights, intercept = contextcite_fit(sample, util, k, alpha)
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


PROXYSPEX_BACKENDS = ("native", "shapiq")


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
    oracle = CachedOracle(k, evaluate)
    if backend == "shapiq":
        return _proxyspex_shapiq(k, oracle, masks, seed)

    sample = random_masks(k, masks, np.random.default_rng(seed))
    util, _ = oracle(sample)
    coeffs = proxyspex_fourier(sample, util, k, seed, max_depth, n_estimators, learning_rate, energy)
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
