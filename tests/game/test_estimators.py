"""The estimator contract (issue 16): games with closed-form Shapley values, budgets counted as distinct coalitions
asked, the axioms where an estimator keeps them, convergence to exact with budget, and ask/tell == estimate."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.core.errors import ConfigError
from pipeline.game.attribution import shapley_exact
from pipeline.game.estimators import (
    ESTIMATOR_NAMES,
    Attribution,
    BudgetError,
    CachedGame,
    get_estimator,
    split_budget,
    table_game,
)

SHAPLEY = ("exact", "permutation", "antithetic", "adaptive", "kernelshap", "leverage", "screened")
SAMPLED = ("permutation", "antithetic", "adaptive", "kernelshap", "leverage", "screened")


def bits(masks: np.ndarray, k: int) -> np.ndarray:
    return (np.asarray(masks, dtype=np.int64)[:, None] >> np.arange(k) & 1).astype(float)


def additive(w: np.ndarray) -> CachedGame:
    """v(S) = sum_{i in S} w_i: phi = w."""
    return CachedGame(len(w), lambda m: bits(m, len(w)) @ w)


def unanimity(k: int, coalitions: list[tuple[tuple[int, ...], float]]) -> tuple[CachedGame, np.ndarray]:
    """v(S) = sum_T c_T [T subset of S]: phi_i = sum_{T containing i} c_T / |T| (closed form)."""
    phi = np.zeros(k)
    for t, c in coalitions:
        phi[list(t)] += c / len(t)

    def f(m: np.ndarray) -> np.ndarray:
        out = np.zeros(len(m))
        for t, c in coalitions:
            tm = sum(1 << i for i in t)
            out += c * ((m & tm) == tm)
        return out

    return CachedGame(k, f), phi


def test_registry_names_and_errors():
    for name in SHAPLEY:
        assert name in ESTIMATOR_NAMES
        assert get_estimator(name).name == name
    with pytest.raises(ConfigError, match="unknown"):
        get_estimator("nope")
    with pytest.raises(ConfigError, match="bad options"):
        get_estimator("permutation", colour="red")


@pytest.mark.parametrize("bad", [3, 11, 10.5, "64", True])
def test_bad_budgets_are_refused(bad):
    with pytest.raises(BudgetError):
        get_estimator("permutation").estimate(additive(np.ones(10)), bad, np.random.default_rng(0))


def test_split_budget_keeps_room_for_the_clearance_and_the_anchors():
    assert split_budget(12, 10) == 12  # K+2: everything to the estimator (the anchors)
    assert split_budget(13, 10) == 12
    assert split_budget(128, 10) == 126
    assert split_budget(7, 5) == 7
    with pytest.raises(BudgetError):
        split_budget(11, 10)


def test_exact_equals_closed_form_and_refuses_a_small_budget():
    game, phi = unanimity(6, [((0, 1), 1.0), ((2,), -0.5), ((1, 3, 4), 0.9)])
    a = get_estimator("exact").estimate(game, 64, np.random.default_rng(0))
    assert isinstance(a, Attribution)
    np.testing.assert_allclose(a.values, phi, atol=1e-12)
    assert (a.evaluations, a.stop, a.estimated, a.method) == (64, "exact", False, "exact")
    np.testing.assert_array_equal(a.se, np.zeros(6))
    with pytest.raises(BudgetError, match="2\\^6"):
        get_estimator("exact").estimate(unanimity(6, [((0,), 1.0)])[0], 63, np.random.default_rng(0))


@pytest.mark.parametrize("name", SAMPLED + ("adjusted", "sparseshap"))
@pytest.mark.parametrize("budget", [12, 13, 40, 100])
def test_budget_is_respected_counting_distinct_coalitions(name, budget):
    game, _ = unanimity(10, [((0, 1), 1.0), ((2, 5, 7), -1.0), ((9,), 0.3)])
    a = get_estimator(name).estimate(game, budget, np.random.default_rng(3))
    assert a.evaluations == game.evaluations <= budget  # what the game was asked, each coalition once
    assert a.values.shape == a.se.shape == (10,)
    assert np.isfinite(a.values).all() and a.estimated


@pytest.fixture
def no_2k_arrays(monkeypatch):
    """np.arange refuses anything of 2^18 entries or more: nothing at K=20 may build a 2^K-sized index."""
    arange = np.arange

    def guarded(*args, **kw):
        assert not args or args[0] < 1 << 18, "a 2^K-sized array at K=20"
        return arange(*args, **kw)

    monkeypatch.setattr(np, "arange", guarded)


@pytest.mark.parametrize("name", SAMPLED)
def test_k20_never_allocates_2_to_the_20(name, no_2k_arrays):
    w = np.linspace(-1, 1, 20)
    game = additive(w)
    a = get_estimator(name).estimate(game, 256, np.random.default_rng(0))
    assert a.evaluations == game.evaluations <= 256
    np.testing.assert_allclose(a.values, w, atol=1e-9)  # additive: every marginal is w_i, every fit is exact


@pytest.mark.parametrize("name", SAMPLED)
def test_additive_game_is_recovered_exactly(name):
    w = np.array([0.3, -0.2, 0.0, 0.5, -0.6, 0.1, 0.0, 0.2])
    a = get_estimator(name).estimate(additive(w), 40, np.random.default_rng(1))
    np.testing.assert_allclose(a.values, w, atol=1e-9)


@pytest.mark.parametrize("name", ("kernelshap", "leverage"))
def test_regression_estimators_are_efficient(name):
    game, phi = unanimity(9, [((0, 1), 1.0), ((2, 5, 7), -1.0), ((3, 8), 0.4)])
    a = get_estimator(name).estimate(game, 60, np.random.default_rng(2))
    assert a.values.sum() == pytest.approx(phi.sum(), abs=1e-9)  # v(N) - v(empty)


@pytest.mark.parametrize("name", SAMPLED)
def test_null_players_get_zero_and_symmetric_players_agree_in_permutation_estimators(name):
    game, _ = unanimity(8, [((0, 1), 1.0)])  # 2..7 are null players; 0 and 1 symmetric
    opts = {"tau": 0.1} if name == "adaptive" else {}  # tau = 0 would put the null players on the threshold
    a = get_estimator(name, **opts).estimate(game, 80, np.random.default_rng(4))
    if name in ("permutation", "antithetic", "adaptive"):  # a null player's every marginal is 0
        np.testing.assert_allclose(a.values[2:], 0.0, atol=1e-12)
    np.testing.assert_allclose(a.values[:2], [0.5, 0.5], atol=0.2)


@pytest.mark.parametrize("name", SAMPLED)
def test_sampled_estimators_converge_to_exact(name):
    rng = np.random.default_rng(0)
    table = rng.normal(size=1 << 8) * 0.3 + bits(np.arange(256), 8) @ rng.normal(size=8)
    exact = shapley_exact(table)
    opts = {"z": 1e6} if name == "adaptive" else {}  # adaptive stops once the signs are certain; here: never
    errs = [np.abs(get_estimator(name, **opts).estimate(table_game(table), b, np.random.default_rng(5)).values
                   - exact).max() for b in (20, 250)]
    assert errs[1] < errs[0]
    assert errs[1] < 0.15


def test_ask_tell_equals_estimate():
    rng = np.random.default_rng(7)
    table = rng.random(1 << 10)
    for name in SHAPLEY:
        budget = 1024 if name == "exact" else 90
        est = get_estimator(name, **({"tau": 0.05} if name == "adaptive" else {}))
        a = est.estimate(table_game(table), budget, np.random.default_rng(11))
        run = est.start(10, budget, np.random.default_rng(11))
        while len(m := run.ask()):
            run.tell(m, table[m])
        b = run.result()
        np.testing.assert_array_equal(a.values, b.values)
        np.testing.assert_array_equal(a.se, b.se)
        assert (a.evaluations, a.stop) == (b.evaluations, b.stop)


def test_fixed_permutations_reproduce_the_former_plan():
    from pipeline.game.attribution import shapley_permutation
    from pipeline.game.plan import make_plan

    rng = np.random.default_rng(0)
    table = rng.random(1 << 7)
    plan = make_plan(7, 16, "permutation", False, seed=42)
    a = get_estimator("permutation", permutations=16).estimate(table_game(table), 128, np.random.default_rng(42))
    np.testing.assert_array_equal(a.values, shapley_permutation(table, plan.permutations)[0])
    assert a.evaluations == plan.n_coalitions


def test_adaptive_stops_by_separation_and_the_prior_only_adds_draws():
    # a {0,1}-valued game: memories 0..4 hurt only together (phi = -0.2 each), 5 helps; most marginals are exactly 0
    def game():
        return unanimity(10, [((0, 1, 2, 3, 4), -1.0), ((5,), 1.0)])

    for seed in range(5):
        g, phi = game()
        plain = get_estimator("adaptive", tau=0.05, rule="separation").estimate(g, 600, np.random.default_rng(seed))
        guarded = get_estimator("adaptive", tau=0.05, prior=2.0, rule="separation").estimate(
            game()[0], 600, np.random.default_rng(seed))
        checked = get_estimator("adaptive", tau=0.05).estimate(game()[0], 600, np.random.default_rng(seed))
        assert plain.stop == "separation" and plain.evaluations <= 600
        np.testing.assert_array_equal(plain.values < -0.05, phi < -0.05)
        np.testing.assert_array_equal(guarded.values < -0.05, phi < -0.05)
        assert guarded.evaluations >= plain.evaluations  # a floor on the variance can only delay the stop
        # the default rule enumerates the six players that matter once the screen saw them: exact values
        assert checked.stop == "explained" and checked.evaluations <= 600
        np.testing.assert_allclose(checked.values, phi, atol=1e-12)


# --------------------------------------------------------------------------------- through the audit (ask/tell)
@pytest.fixture(scope="module")
def budget_audit(sample_audit):
    """The sample pool audited at K=8 with a budget of 40 evaluations per query, once per estimator (shared runs)."""
    from pipeline.audit.run import AuditConfig

    out = {}
    for name in ("adaptive", "kernelshap", "leverage", "permutation"):
        settings = {"estimator": name, "top_k": 8, "budget": 40}
        out[name] = (AuditConfig(**(sample_audit.BASE | settings)), sample_audit.run(**settings))
    return out


@pytest.mark.parametrize("name", ("adaptive", "kernelshap", "leverage", "permutation"))
def test_audit_spends_at_most_the_budget_per_query_and_records_it(budget_audit, name):
    import polars as pl

    _, folder = budget_audit[name]
    cl = pl.read_parquet(folder / "clearances")
    util = pl.read_parquet(folder / "utilities")
    spent = util.group_by("query_id").len()
    joined = cl.select("query_id", "evaluations").join(spent, on="query_id")
    assert joined.height == cl.height > 0
    assert (joined["evaluations"] == joined["len"]).all()  # the row says what the query really cost
    assert cl["evaluations"].max() <= 40


@pytest.mark.parametrize("name", ("adaptive", "kernelshap", "leverage"))
def test_audit_and_estimate_give_identical_attributions(budget_audit, name):
    """For each case, estimate() over the values the audit evaluated, with the case's seed and the audit's share of
    the budget, gives exactly the audit's Shapley values (the audit batches the same runs through ask/tell)."""
    import polars as pl

    from pipeline.audit.cases import case_seed

    cfg, folder = budget_audit[name]
    util = pl.read_parquet(folder / "utilities")
    att = pl.read_parquet(folder / "attributions").sort("position")
    for (pool_id, query_id), rows in list(att.group_by(["pool_id", "query_id"]))[:6]:
        u = util.filter((pl.col("pool_id") == pool_id) & (pl.col("query_id") == query_id))
        known = dict(zip(u["coalition"].to_list(), u["utility"].to_list()))
        k = rows.height
        game = CachedGame(k, lambda m: np.array([known[int(x)] for x in m]))
        opts = {"tau": cfg.tau, "z": cfg.adaptive_z, "cap": cfg.permutations, "round_size": cfg.adaptive_round,
                "prior": cfg.adaptive_prior} if name == "adaptive" else {}
        a = get_estimator(name, **opts).estimate(game, split_budget(cfg.budget, k),
                                                 np.random.default_rng(case_seed(cfg.seed, pool_id, query_id)))
        np.testing.assert_array_equal(a.values, rows["shapley"].to_numpy())
        assert rows["stop_reason"][0] == a.stop


