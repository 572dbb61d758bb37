"""The `screened` estimator on closed-form games: exact Shapley values whenever only a few players matter (found by the
screen or by the check that follows it), a player whose marginals are 0 in most permutations is not missed in a
{0, 1} game, the budget is never exceeded, and a dense game falls back within its bounds."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.core.errors import ConfigError
from pipeline.game import shapley_exact
from pipeline.game.estimators import get_estimator, table_game
from pipeline.game.screened import MAX_ENUMERATED, Screened, subset_masks

K = 10
MASKS = np.arange(1 << K)


def _has(i: int) -> np.ndarray:
    return ((MASKS >> i) & 1).astype(float)


def _estimate(values: np.ndarray, budget: int = 1 << K, seed: int = 0, **options):
    game = table_game(values)
    attr = get_estimator("screened", tau=0.05, **options).estimate(game, budget, np.random.default_rng(seed))
    return attr, game


@pytest.mark.parametrize("seed", range(12))
def test_a_game_of_few_players_gets_its_exact_shapley_values(seed: int) -> None:
    rng = np.random.default_rng(seed)
    players = rng.choice(K, size=rng.integers(1, 5), replace=False)
    # a random game on `players` only (an arbitrary table over their 2^r subsets), every other player null
    table = rng.random(1 << len(players))
    index = sum(((MASKS >> int(p)) & 1) << j for j, p in enumerate(players))
    values = table[index]
    attr, game = _estimate(values, seed=seed)
    np.testing.assert_allclose(attr.values, shapley_exact(values), atol=1e-12)
    assert attr.stop == "explained" and attr.evaluations == game.evaluations < 1 << K


@pytest.mark.parametrize("copies", [(3, 6, 8), (0, 9), (1, 4, 5, 7)])
def test_copies_that_mask_each_other_are_found_by_the_check_not_the_screen(copies) -> None:
    # {0, 1}: right while any copy is present. Each copy's LOO marginal is 0 (the others mask it), so a screen of the
    # anchors alone (pairs=0) finds nothing; the check sees v(empty) unexplained and asks who moves it
    values = np.max([_has(i) for i in copies], axis=0)
    attr, game = _estimate(values, pairs=0, grow=len(copies))  # one player added per check
    np.testing.assert_allclose(attr.values, shapley_exact(values), atol=1e-12)
    assert attr.stop == "explained" and game.evaluations < 64


@pytest.mark.parametrize("seed", range(10))
def test_a_conflict_with_a_masked_copy_gets_the_exact_harmful_set(seed: int) -> None:
    # the K=20 failure mode of surrogates, at K=10: memory 2 is outdated and wrong; memories 5 and 7 are copies of the
    # right fact, either one enough unless memory 2 is present, which takes both copies to outweigh
    right = np.maximum(_has(5), _has(7))
    values = np.where(_has(2) == 1, _has(5) * _has(7), right)
    exact = shapley_exact(values)
    attr, _ = _estimate(values, seed=seed)
    np.testing.assert_allclose(attr.values, exact, atol=1e-12)
    assert np.array_equal(attr.values < -0.05, exact < -0.05) and (exact < -0.05).sum() == 1


def test_the_budget_is_never_exceeded_and_the_enumeration_shrinks_to_fit() -> None:
    rng = np.random.default_rng(3)
    values = rng.random(1 << K)  # dense: every player matters
    for budget in (12, 13, 40, 80, 150, 300):
        attr, game = _estimate(values, budget=budget)
        assert game.evaluations <= budget and attr.evaluations == game.evaluations
        assert np.isfinite(attr.values).all()
    attr, game = _estimate(values)
    assert attr.stop == "grow" and game.evaluations <= 12 + 12 * (K - 1) + (1 << MAX_ENUMERATED)
    small, _ = _estimate(values, budget=80)
    assert small.stop == "budget"


def test_the_anchors_alone_give_the_least_squares_fit_to_them() -> None:
    values = 0.3 * _has(2) - 0.2 * _has(5)
    attr, game = _estimate(values, budget=K + 2)
    assert game.evaluations == K + 2 and attr.stop == "budget"
    np.testing.assert_allclose(attr.values, shapley_exact(values), atol=1e-12)  # additive: LOO is exact


def test_subset_masks_lists_base_with_every_subset() -> None:
    got = subset_masks(0b1000, [0, 2])
    assert got.tolist() == [0b1000, 0b1001, 0b1100, 0b1101]


def test_bad_options_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="screened: tau=-1"):
        Screened(tau=-1)
    with pytest.raises(ConfigError, match="bad options"):
        get_estimator("screened", nosuch=1)
