"""The surrogate-aware estimators (issue 30 item 2): `adjusted` (regression-adjusted, after Witter, Kolpaczki et al.
2025) and `sparseshap` (a sparse order-2 surrogate's Shapley values), on closed-form games."""

import numpy as np
import pytest

from pipeline.core.errors import ConfigError
from pipeline.game.adjusted import lasso_fista, second_order_fit, surrogate_values
from pipeline.game.attribution import shapley_exact
from pipeline.game.estimators import ESTIMATOR_NAMES, CachedGame, get_estimator, table_game
from pipeline.game.linear import lasso
from pipeline.game.plan import auto_estimator, loo_coalitions

NAMES = ("adjusted", "sparseshap")


def bits(masks: np.ndarray, k: int) -> np.ndarray:
    return (np.asarray(masks, dtype=np.int64)[:, None] >> np.arange(k, dtype=np.int64) & 1).astype(float)


def copies_table(k: int, copies: tuple[int, ...], gold: int = 0) -> np.ndarray:
    """A {0, 1} memory game: the answer is right when the gold memory is kept and every harmful copy is removed
    (copies that mask each other: removing one alone changes nothing)."""
    x = bits(np.arange(1 << k), k)
    return x[:, gold] * np.prod(1 - x[:, list(copies)], axis=1)


