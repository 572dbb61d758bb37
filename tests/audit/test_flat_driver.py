"""The driver's memory is flat in the number of queries (issue 9, item 2): a bounded window of cases in flight,
reductions streamed to part files as cases finish, sparse value tables for sampled plans, the resume cache read one
pool at a time. Asserted by counts the driver exposes, not by timing or RSS."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from pipeline.agents.reader import ReaderAgent
from pipeline.audit.reduce import CaseState
from pipeline.audit.run import AuditConfig, InputSpec, run_audit
from pipeline.audit.worker import AgentWorker
from pipeline.exec.pools import LocalPool
from pipeline.game import SparseTable, make_plan
from pipeline.game.attribution import interactions_from_evaluated, shapley_permutation
from pipeline.game.plan import prefix_masks
from pipeline.store.reuse import PoolReuse, previous_utilities

REDUCTIONS = ("contexts", "attributions", "interactions", "clearances", "errors")
VOLATILE = ("run_id",)


def audit(out, window=None, **overrides):
    pools, queries, files = InputSpec().load()  # 36 queries in 4 pools
    cfg = AuditConfig(**({"executor": "local", "dense": "off"} | overrides))
    agent = ReaderAgent()
    pool = LocalPool(AgentWorker(cfg.agent_spec, agent))
    return run_audit(pools, queries, cfg, out, pool, agent.fingerprint(), files, progress=False, window=window)


def rows(out, name):
    df = pl.read_parquet(out / name)
    df = df.drop([c for c in VOLATILE if c in df.columns])
    return df.sort(df.columns).to_dicts()


def test_case_states_alive_never_exceed_the_window_and_rows_equal_a_whole_pool_window(tmp_path):
    small = audit(tmp_path / "small", window=3)
    assert small.cases == 36 and small.window == 3
    assert small.peak_cases_in_flight == 3  # filled, and never above: 12 times fewer states than cases
    whole = audit(tmp_path / "whole", window=1000)
    # admitted as retrieval freezes them (a pool at a time, evaluation not waiting for later pools): never all 36
    # at once here, but far more than the small window
    assert 3 < whole.peak_cases_in_flight <= 36
    for name in REDUCTIONS:
        assert rows(tmp_path / "small", name) == rows(tmp_path / "whole", name), name
    assert (small.harmful, small.recovered, small.failing) == (whole.harmful, whole.recovered, whole.failing)


def test_default_window_is_bounded_by_the_workers_not_the_pool(tmp_path):
    result = audit(tmp_path / "out")
    # one in-process worker, one task at a time, 256 coalitions a task / 32 a case, 4 tasks' worth: 32 cases
    assert result.window == 32 and result.peak_cases_in_flight <= 32 < result.cases


def test_a_rerun_with_other_settings_leaves_only_its_own_rows(tmp_path):
    out = tmp_path / "out"
    first = audit(out, utility="correct")
    second = audit(out, utility="probability")
    assert first.run_id != second.run_id
    for name in REDUCTIONS:
        ids = pl.read_parquet(out / name)["run_id"].unique().to_list()
        assert ids in ([second.run_id], []), (name, ids)
        assert all(p.name.startswith("part-") for p in (out / name).glob("*.parquet"))
    assert pl.read_parquet(out / "clearances").height == 36
    third = audit(out, utility="probability")  # same run again: nothing evaluated, no row twice
    assert third.evaluated == 0 and third.reused == second.evaluated
    assert pl.read_parquet(out / "attributions").height == 36 * 5
    assert rows(out, "attributions") == sorted(rows(out, "attributions"), key=lambda r: list(r.values()))


def test_resume_cache_is_read_once_per_pool_and_equals_the_whole_read(sample_audit):
    out = sample_audit.run()
    whole = previous_utilities([out], _fingerprint(), "probability")
    reuse = PoolReuse([out], _fingerprint(), "probability")
    pools, queries, _ = InputSpec().load()
    got = {}
    for q in sorted(queries, key=lambda q: q.pool_id):
        for key in [k for k in whole if k[:2] == (q.pool_id, q.query_id)]:
            got[key] = reuse.get(key)
    assert reuse.reads == len(pools) == 4
    assert got.keys() == whole.keys()
    for key, (masks, util, _, _) in whole.items():
        order_a, order_b = np.argsort(masks), np.argsort(got[key][0])
        np.testing.assert_array_equal(masks[order_a], got[key][0][order_b])
        np.testing.assert_array_equal(util[order_a], got[key][1][order_b])


def _fingerprint() -> str:
    return ReaderAgent().fingerprint()


def test_sparse_table_answers_like_the_dense_array():
    rng = np.random.default_rng(0)
    k = 10
    dense = np.full(1 << k, np.nan)
    sparse = SparseTable(k)
    masks = rng.choice(1 << k, 150, replace=False)
    dense[masks] = rng.random(150)
    sparse[masks] = dense[masks]
    sparse[masks[:5]] = 0.5  # overwrite, as a dense assignment would
    dense[masks[:5]] = 0.5
    probe = rng.integers(0, 1 << k, (7, 40))
    np.testing.assert_array_equal(sparse[probe], dense[probe])
    assert np.isnan(sparse[int(np.flatnonzero(np.isnan(dense))[0])])
    assert sparse.size == dense.size and sparse.nbytes == 150 * 16  # overwritten masks are stored once


@pytest.mark.parametrize("k", [6, 12])
def test_sampled_plans_store_only_their_coalitions_and_estimate_as_dense(k):
    from pipeline.audit.cases import Case
    from pipeline.io.records import Query
    from pipeline.retrieval.frozen import FrozenContext

    plan = make_plan(k, 16, "permutation", seed=3)
    ctx = FrozenContext("p", "q", tuple(f"m{i}" for i in range(k)), ("t",) * k, (0.0,) * k, tuple(range(1, k + 1)),
                        (None,) * k, "h")
    st = CaseState(Case(Query("q", "p", "?", "a", ("a", "b")), ctx, 3), plan)
    assert isinstance(st.values, SparseTable)
    v = np.random.default_rng(1).random(1 << k)
    need = st.estimator_needs()
    st.record(need, v[need], np.zeros(len(need), dtype=bool))
    assert st.values.nbytes == 16 * len(np.unique(need)) <= 16 * (16 * (k - 1) + 2)  # only the plan's coalitions
    if k == 12:
        assert st.values.nbytes < (8 * (1 << k)) / 10  # a tenth of the dense table's 32 KiB
    dense = np.full(1 << k, np.nan)
    dense[need] = v[need]
    for a, b in zip(shapley_permutation(st.values, plan.permutations), shapley_permutation(dense, plan.permutations)):
        np.testing.assert_allclose(a, b)
    for a, b in zip(interactions_from_evaluated(st.values), interactions_from_evaluated(dense)):
        np.testing.assert_array_equal(a, b)
    assert set(prefix_masks(plan.permutations).ravel()) <= set(st.values.keys.tolist())


def test_a_killed_driver_keeps_every_case_it_finished(tmp_path, sample_audit):
    """Reductions are streamed as cases finish: after SIGKILL mid-run, clearances/ and attributions/ hold the cases
    finished before the kill, with the rows an undisturbed run writes for them."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from tests.audit.test_resume_and_out import DYING_DRIVER

    whole = sample_audit.run(utility="correct", batch_size=32)  # undisturbed, DYING_DRIVER's settings
    out = tmp_path / "killed"
    env = os.environ | {"PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.run([sys.executable, "-c", DYING_DRIVER, str(out), "12"], env=env, capture_output=True,
                          timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    done = pl.read_parquet(out / "clearances")
    assert 0 < done.height < 36
    for name in ("clearances", "attributions"):
        got = pl.read_parquet(out / name).drop("run_id")
        want = pl.read_parquet(whole / name).drop("run_id").join(done.select("pool_id", "query_id"),
                                                                 on=["pool_id", "query_id"], how="semi")
        assert got.sort(got.columns).equals(want.sort(want.columns)), name