@pytest.mark.parametrize("name", ("contextcite", "proxyspex"))
def test_surrogates_behind_the_contract_match_the_benchmark_baselines(name):
    pytest.importorskip("sklearn")
    from pipeline.bench import baselines

    game, _ = unanimity(10, [((0, 1), -1.0), ((4,), 0.5), ((7, 8), 0.25)])
    a = get_estimator(name, seed=3).estimate(game, 48, np.random.default_rng(3))  # seed: the trees' random_state
    assert a.evaluations == game.evaluations <= 48 and a.method == name and a.stop == "fit"
    fn = baselines.context_cite if name == "contextcite" else baselines.proxyspex
    b = fn(10, lambda m: (game(m), np.zeros(len(m), dtype=bool)), masks=48, seed=3)
    np.testing.assert_allclose(a.values, b.attribution, atol=1e-12)
    assert a.values[0] < 0 and a.values[4] > 0  # the harmful pair and the helpful memory, by sign


def test_auto_under_a_budget_enumerates_when_2k_fits_else_follows_the_utility_mode_and_budget():
    from pipeline.game.plan import make_plan

    assert make_plan(10, budget=1024).estimator == "exact"
    # from a quarter of the game, and in `probability` mode below 4 evaluations per memory: the least-squares fit
    for k, budget in ((10, 256), (10, 512), (10, 16), (10, 32), (20, 32), (20, 64)):
        assert make_plan(k, budget=budget, utility="probability").estimator == "kernelshap"
    # otherwise the sparse surrogate's Shapley values (pipeline.game.adjusted; issue 30 item 2)
    for k, budget in ((10, 64), (10, 128), (20, 128), (20, 256)):
        assert make_plan(k, budget=budget, utility="probability").estimator == "sparseshap"
    # `correct`: the fit once the budget buys K samples beyond the anchors and the reserve (N >= 2K + 4), else the mean
    assert make_plan(10, budget=23, utility="correct").estimator == "permutation"
    assert make_plan(10, budget=24, utility="correct").estimator == "sparseshap"
    assert make_plan(10, budget=256, utility="correct").estimator == "kernelshap"
    assert make_plan(20, budget=32, utility="correct").estimator == "permutation"
    assert make_plan(20, budget=64, utility="correct").estimator == "sparseshap"
    with pytest.raises(ConfigError, match="2\\^10"):
        make_plan(10, estimator="exact", budget=1000)