def order2_game(k: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    w = rng.normal(size=k)
    pairs = np.zeros((k, k))
    for i, j in [(0, 1), (2, 5), (3, 4)]:
        pairs[i, j] = pairs[j, i] = rng.normal()
    x = bits(np.arange(1 << k), k)
    v = 0.3 + x @ w + 0.5 * np.einsum("ni,ij,nj->n", x, pairs, x)
    return v, w, pairs


def test_registered_with_their_names_and_bad_options_refused():
    for name in NAMES:
        assert name in ESTIMATOR_NAMES and get_estimator(name).name == name
    assert get_estimator("adjusted").adjust and not get_estimator("sparseshap").adjust
    for bad in ({"sampling": "sobol"}, {"alpha": -1.0}, {"order": 3}):
        with pytest.raises(ConfigError):
            get_estimator("adjusted", **bad)


def test_fista_matches_coordinate_descent_lasso():
    """The numpy FISTA solver against the audit's coordinate-descent Lasso on the same standardised problem."""
    rng = np.random.default_rng(4)
    x = rng.integers(0, 2, size=(60, 12)).astype(float)
    y = x @ rng.normal(size=12) + 0.1 * rng.normal(size=60)
    w_f, b_f = lasso_fista(x, y, 0.05, steps=5000, tol=1e-12)
    sd = x.std(axis=0)
    w_c, b_c = lasso(x / sd, y, 0.05)
    np.testing.assert_allclose(w_f, w_c / sd, atol=1e-5)
    assert b_f == pytest.approx(b_c, abs=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_the_whole_table_gives_exact_shapley_values(name):
    v = copies_table(8, (3, 4))
    a = get_estimator(name).estimate(table_game(v), 256, np.random.default_rng(0))
    np.testing.assert_allclose(a.values, shapley_exact(v), atol=1e-9)
    assert (a.stop, a.estimated, a.evaluations) == ("exact", False, 256)


def test_order_two_games_are_read_out_in_closed_form():
    """Without a penalty the surrogate is the game itself (an order-2 polynomial): phi_i = w_i + 1/2 sum_j w_ij."""
    v, w, pairs = order2_game(8, np.random.default_rng(1))
    exact = shapley_exact(v)
    np.testing.assert_allclose(w + 0.5 * pairs.sum(axis=1), exact, atol=1e-12)  # the closed form itself
    masks = np.random.default_rng(2).choice(256, size=120, replace=False)
    fw, fp, fb = second_order_fit(masks, v[masks], 8, alpha=0.0)
    np.testing.assert_allclose(surrogate_values(masks, fw, fp, fb), v[masks], atol=1e-3)
    for name in NAMES:
        a = get_estimator(name, alpha=0.0).estimate(table_game(v), 120, np.random.default_rng(3))
        np.testing.assert_allclose(a.values, exact, atol=1e-3)


@pytest.mark.parametrize("budget", [20, 40, 100])
def test_adjusted_is_efficient_at_any_budget(budget):
    v = copies_table(10, (2, 6, 7))
    a = get_estimator("adjusted").estimate(table_game(v), budget, np.random.default_rng(5))
    assert a.values.sum() == pytest.approx(v[-1] - v[0], abs=1e-9)  # v(N) - v(empty): the residual carries the rest


@pytest.mark.parametrize("name", NAMES)
def test_anchors_first_then_paired_coalitions_from_the_middle(name):
    k, budget = 20, 96
    run = get_estimator(name).start(k, budget, np.random.default_rng(0))
    first = run.ask()
    np.testing.assert_array_equal(first, np.union1d(loo_coalitions(k), [0]))
    run.tell(first, np.zeros(first.size))
    rest = np.setdiff1d(run.ask(), first)
    assert first.size + rest.size == budget
    full = (1 << k) - 1
    assert np.isin(full & ~rest, rest).all()  # every draw comes with its complement
    sizes = np.bitwise_count(rest)
    # each memory kept with probability 1/2 (sizes ~ Binomial(20, 1/2)): the middle, not the Shapley kernel's borders
    assert np.mean((sizes >= 6) & (sizes <= 14)) > 0.9 and not np.isin(sizes, [1, 2, k - 2, k - 1]).any()


def test_redundant_copies_rank_first_where_kernelshap_misses_them():
    """K=20, 64 evaluations, two harmful copies that mask each other in a {0, 1} game (the K=20 regime where
    ContextCite ranked the faults and the Shapley kernel's border draws did not): the copies are the two most
    negative values in most seeds, more often than with kernelshap."""
    k, copies = 20, (5, 11)

    def f(m: np.ndarray) -> np.ndarray:
        x = bits(m, k)
        return x[:, 0] * (1 - x[:, copies[0]]) * (1 - x[:, copies[1]])

    hits = {}
    for name in ("sparseshap", "adjusted", "kernelshap"):
        found = 0
        for seed in range(20):
            a = get_estimator(name).estimate(CachedGame(k, f), 64, np.random.default_rng(seed))
            found += set(np.argsort(a.values, kind="stable")[:2].tolist()) == set(copies)
        hits[name] = found
    assert hits["sparseshap"] >= 16, hits
    assert hits["sparseshap"] > hits["kernelshap"], hits


def test_auto_takes_the_surrogate_below_a_quarter_of_the_game():
    assert auto_estimator(10, 64, "correct") == auto_estimator(10, 128, "probability") == "sparseshap"
    assert auto_estimator(10, 256, "correct") == auto_estimator(10, 512, "probability") == "kernelshap"
    assert auto_estimator(20, 64, "correct") == auto_estimator(32, 256, "probability") == "sparseshap"
    assert auto_estimator(20, 64, "probability") == "kernelshap"  # `probability`: at least 4 evaluations per memory
    assert auto_estimator(32, 128, "probability") == auto_estimator(10, 40, "probability") == "sparseshap"
    assert auto_estimator(20, 32, "correct") == "permutation"  # few samples beyond the anchors: the mean
    assert auto_estimator(10, 1024, "correct") == "exact"


def test_without_loo_anchors_every_draw_is_contextcites_design():
    """`loo=False` (what `auto` plans at small `correct` budgets): the empty set and N first, then paired draws that
    keep each memory with probability 1/2, the whole budget spent and no leave-one-out coalition asked."""
    k, budget = 20, 64
    run = get_estimator("sparseshap", loo=False).start(k, budget, np.random.default_rng(0))
    first = run.ask()
    np.testing.assert_array_equal(first, [0, (1 << k) - 1])
    run.tell(first, np.zeros(first.size))
    rest = np.setdiff1d(run.ask(), first)
    assert first.size + rest.size == budget
    assert not np.isin(loo_coalitions(k)[1:], rest).any()
    sizes = np.bitwise_count(rest)
    assert np.mean((sizes >= 6) & (sizes <= 14)) > 0.9


def test_without_loo_anchors_redundant_copies_are_found_more_often():
    """The same two masking copies at K=20 and 64 evaluations: LOO gives each copy 0, so its 20 anchors carry no
    sign of them; spent on random draws instead they find the pair at least as often."""
    k, copies = 20, (5, 11)

    def f(m: np.ndarray) -> np.ndarray:
        x = bits(m, k)
        return x[:, 0] * (1 - x[:, copies[0]]) * (1 - x[:, copies[1]])

    found = {}
    for loo in (True, False):
        found[loo] = sum(
            set(np.argsort(get_estimator("sparseshap", loo=loo).estimate(
                CachedGame(k, f), 64, np.random.default_rng(seed)).values, kind="stable")[:2].tolist()) == set(copies)
            for seed in range(20))
    assert found[False] >= found[True] and found[False] >= 18, found


def test_auto_drops_the_loo_screen_below_eight_evaluations_per_memory_in_correct_mode():
    from pipeline.game.plan import auto_measures_loo, make_plan

    assert not auto_measures_loo(20, 64, "correct") and not auto_measures_loo(20, 128, "correct")
    assert not auto_measures_loo(10, 64, "correct") and not auto_measures_loo(63, 256, "correct")
    assert auto_measures_loo(20, 256, "correct") and auto_measures_loo(10, 128, "correct")  # 8 per memory and up
    assert auto_measures_loo(20, 128, "probability") and auto_measures_loo(10, 64, "probability")  # never
    assert auto_measures_loo(20, 32, "correct")  # the permutation mean there: its design needs the anchors
    assert auto_measures_loo(20, 0, "correct")  # no budget: the paper's settings
    plan = make_plan(20, estimator="auto", budget=64, utility="correct")
    assert plan.estimator == "sparseshap" and not plan.loo
    np.testing.assert_array_equal(plan.coalitions, [0, (1 << 20) - 1])
    named = make_plan(20, estimator="sparseshap", budget=64, utility="correct")  # named: the LOO screen stays
    assert named.loo and named.n_coalitions == 22
    assert make_plan(20, estimator="auto", budget=64, utility="probability").loo
