"""Attribution baselines on games with closed-form answers; budgets checked with a counting oracle."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from pipeline.bench.baselines import (
    BaselineError,
    context_cite,
    fourier_basis,
    fourier_moebius,
    fourier_shapley,
    keep_indicators,
    loo,
    moebius_pair_interactions,
    proxyspex,
    relevance_filter,
    tree_fourier,
)
from pipeline.game.attribution import interactions_exact, shapley_exact
from pipeline.game.clearance import harmful_ranking


class CountingOracle:
    """A game as a batched oracle that records every mask it was asked for."""

    def __init__(self, k: int, value, correct=None):
        self.k, self.value, self.correct = k, value, correct
        self.asked: list[int] = []

    def __call__(self, masks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        masks = np.asarray(masks, dtype=np.int64)
        self.asked.extend(masks.tolist())
        x = keep_indicators(masks, self.k)
        util = self.value(x)
        ok = self.correct(x) if self.correct is not None else util > 0.5
        return util, ok

    def table(self) -> np.ndarray:
        return self.value(keep_indicators(np.arange(1 << self.k), self.k))


def test_loo_on_closed_form_game():
    # v(S) = 1 - 0.6 [0 in S] - 0.6 [1 in S or 2 in S] + 0.3 [3 in S]: LOO sees 0 harmful, is blind to the redundant
    # pair 1, 2 (removing one leaves the other), sees 3 helpful, 4 null.
    k = 5
    oracle = CountingOracle(k, lambda x: 1 - 0.6 * x[:, 0] - 0.6 * np.maximum(x[:, 1], x[:, 2]) + 0.3 * x[:, 3])
    res = loo(k, oracle)
    np.testing.assert_allclose(res.attribution, [-0.6, 0.0, 0.0, 0.3, 0.0], atol=1e-12)
    assert res.evaluations == k + 1 == len(oracle.asked) == len(set(oracle.asked))


def sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-z))


def test_contextcite_recovers_additive_logit_weights():
    # Definition changed deliberately (issue 7): ContextCite now regresses the logit of the probability, as released,
    # so the additive game is additive in logit space.
    k = 6
    w = np.array([0.4, -0.5, 0.0, 0.2, -0.3, 0.1])
    oracle = CountingOracle(k, lambda x: sigmoid(0.2 + x @ w))
    tight = context_cite(k, oracle, masks=64, alpha=1e-5, seed=0)
    np.testing.assert_allclose(tight.attribution, w, atol=1e-3)
    assert tight.extras["intercept"] == pytest.approx(0.2, abs=1e-3)
    # the default alpha 0.01 acts on standardised features (sd about 1/2): each weight shrinks by about 0.02
    default = context_cite(k, CountingOracle(k, lambda x: sigmoid(0.2 + x @ w)), seed=0)
    np.testing.assert_allclose(default.attribution, w, atol=0.05)
    assert np.all(np.abs(default.attribution) <= np.abs(w) + 1e-9)


def test_contextcite_matches_the_released_solver():
    # The released LassoRegression.fit: make_pipeline(StandardScaler(), Lasso(alpha, random_state=0)) on the masks,
    # weights = coef / scale; here fed the logit of the same clipped probabilities.
    from sklearn.linear_model import Lasso
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    from pipeline.bench.baselines import logit, random_masks

    k = 5
    value = lambda x: np.clip(0.9 - 0.7 * x[:, 1] * x[:, 3] + 0.05 * x[:, 0], 0.0, 1.0)  # noqa: E731 (hits 0 and 1)
    res = context_cite(k, CountingOracle(k, value), masks=64, seed=7)
    sample = random_masks(k, 64, np.random.default_rng(7))
    x = keep_indicators(sample, k)
    scaler, lasso = StandardScaler(), Lasso(alpha=0.01, random_state=0, max_iter=10_000, tol=1e-6)
    make_pipeline(scaler, lasso).fit(x.astype(np.float32), logit(value(x)))
    np.testing.assert_allclose(res.attribution, lasso.coef_ / scaler.scale_, atol=1e-4)
    assert np.isfinite(res.attribution).all()


def test_contextcite_counts_distinct_coalitions_and_is_seeded():
    k = 5
    oracle = CountingOracle(k, lambda x: x.sum(axis=1) / k)
    res = context_cite(k, oracle, masks=64, seed=3)
    assert res.evaluations == len(oracle.asked) == len(set(oracle.asked)) <= 2**k
    again = context_cite(k, CountingOracle(k, lambda x: x.sum(axis=1) / k), masks=64, seed=3)
    np.testing.assert_array_equal(res.attribution, again.attribution)
    small = CountingOracle(k, lambda x: x.sum(axis=1) / k)
    assert context_cite(k, small, masks=8, seed=3).evaluations == len(set(small.asked)) <= 8


def pair_game(x: np.ndarray) -> np.ndarray:
    """Additive plus one pairwise interaction: Shapley phi_i = w_i, and phi_0, phi_1 each gain c / 2."""
    w = np.array([0.3, -0.2, 0.1, -0.4, 0.05])
    return 0.5 + x @ w - 0.6 * x[:, 0] * x[:, 1]


def test_proxyspex_recovers_shapley_of_pairwise_game():
    k = 5
    oracle = CountingOracle(k, pair_game)
    exact = shapley_exact(oracle.table())
    np.testing.assert_allclose(exact, [0.0, -0.5, 0.1, -0.4, 0.05], atol=1e-12)  # closed form
    for seed in range(3):
        res = proxyspex(k, CountingOracle(k, pair_game), masks=64, seed=seed)
        np.testing.assert_allclose(res.attribution, exact, atol=0.06)
        inter = res.extras["interactions"]
        assert inter[0, 1] == pytest.approx(-0.6, abs=0.1)
        assert np.abs(inter[np.triu_indices(k, 1)][1:]).max() < 0.1


def test_proxyspex_budget_and_determinism():
    k = 8
    oracle = CountingOracle(k, pair_game_k8)
    res = proxyspex(k, oracle, masks=40, seed=1)
    assert res.evaluations == len(oracle.asked) == len(set(oracle.asked)) <= 40
    again = proxyspex(k, CountingOracle(k, pair_game_k8), masks=40, seed=1)
    np.testing.assert_array_equal(res.attribution, again.attribution)


def pair_game_k8(x: np.ndarray) -> np.ndarray:
    return x[:, :5] @ np.array([0.3, -0.2, 0.1, -0.4, 0.05]) - 0.6 * x[:, 0] * x[:, 1] + 0.1 * x[:, 7]


def test_proxyspex_constant_game_is_all_zero():
    res = proxyspex(4, CountingOracle(4, lambda x: np.full(len(x), 0.7)), masks=16, seed=0)
    np.testing.assert_array_equal(res.attribution, np.zeros(4))


def test_fourier_shapley_matches_exact_on_any_game():
    # The closed form ((-1)^|T| - 1) / |T| per member, and the Moebius route to interactions, against enumeration.
    k = 4
    rng = np.random.default_rng(0)
    values = rng.normal(size=1 << k)
    masks = np.arange(1 << k, dtype=np.int64)
    basis = fourier_basis(masks, masks)
    coeffs = dict(enumerate(np.linalg.solve(basis, values)))  # the exact Walsh transform of the table
    np.testing.assert_allclose(fourier_shapley(coeffs, k), shapley_exact(values), atol=1e-10)
    np.testing.assert_allclose(
        moebius_pair_interactions(fourier_moebius(coeffs), k), interactions_exact(values), atol=1e-10
    )


def test_tree_fourier_reproduces_the_tree():
    from sklearn.tree import DecisionTreeRegressor

    k = 5
    x = keep_indicators(np.arange(1 << k), k)
    y = pair_game(x) + 0.3 * x[:, 2] * x[:, 3] * x[:, 4]
    tree = DecisionTreeRegressor(max_depth=4, random_state=0).fit(x, y)
    coeffs = tree_fourier(tree)
    support = np.array(list(coeffs), dtype=np.int64)
    rebuilt = fourier_basis(np.arange(1 << k), support) @ np.array(list(coeffs.values()))
    np.testing.assert_allclose(rebuilt, tree.predict(x), atol=1e-12)


def test_relevance_filter_drops_below_threshold_with_one_check():
    k = 5
    relevance = np.array([0.9, 0.2, 0.5, 0.1, 0.7])
    oracle = CountingOracle(k, lambda x: 1.0 - 0.5 * x[:, 3], correct=lambda x: x[:, 3] == 0)
    res = relevance_filter(relevance, threshold=0.3, evaluate=oracle)
    assert res.cleared == (3, 1)  # ascending relevance
    assert oracle.asked == [0b10101] and res.evaluations == 1
    assert res.recovered is True
    assert tuple(harmful_ranking(res.attribution, tau=0.0)) == (3, 1)


def test_bad_options_are_named_errors():
    oracle = CountingOracle(3, lambda x: x.sum(axis=1))
    with pytest.raises(BaselineError, match="backend"):
        proxyspex(3, oracle, backend="lightgbm")
    with pytest.raises(BaselineError, match="masks"):
        context_cite(3, oracle, masks=0)
    with pytest.raises(BaselineError, match="out of range"):
        loo(0, oracle)
    with pytest.raises(BaselineError, match="shapes"):
        loo(3, lambda m: (np.zeros(1), np.zeros(1, bool)))


@pytest.mark.skipif(importlib.util.find_spec("lightgbm") is None, reason="shapiq's ProxySPEX needs lightgbm")
def test_shapiq_backend_agrees_at_larger_k():
    k = 8
    oracle = CountingOracle(k, pair_game_k8)
    res = proxyspex(k, oracle, masks=128, seed=0, backend="shapiq")
    assert res.evaluations == len(set(oracle.asked)) <= 128
    exact = shapley_exact(oracle.table())
    assert np.abs(res.attribution - exact).max() < 0.2


def test_proxyspex_reference_truncation_keeps_fewer_coefficients():
    k = 5
    full = proxyspex(k, CountingOracle(k, pair_game), seed=0)
    truncated = proxyspex(k, CountingOracle(k, pair_game), seed=0, energy=0.95)
    assert 0 < len(truncated.extras["fourier"]) < len(full.extras["fourier"])
    exact = shapley_exact(CountingOracle(k, pair_game).table())
    np.testing.assert_allclose(truncated.attribution, exact, atol=0.15)  # weak terms may be cut, strong ones kept
    assert np.argmin(truncated.attribution) == np.argmin(exact)
    with pytest.raises(BaselineError, match="energy"):
        proxyspex(k, CountingOracle(k, pair_game), energy=0.0)
