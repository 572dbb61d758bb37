"""The adaptive permutation estimator. The paper's rule (Appendix B, `rule="separation"`): stops by separation on games
whose values are clear of -tau, runs to the cap when a value sits on the threshold. The default rule ("check"): the
rounds are a screen, then the game restricted to the players whose marginals exceed tau must explain every evaluated
coalition. Through the driver, each case reports its permutations and stop."""

from __future__ import annotations

import itertools

import numpy as np
import polars as pl
import pytest

from pipeline.audit.cases import Case
from pipeline.audit.reduce import CaseState, advance
from pipeline.audit.run import AuditConfig, InputSpec, run_audit
from pipeline.audit.worker import AgentWorker
from pipeline.core.errors import ConfigError
from pipeline.exec.pools import LocalPool
from pipeline.game import make_plan, shapley_exact, shapley_least_squares
from pipeline.game.adaptive import DEFAULT_Z, estimate, separated, stop_reason
from pipeline.io.records import Query
from pipeline.retrieval.frozen import FrozenContext


def table(k, v):
    return np.array([v(m) for m in range(1 << k)], dtype=float)


def additive(weights):
    return table(len(weights), lambda m: sum(w for i, w in enumerate(weights) if m >> i & 1))


def run_case(values, permutations=64, round_size=8, tau=0.25, seed=0, rule="separation"):
    """Drive one CaseState as the audit driver does, answering coalitions from a closed-form value table (the
    paper's separation rule unless `rule` says otherwise)."""
    k = values.size.bit_length() - 1
    ctx = FrozenContext("p", "q", tuple(f"m{i}" for i in range(k)), ("t",) * k, (0.0,) * k, tuple(range(1, k + 1)),
                        (None,) * k, "h")
    st = CaseState(Case(Query("q", "p", "?", "a", ("a", "b")), ctx, seed),
                   make_plan(k, permutations, "adaptive", seed=seed, round_size=round_size, rule=rule), tau)
    asked = []
    while (need := advance(st, tau, DEFAULT_Z)) is not None and need.stage == "plan":
        asked.append(len(need.masks))
        st.record(need.masks, values[need.masks], np.zeros(len(need.masks), dtype=bool))
    return st, asked


def test_stops_after_one_round_when_every_value_is_clear_of_the_threshold():
    values = additive([-1.0, 0.5, 0.0, 0.125, -0.5, 0.25, 0.0, 1.0, -0.75, 0.0])  # K=10; phi = weights, SE = 0
    st, asked = run_case(values)
    assert st.stop == "separation" and st.used == 8 and len(asked) == 1
    np.testing.assert_allclose(st.phi, shapley_exact(values))
    assert st.evaluations <= 8 * 9 + 2 < 1024  # far below exact enumeration


def test_stops_by_separation_on_an_interaction_game_with_noisy_draws():
    # v = -1 if players 0, 1 and 2 are all in (phi = -1/3 each), player 3 is null. A permutation and its reverse give a
    # player of the triple -1 once when it comes after the other two in one of them, else 0: pair means 0 or -0.5, so
    # SE > 0 (a pairwise game would give every pair the same mean, -0.5).
    values = table(4, lambda m: -1.0 if (m & 7) == 7 else 0.0)
    st, _ = run_case(values, tau=0.05)
    assert st.stop == "separation" and st.used < 64
    assert (st.se[:3] > 0).all() and st.se[3] == 0 and separated(st.phi, st.se, 0.05).all()
    assert sorted(st.ranking.tolist()) == [0, 1, 2]


def test_runs_to_the_cap_when_a_value_sits_on_the_threshold():
    # player 0 contributes exactly -tau in every permutation (binary fractions: exact in floating point)
    values = additive([-0.25, 0.5, 0.125, -1.0, 0.0])
    st, asked = run_case(values, permutations=40, round_size=8, tau=0.25)
    assert st.stop == "cap" and st.used == 40
    mean, se, _ = estimate(st.values, st.plan.permutations[:40], antithetic=True)  # what the rule looked at
    assert not separated(mean, se, 0.25)[0] and separated(mean, se, 0.25)[1:].all()
    np.testing.assert_allclose(st.phi, [-0.25, 0.5, 0.125, -1.0, 0.0], atol=1e-12)


