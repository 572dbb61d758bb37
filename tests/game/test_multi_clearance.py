"""Verified clearance over several rankings (issue 30): Theorem 2's three properties on random games, for any
candidate family that holds the unchanged context; the free sparse surrogate matches ContextCite's released fit."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.game.clearance import (
    UNCHANGED,
    affordable,
    candidate_family,
    kept_coalitions,
    select_best,
    select_clearance,
    verification_rankings,
)
from pipeline.game.plan import full_mask


def _game(k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    values = rng.random(1 << k)
    return values, rng.random(1 << k) < 0.4


@pytest.mark.parametrize("seed", range(40))
def test_theorem_2_holds_for_a_family_drawn_from_several_rankings(seed: int) -> None:
    k = 6
    values, correct = _game(k, seed)
    rng = np.random.default_rng([seed, 1])
    rankings = [(name, rng.permutation(k)[: rng.integers(0, k + 1)]) for name in ("shapley", "surrogate", "loo")]
    family = candidate_family(k, rankings)
    assert family[0].removed_mask == 0 and family[0].source == UNCHANGED
    assert len({c.removed_mask for c in family}) == len(family)  # each set once
    c = select_best(k, family, values, correct)
    full = full_mask(k)
    base = values[full]
    # 1. non-negative gain; 2. a non-empty clearance is verified; 3. smallest among the maximum-gain admissible ones
    assert c.gain >= 0
    def gain(f):
        return values[full & ~f.removed_mask] - base

    admissible = [f for f in family[1:] if gain(f) > 0 and correct[full & ~f.removed_mask]]
    if not admissible:
        assert c.removed_mask == 0 and c.source == UNCHANGED
        return
    assert correct[full & ~c.removed_mask]
    best_gain = max(gain(f) for f in admissible)
    assert c.gain == pytest.approx(best_gain)
    assert len(c.removed) == min(len(f.removed) for f in admissible if gain(f) == best_gain)
    assert c.source in {"shapley", "surrogate", "loo", "single"}


@pytest.mark.parametrize("seed", range(20))
def test_one_ranking_without_singles_is_the_nested_clearance(seed: int) -> None:
    k = 7
    values, correct = _game(k, seed)
    ranking = np.random.default_rng(seed).permutation(k)[:4]
    want = select_clearance(k, ranking, values, correct)
    got = select_best(k, candidate_family(k, [("shapley", ranking)], singles=False), values, correct)
    assert (got.removed_mask, got.gain, got.recovered, got.candidates) == (
        want.removed_mask, want.gain, want.recovered, want.candidates)
    assert got.source == want.source


def test_more_candidates_never_lower_the_gain() -> None:
    k = 6
    for seed in range(30):
        values, correct = _game(k, seed)
        ranking = np.random.default_rng(seed).permutation(k)[:3]
        one = select_best(k, candidate_family(k, [("shapley", ranking)], singles=False), values, correct)
        many = select_best(k, candidate_family(k, [("shapley", ranking), ("loo", ranking[::-1])]), values, correct)
        assert many.gain >= one.gain


@pytest.mark.parametrize("seed", range(40))
def test_a_preferred_ranking_is_the_chain_when_it_clears_else_the_whole_family(seed: int) -> None:
    """`primary` (probability mode): Theorem 2's rule over the chain when the chain has an admissible candidate or
    the full context is answered correctly, over the whole family otherwise; the properties hold either way."""
    k = 6
    values, correct = _game(k, seed)
    rng = np.random.default_rng([seed, 2])
    chain = rng.permutation(k)[: rng.integers(1, 4)]
    rankings = [("shapley", chain), ("surrogate", rng.permutation(k)[:3]), ("loo", rng.permutation(k)[:2])]
    family = candidate_family(k, rankings)
    alone = select_best(k, candidate_family(k, rankings[:1], singles=False), values, correct)
    whole = select_best(k, family, values, correct)
    got = select_best(k, family, values, correct, primary="shapley")
    if alone.removed_mask or correct[full_mask(k)]:
        assert (got.removed_mask, got.gain) == (alone.removed_mask, alone.gain)
    else:
        assert (got.removed_mask, got.gain, got.source) == (whole.removed_mask, whole.gain, whole.source)
    assert got.gain >= 0 and (got.removed_mask == 0 or correct[full_mask(k) & ~got.removed_mask])


def test_a_preferred_ranking_falls_back_on_redundant_copies() -> None:
    """The case SmolLM2 showed: two copies mask each other, the estimate flags one, the chain {a} gains nothing;
    another ranking proposes {a, b}, which the fallback clears."""
    k, a, b = 4, 0, 1
    full = full_mask(k)
    values = np.full(1 << k, 0.3)
    correct = np.zeros(1 << k, dtype=bool)
    values[full & ~((1 << a) | (1 << b))] = 0.7
    correct[full & ~((1 << a) | (1 << b))] = True
    family = candidate_family(k, [("shapley", np.array([a])), ("surrogate", np.array([a, b]))])
    chain_only = select_best(k, family[:2], values, correct, primary="shapley")
    assert chain_only.removed_mask == 0
    got = select_best(k, family, values, correct, primary="shapley")
    assert got.removed == (a, b) and got.source == "surrogate" and got.recovered
    assert got.gain == pytest.approx(0.4)
    # answered correctly on the full context: no fallback, whatever another ranking's candidate would add
    correct[full] = True
    assert select_best(k, family, values, correct, primary="shapley").removed_mask == 0


def test_affordable_takes_free_candidates_and_stops_paying_at_the_budget() -> None:
    k = 5
    family = candidate_family(k, [("shapley", np.array([0, 1, 2])), ("loo", np.array([3, 4]))])
    done = set(kept_coalitions(k, family[:2]).tolist()) | {full_mask(k) & ~(1 << i) for i in range(k)}
    chosen = affordable(k, family, lambda m: np.array([int(x) in done for x in m]), left=1)
    paid = [c for c in chosen if int(full_mask(k) & ~c.removed_mask) not in done]
    assert len(paid) == 1 and paid[0] is family[2]  # the first costly candidate, in family order
    assert all(c in chosen for c in family if int(full_mask(k) & ~c.removed_mask) in done)
    assert affordable(k, family, lambda m: np.zeros(len(m), bool), None) == family


def test_a_family_must_start_unchanged() -> None:
    values, correct = _game(3, 0)
    family = candidate_family(3, [("shapley", np.array([1]))])
    with pytest.raises(ValueError, match="unchanged"):
        select_best(3, family[1:], values, correct)


def test_surrogate_ranking_is_contextcites_fit() -> None:
    pytest.importorskip("sklearn")
    from pipeline.game.linear import surrogate_scores
    from pipeline.game.surrogates import contextcite_fit, random_masks

    k = 10
    rng = np.random.default_rng(0)
    masks = np.unique(random_masks(k, 120, rng))
    util = 1 / (1 + np.exp(-(((masks[:, None] >> np.arange(k)) & 1) @ rng.normal(size=k))))
    assert np.abs(surrogate_scores(masks, util, k) - contextcite_fit(masks, util, k)[0]).max() < 1e-5


def test_verification_rankings_find_a_harmful_memory_each() -> None:
    k = 4
    # memory 2 is harmful: the answer is right only without it
    masks = np.arange(1 << k, dtype=np.int64)
    values = np.where(masks & 4, 0.1, 0.9)
    phi = np.array([0.0, 0.0, -0.8, 0.0])
    full = full_mask(k)
    loo = values[full] - values[[full & ~(1 << i) for i in range(k)]]
    got = dict(verification_rankings(k, phi, 0.05, loo, masks, values))
    assert {name: r.tolist() for name, r in got.items()} == {"shapley": [2], "surrogate": [2], "loo": [2]}


def test_the_clearance_share_of_the_budget_by_mode() -> None:
    """`correct` keeps min(K-2, B//8) back for the several-ranking clearance, `probability` the constant 2; the
    estimator never gets fewer than the K+2 anchors, and the split never keeps back more than K-2."""
    from pipeline.game.estimators import CLEARANCE_RESERVE, clearance_reserve, split_budget
    from pipeline.game.plan import min_budget

    assert clearance_reserve(10, 64, "correct") == 8 and clearance_reserve(10, 128, "correct") == 8
    assert clearance_reserve(20, 64, "correct") == 8 and clearance_reserve(20, 128, "correct") == 16
    assert clearance_reserve(20, 256, "correct") == 18 and clearance_reserve(32, 256, "correct") == 30
    assert clearance_reserve(20, 256, "probability") == CLEARANCE_RESERVE == 2
    assert clearance_reserve(10, 16, "correct") == 2  # B//8 below the constant: the constant
    for k in (2, 3, 5, 10, 20, 32):
        for b in (min_budget(k), min_budget(k) + 1, 2 * k + 4, 64, 128, 256):
            for mode in ("correct", "probability"):
                spent = split_budget(b, k, clearance_reserve(k, b, mode))
                assert min_budget(k) <= spent <= b and b - spent <= max(k - 2, 0)
    assert split_budget(64, 10, clearance_reserve(10, 64, "correct")) == 56
    assert split_budget(64, 10, clearance_reserve(10, 64, "probability")) == 62
