"""The adaptive permutation estimator (Appendix B): stops by separation on games whose values are clear of -tau, runs
to the cap when a value sits on the threshold; through the driver, each case reports its permutations and stop."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from pipeline.audit import AuditConfig, InputSpec, run_audit
from pipeline.cases import Case
from pipeline.errors import ConfigError
from pipeline.evaluate import AgentWorker
from pipeline.pools import LocalPool
from pipeline.game import make_plan, shapley_exact
from pipeline.game.adaptive import separated, stop_reason
from pipeline.io.records import Query
from pipeline.reduce import CaseState, attribute
from pipeline.retrieval import FrozenContext


def table(k, v):
    return np.array([v(m) for m in range(1 << k)], dtype=float)


def additive(weights):
    return table(len(weights), lambda m: sum(w for i, w in enumerate(weights) if m >> i & 1))


def run_case(values, permutations=64, round_size=8, tau=0.25, seed=0):
    """Drive one CaseState as the audit driver does, answering coalitions from a closed-form value table."""
    k = values.size.bit_length() - 1
    ctx = FrozenContext("p", "q", tuple(f"m{i}" for i in range(k)), ("t",) * k, (0.0,) * k, tuple(range(1, k + 1)),
                        (None,) * k, "h")
    st = CaseState(Case(Query("q", "p", "?", "a", ("a", "b")), ctx, seed),
                   make_plan(k, permutations, "adaptive", seed=seed, round_size=round_size))
    asked = []
    need = st.missing(st.plan_coalitions())
    while len(need):
        asked.append(len(need))
        st.record(need, values[need], np.zeros(len(need), dtype=bool))
        need = st.next_round(tau)
    attribute(st, tau)
    return st, asked


def test_stops_after_one_round_when_every_value_is_clear_of_the_threshold():
    values = additive([-1.0, 0.5, 0.0, 0.125, -0.5, 0.25, 0.0, 1.0, -0.75, 0.0])  # K=10; phi = weights, SE = 0
    st, asked = run_case(values)
    assert st.stop == "separation" and st.used == 8 and len(asked) == 1
    np.testing.assert_allclose(st.phi, shapley_exact(values))
    assert st.evaluations <= 8 * 9 + 2 < 1024  # far below exact enumeration


def test_stops_by_separation_on_an_interaction_game_with_noisy_draws():
    # v = -1 if players 0 and 1 are both in: each draws 0 or -1 (phi = -0.5, SE > 0), player 2 is null
    values = table(3, lambda m: -1.0 if (m & 3) == 3 else 0.0)
    st, _ = run_case(values, tau=0.05)
    assert st.stop == "separation" and st.used < 64
    assert (st.se[:2] > 0).all() and separated(st.phi, st.se, 0.05).all()
    assert list(st.ranking) in ([0, 1], [1, 0])


def test_runs_to_the_cap_when_a_value_sits_on_the_threshold():
    # player 0 contributes exactly -tau in every permutation (binary fractions: exact in floating point)
    values = additive([-0.25, 0.5, 0.125, -1.0, 0.0])
    st, asked = run_case(values, permutations=40, round_size=8, tau=0.25)
    assert st.stop == "cap" and st.used == 40
    assert not separated(st.phi, st.se, 0.25)[0] and separated(st.phi, st.se, 0.25)[1:].all()


def test_stop_rule_minimum_and_cap():
    phi, se = np.array([-1.0, 0.0]), np.zeros(2)
    assert stop_reason(phi, se, 0.05, used=4, cap=64, min_draws=8) is None  # too few draws to trust SE = 0
    assert stop_reason(phi, se, 0.05, used=8, cap=64, min_draws=8) == "separation"
    assert stop_reason(np.array([-0.05]), np.array([0.1]), 0.05, used=64, cap=64, min_draws=8) == "cap"
    with pytest.raises(ConfigError):
        make_plan(5, 16, "adaptive", round_size=1)
    with pytest.raises(ConfigError):
        AuditConfig(estimator="adaptive", adaptive_round=1)


def test_adaptive_audit_reports_permutations_and_stop_reason(tmp_path):
    pools, queries, files = InputSpec().load()
    cfg = AuditConfig(executor="local", dense="off", estimator="adaptive", permutations=32, top_k=8)
    ex = LocalPool(AgentWorker(cfg.agent_spec))
    result = run_audit(pools, queries, cfg, tmp_path / "out", ex, "reader-test", files, progress=False)
    att = pl.read_parquet(tmp_path / "out" / "attributions")
    assert (att["estimator"] == "adaptive").all()
    assert set(att["stop_reason"].unique()) <= {"separation", "cap"}
    assert att["permutations"].is_in([8, 16, 24, 32]).all()
    util = pl.read_parquet(tmp_path / "out" / "utilities")
    assert util.select(["query_id", "coalition"]).is_duplicated().sum() == 0  # rounds add only new coalitions
    assert result.evaluated == util.height and result.max_evaluations < 256