def test_stop_rule_minimum_and_cap():
    phi, se = np.array([-1.0, 0.0]), np.zeros(2)
    assert stop_reason(phi, se, 0.05, used=4, cap=64, min_draws=8) is None  # too few draws to trust SE = 0
    assert stop_reason(phi, se, 0.05, used=8, cap=64, min_draws=8) == "separation"
    assert stop_reason(np.array([-0.05]), np.array([0.1]), 0.05, used=64, cap=64, min_draws=8) == "cap"
    with pytest.raises(ConfigError):
        make_plan(5, 16, "adaptive", round_size=1)
    with pytest.raises(ConfigError):
        AuditConfig(estimator="adaptive", adaptive_round=1)
    with pytest.raises(ConfigError, match="even"):  # antithetic pairs: an odd cap or round cannot be paired
        make_plan(5, 15, "adaptive")
    with pytest.raises(ConfigError, match="even"):
        AuditConfig(estimator="adaptive", adaptive_round=3)
    with pytest.raises(ConfigError, match="even"):
        AuditConfig(estimator="adaptive", permutations=15)
    assert make_plan(5, 16, "adaptive").antithetic  # pairs whatever the flag says


def test_adaptive_draws_each_permutation_then_its_reverse():
    perms = make_plan(6, 16, "adaptive", seed=3).permutations
    np.testing.assert_array_equal(perms[1::2], perms[0::2, ::-1])


def test_antithetic_pair_estimate_is_unbiased():
    # over every permutation (each with its reverse), the mean of the pair draws is exact Shapley: a random game, K=4
    values = np.random.default_rng(7).normal(size=16)
    perms = np.array(list(itertools.permutations(range(4))))
    paired = np.empty((2 * len(perms), 4), dtype=np.int64)
    paired[0::2], paired[1::2] = perms, perms[:, ::-1]
    phi, _, draws = estimate(values, paired, antithetic=True)
    assert draws == len(perms)
    np.testing.assert_allclose(phi, shapley_exact(values), atol=1e-12)


def test_least_squares_is_exact_on_a_complete_table_and_on_additive_games():
    values = np.random.default_rng(1).normal(size=1 << 6)
    np.testing.assert_allclose(shapley_least_squares(values, np.arange(1 << 6)), shapley_exact(values), atol=1e-12)
    weights = [-0.3, 0.2, 0.0, 0.7, -0.1, 0.05, 0.4, -0.6]
    plan = make_plan(8, 8, "adaptive", seed=2)
    np.testing.assert_allclose(shapley_least_squares(additive(weights), plan.round_coalitions(4)), weights,
                               atol=1e-12)  # two pairs of permutations fit an additive game exactly


def test_least_squares_converges_to_exact_shapley_as_coalitions_are_added():
    # a random game with interactions of every order, K=7 (128 coalitions): the fit's error shrinks as pairs are
    # added and vanishes once every coalition is in; efficiency holds exactly at every budget
    rng = np.random.default_rng(5)
    values = rng.normal(size=1 << 7)
    exact = shapley_exact(values)
    err = {}
    for budget in (4, 16, 128):
        e = []
        for seed in range(20):
            plan = make_plan(7, budget, "adaptive", seed=seed)
            phi = shapley_least_squares(values, plan.round_coalitions(budget))
            assert phi.sum() == pytest.approx(values[-1] - values[0])
            e.append(np.abs(phi - exact).mean())
        err[budget] = np.mean(e)
    assert err[4] > err[16] > err[128]
    np.testing.assert_allclose(shapley_least_squares(values, np.arange(1 << 7)), exact, atol=1e-12)