@pytest.mark.parametrize("bad", ["12.5", "3", "ten"])
def test_cli_refuses_a_bad_budget_in_one_line(tmp_path, bad):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "pipeline.cli.main", "audit", "--executor", "local", "--dense", "off",
                           "--budget", bad, "--out", str(tmp_path / "o"), "--no-progress"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1 and "budget" in done.stderr
    assert not (tmp_path / "o").exists()


def test_sparse_interactions_equal_the_dense_index():
    import pipeline.game.attribution as attribution
    from pipeline.game.plan import prefix_masks
    from pipeline.game.sparse import SparseTable

    k = 14
    rng = np.random.default_rng(2)
    masks = np.unique(prefix_masks(rng.permuted(np.tile(np.arange(k), (24, 1)), axis=1)).ravel())
    table = SparseTable(k)
    table[masks] = rng.random(masks.size)
    sparse = attribution.interactions_from_evaluated(table)
    dense_values = np.full(1 << k, np.nan)
    dense_values[masks] = table[masks]
    dense = attribution.interactions_from_evaluated(dense_values)
    np.testing.assert_allclose(sparse[0], dense[0], rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(sparse[1], dense[1])
    assert (sparse[1] > 0).any()


@pytest.mark.parametrize("name", ("adaptive", "kernelshap", "permutation"))
def test_a_k20_case_runs_through_the_audit_reduction_within_its_budget(name, no_2k_arrays):
    """K=20 with a budget of 200: the reduction (estimator, LOO, interactions, clearance) never builds 2^K of
    anything."""
    from pipeline.audit.cases import Case
    from pipeline.audit.reduce import CaseState, advance, finalize
    from pipeline.game.plan import make_plan
    from pipeline.io.records import Query
    from pipeline.retrieval.frozen import FrozenContext

    k = 20
    w = np.where(np.arange(k) % 5 == 0, -0.3, 0.02)
    ctx = FrozenContext("p", "q", tuple(f"m{i}" for i in range(k)), ("t",) * k, (0.0,) * k, tuple(range(1, k + 1)),
                        (None,) * k, "h")
    st = CaseState(Case(Query("q", "p", "?", "a", ("a", "b")), ctx, 5), make_plan(k, 96, name, seed=5, budget=200),
                   0.05)
    while (need := advance(st, 0.05, 1.96)) is not None:
        v = bits(need.masks, k) @ w
        st.record(need.masks, v, v > 0)
    rows = finalize(st, "r", 0.05, 0.05)
    assert rows.clearance.evaluations == st.evaluations <= 200
    np.testing.assert_allclose(st.phi, w, atol=1e-9)  # additive: exact for every estimator
    assert sorted(st.ranking.tolist()) == [0, 5, 10, 15]
