"""The game core against closed-form games: Theorems 1 and 2, Shapley axioms, estimator unbiasedness, planning."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.core.errors import ConfigError
from pipeline.game import (
    harmful_ranking,
    interaction_labels,
    interactions_exact,
    interactions_from_evaluated,
    loo_effects,
    make_plan,
    select_clearance,
    shapley_exact,
    shapley_permutation,
)
from pipeline.game.clearance import nested_removals
from pipeline.game.plan import full_mask


def table(k, fn):
    return np.array([fn(m) for m in range(1 << k)], dtype=float)


def redundant_game(k: int, r: int, delta: float, base: float = 0.9, helpful: float = 0.0):
    """Players 0..r-1 are redundant harmful copies: the penalty delta applies once any copy is present.
    Player r (if any) adds `helpful` additively; the rest are null."""
    group = (1 << r) - 1
    return table(k, lambda m: base - (delta if m & group else 0.0) + (helpful if (m >> r) & 1 else 0.0))


@pytest.mark.parametrize("r", [2, 3, 4])
def test_theorem1_redundant_group_loo_zero_shapley_minus_delta_over_r(r):
    k, delta = 6, 0.6
    v = redundant_game(k, r, delta, helpful=0.05)
    loo = loo_effects(v)
    phi = shapley_exact(v)
    assert np.all(loo[:r] == 0.0)  # removing any single copy leaves the penalty in place
    np.testing.assert_allclose(phi[:r], -delta / r, atol=1e-12)
    np.testing.assert_allclose(phi[r], 0.05, atol=1e-12)
    np.testing.assert_allclose(phi[r + 1 :], 0.0, atol=1e-12)


def test_theorem1_sampled_estimates_converge():
    k, r, delta = 6, 3, 0.6
    v = redundant_game(k, r, delta)
    errors = []
    for L in (16, 256, 4096):
        plan = make_plan(k, L, "permutation", seed=7)
        phi, se = shapley_permutation(v, plan.permutations)
        errors.append(np.abs(phi[:r] + delta / r).max())
        assert np.all(np.abs(phi[:r] + delta / r) <= 5 * se[:r] + 1e-12)
    assert errors[-1] < errors[0] and errors[-1] < 0.02


@settings(max_examples=60, deadline=None)
@given(k=st.integers(1, 7), seed=st.integers(0, 10_000))
def test_efficiency_symmetry_null_player(k, seed):
    rng = np.random.default_rng(seed)
    v = rng.random(1 << k)
    null = k - 1
    # make the last player null: v(S + null) = v(S)
    for m in range(1 << k):
        if m >> null & 1:
            v[m] = v[m & ~(1 << null)]
    phi = shapley_exact(v)
    assert phi.sum() == pytest.approx(v[full_mask(k)] - v[0], abs=1e-12)
    assert phi[null] == pytest.approx(0.0, abs=1e-12)
    if k >= 3:  # symmetric players 0 and 1: v depends on them only through their count
        w = v.copy()
        for m in range(1 << k):
            if (m & 1) and not (m & 2):
                w[m] = w[(m & ~1) | 2]
        p = shapley_exact(w)
        assert p[0] == pytest.approx(p[1], abs=1e-12)


def test_permutation_estimator_unbiased_within_its_standard_error():
    k = 6
    v = np.random.default_rng(3).random(1 << k)
    exact = shapley_exact(v)
    seeds, L = 200, 8
    means = np.array([shapley_permutation(v, make_plan(k, L, "permutation", seed=s).permutations)[0]
                      for s in range(seeds)])
    se_single = np.array([shapley_permutation(v, make_plan(k, L, "permutation", seed=s).permutations)[1]
                          for s in range(seeds)])
    grand = means.mean(axis=0)
    se_grand = np.sqrt((se_single**2).mean(axis=0) / seeds)  # SE of a mean of independent estimates
    assert np.all(np.abs(grand - exact) <= 4 * se_grand)


def test_antithetic_pairs_are_reversals_and_unbiased():
    k = 5
    plan = make_plan(k, 8, "permutation", antithetic=True, seed=1)
    np.testing.assert_array_equal(plan.permutations[1], plan.permutations[0][::-1])
    v = np.random.default_rng(0).random(1 << k)
    est = np.mean([shapley_permutation(v, make_plan(k, 8, "permutation", True, s).permutations, True)[0]
                   for s in range(300)], axis=0)
    np.testing.assert_allclose(est, shapley_exact(v), atol=0.03)
    with pytest.raises(ConfigError, match="even"):
        make_plan(k, 7, "permutation", antithetic=True)


def test_plan_chooses_exact_for_paper_setting_and_lists_each_coalition_once():
    plan = make_plan(5, 16)
    assert plan.estimator == "exact" and plan.n_coalitions == 32
    assert len(np.unique(plan.coalitions)) == plan.n_coalitions
    sampled = make_plan(5, 4)
    assert sampled.estimator == "permutation"
    assert len(np.unique(sampled.coalitions)) == sampled.n_coalitions <= 4 * 4 + 2 + 5
    big = make_plan(10, 16, seed=3)
    assert big.estimator == "permutation" and big.n_coalitions <= 16 * 9 + 2 + 10
    assert np.array_equal(make_plan(10, 16, seed=3).coalitions, big.coalitions)  # seeded


def test_interactions_label_structures():
    k = 4
    # players 0,1: redundant harmful copies; 2,3: jointly harmful (only together)
    v = table(k, lambda m: 1.0 - 0.5 * bool(m & 0b11) - 0.4 * ((m & 0b1100) == 0b1100))
    inter = interactions_exact(v)
    phi = shapley_exact(v)
    labels = interaction_labels(inter, phi, 0.05)
    assert inter[0, 1] == pytest.approx(0.5) and labels[0, 1] == "substitution"
    assert inter[2, 3] == pytest.approx(-0.4) and labels[2, 3] == "joint_interference"
    assert labels[0, 2] == "independent"
    # helpful complements: value only when both present
    c = table(2, lambda m: 1.0 * (m == 3))
    assert interaction_labels(interactions_exact(c), shapley_exact(c), 0.05)[0, 1] == "complementarity"
    # the evaluated-coalition estimator equals the exact index on a complete table
    est, support = interactions_from_evaluated(v)
    np.testing.assert_allclose(est, inter, atol=1e-12)
    assert support[0, 1] == 4


@st.composite
def random_game(draw):
    k = draw(st.integers(1, 6))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    values = rng.random(1 << k)
    correct = rng.random(1 << k) < draw(st.floats(0.0, 1.0))
    phi = rng.normal(0, 0.3, size=k)
    tau = draw(st.floats(0.0, 0.3))
    return k, values, correct, phi, tau


@settings(max_examples=300, deadline=None)
@given(random_game())
def test_theorem2_selection_properties(game):
    k, values, correct, phi, tau = game
    ranking = harmful_ranking(phi, tau)
    c = select_clearance(k, ranking, values, correct)
    kept = full_mask(k) & ~nested_removals(ranking)
    gains = values[kept] - values[full_mask(k)]
    admissible = [0] + [i for i in range(1, len(kept)) if gains[i] > 0 and correct[kept[i]]]
    # (1) gain is never negative: the unchanged context is always admissible
    assert c.gain >= 0
    # (2) a positive-gain selection is verified: the agent answers correctly on the cleared context
    if c.gain > 0:
        assert c.recovered and correct[full_mask(k) & ~c.removed_mask]
    # (3) maximum gain among admissible nested candidates, and the smallest candidate attaining it
    best = max(gains[i] for i in admissible)
    assert c.gain == pytest.approx(best)
    smallest = min(i for i in admissible if gains[i] == best)
    assert len(c.removed) == smallest
    # (4) nothing qualifies -> unchanged context
    if admissible == [0]:
        assert c.removed_mask == 0 and c.removed == () and c.gain == 0
    # the removed memories are a prefix of the ranking (nested filtration)
    assert tuple(ranking[: len(c.removed)]) == c.removed


def test_harmful_ranking_orders_most_negative_first_with_loo_tiebreak():
    phi = np.array([-0.2, 0.1, -0.5, -0.2, -0.01])
    loo = np.array([0.0, 0.0, 0.0, -0.3, 0.0])
    assert harmful_ranking(phi, 0.05, loo).tolist() == [2, 3, 0]