def test_a_case_stopped_by_the_cap_reports_the_least_squares_fit():
    # player 0 sits on the threshold through a three-way interaction (0, 1 and 2 together add -0.75, a third each),
    # so its pair draws vary and the case runs to the cap; its attributions are then the fit to every coalition the
    # case evaluated, not the permutation mean
    w = [0.0, 0.5, 0.125, -1.0, 0.0]
    values = table(5, lambda m: sum(x for i, x in enumerate(w) if m >> i & 1) - (0.75 if (m & 7) == 7 else 0.0))
    assert shapley_exact(values)[0] == pytest.approx(-0.25)
    st, _ = run_case(values, permutations=16, round_size=8, tau=0.25)
    assert st.stop == "cap" and st.used == 16
    fit = shapley_least_squares(st.values, st.plan.round_coalitions(16))
    mean, se, _ = estimate(st.values, st.plan.permutations[:16], antithetic=True)
    np.testing.assert_allclose(st.phi, fit)
    np.testing.assert_allclose(st.se, se)  # the SE reported stays the permutation mean's
    assert not np.allclose(fit, mean)


def test_adaptive_audit_reports_permutations_and_stop_reason(tmp_path):
    pools, queries, files = InputSpec().load()
    cfg = AuditConfig(executor="local", dense="off", estimator="adaptive", permutations=32, top_k=8,
                      adaptive_rule="separation")
    ex = LocalPool(AgentWorker(cfg.agent_spec))
    result = run_audit(pools, queries, cfg, tmp_path / "out", ex, "reader-test", files, progress=False)
    att = pl.read_parquet(tmp_path / "out" / "attributions")
    assert (att["estimator"] == "adaptive").all()
    assert set(att["stop_reason"].unique()) <= {"separation", "cap"}
    assert att["permutations"].is_in([8, 16, 24, 32]).all()
    util = pl.read_parquet(tmp_path / "out" / "utilities")
    assert util.select(["query_id", "coalition"]).is_duplicated().sum() == 0  # rounds add only new coalitions
    assert result.evaluated == util.height and result.max_evaluations < 256


def sparse_game(k, seed):
    """A {0,1} game on K players where only players 0-3 matter, through interactions of every order (the others are
    null): the kind of case `correct` mode gives, with marginals in {-1, 0, 1}."""
    r = np.random.default_rng(seed).integers(0, 2, size=16).astype(float)
    return table(k, lambda m: r[m & 15])


@pytest.mark.parametrize("seed", range(8))
def test_check_rule_gives_exact_values_when_few_players_matter(seed):
    # with the nulls held present the restricted game over the relevant players is the game itself, so once the
    # screen saw every player that matters the check stops with exact enumeration's values, at a fraction of 2^K
    values = sparse_game(10, seed)
    st, asked = run_case(values, permutations=96, tau=0.05, seed=seed, rule="check")
    exact = shapley_exact(values)
    assert st.stop == "explained"
    np.testing.assert_allclose(st.phi, exact, atol=1e-12)
    assert st.evaluations < 300 and len(asked) >= 2  # the screen's round(s), then the enumeration


def test_check_rule_is_not_fooled_where_the_separation_rule_is():
    # Over seeds, the separation rule trusts a pair SE from 4-8 {0,1} draws and reports a harmful set different from
    # exact enumeration's on some games; the check rule matches it on every one (same games, same seeds)
    wrong_sep = wrong_check = 0
    for seed in range(40):
        values = sparse_game(10, 100 + seed)
        harm = shapley_exact(values) < -0.05
        sep, _ = run_case(values, permutations=96, tau=0.05, seed=seed, rule="separation")
        chk, _ = run_case(values, permutations=96, tau=0.05, seed=seed, rule="check")
        wrong_sep += not np.array_equal(sep.phi < -0.05, harm)
        wrong_check += not np.array_equal(chk.phi < -0.05, harm)
    assert wrong_check == 0 and wrong_sep >= 1


def test_check_rule_is_the_default_and_is_validated():
    assert make_plan(6, 16, "adaptive").rule == "check" and AuditConfig(estimator="adaptive").adaptive_rule == "check"
    with pytest.raises(ConfigError, match="adaptive_rule='variance'"):
        AuditConfig(estimator="adaptive", adaptive_rule="variance")
    with pytest.raises(ConfigError, match="allowed"):
        make_plan(6, 16, "adaptive", rule="variance")
