"""The audit's verified clearance over several rankings (issue 30, item 1): in `correct` mode under a budget the
candidates come from the Shapley chain, the free sparse surrogate, LOO and single removals, inside the budget; every
row says which ranking proposed its clearance; a family that contains the Shapley chain never recovers fewer cases
nor clears more memories than the chain alone on the same estimates. `probability` mode prefers the chain: the other
rankings' candidates are chosen only where the chain clears nothing."""

from __future__ import annotations

import json

import polars as pl
import pyarrow.parquet as pq
import pytest

from pipeline.agents.reader import ReaderAgent
from pipeline.audit import worker as worker_module
from pipeline.audit.run import AuditConfig, InputSpec, run_audit
from pipeline.audit.worker import AgentWorker
from pipeline.exec.pools import LocalPool
from pipeline.game.clearance import RANKINGS, SINGLES, UNCHANGED, clearance_rankings, primary_ranking
from pipeline.store import parts
from pipeline.store.manifest import SchemaVersionError
from pipeline.store.schemas import CLEARANCES
from pipeline.store.writer import write_part
from tests.data_paths import LOCOMO

SOURCES = {*RANKINGS, SINGLES, UNCHANGED}


def run(tmp_path, name, spec: InputSpec, **overrides):
    pools, queries, files = spec.load()
    cfg = AuditConfig(**({"executor": "local", "dense": "off"} | overrides))
    agent = ReaderAgent()
    ex = LocalPool(AgentWorker(cfg.agent_spec, agent))
    result = run_audit(pools, queries, cfg, tmp_path / name, ex, agent.fingerprint(), files, progress=False)
    return result, tmp_path / name


def test_the_rule_by_mode():
    assert clearance_rankings("correct", budgeted=True) == RANKINGS
    assert clearance_rankings("probability", budgeted=True) == RANKINGS
    assert clearance_rankings("correct", budgeted=False) == clearance_rankings("probability", False) == ("shapley",)
    assert primary_ranking("probability") == "shapley" and primary_ranking("correct") is None


@pytest.fixture(scope="module")
def locomo_runs(tmp_path_factory):
    """One LoCoMo conversation at K=10, B=64, `correct`: the shipped clearance (several rankings) and the Shapley
    chain alone, on the same cases, estimator and seed (the chain run patches the rule the worker reads)."""
    if not LOCOMO.exists():
        pytest.skip(f"needs LoCoMo at {LOCOMO}")
    tmp = tmp_path_factory.mktemp("multi")
    # kernelshap, not `auto`: with it the Shapley chain leaves cases to the other rankings, which is what these tests
    # check (with `sparseshap`, auto's choice here since issue 30 item 2, the chain itself clears those cases)
    return shipped_and_chain(tmp, utility="correct")


def shipped_and_chain(tmp, utility: str):
    """conv-26's first 60 queries at K=10, B=64, kernelshap: the shipped clearance and the Shapley chain alone (the
    chain run patches the rule the worker reads), on the same cases, estimates and seed. Returns both run folders."""
    spec = InputSpec(locomo=str(LOCOMO), conversations=("conv-26",), max_queries=60)
    settings = {"top_k": 10, "budget": 64, "utility": utility, "estimator": "kernelshap"}
    _, multi_out = run(tmp, "multi", spec, **settings)
    mp = pytest.MonkeyPatch()
    mp.setattr(worker_module, "clearance_rankings", lambda utility, budgeted: ("shapley",))
    try:
        _, chain_out = run(tmp, "chain", spec, **settings)
    finally:
        mp.undo()
    return multi_out, chain_out


def test_every_row_names_its_ranking_and_stays_in_budget(locomo_runs):
    multi_out, chain_out = locomo_runs
    cl = pl.read_parquet(multi_out / "clearances")
    assert set(cl["source"].unique()) <= SOURCES
    assert (cl["source"] == "surrogate").any()  # this conversation's first 60 queries have two (deterministic reader)
    assert ((cl["source"] == UNCHANGED) == (cl["cleared"].list.len() == 0)).all()
    assert (cl["evaluations"] <= 64).all()
    # the chain run never names another ranking
    chain = pl.read_parquet(chain_out / "clearances")
    assert set(chain["source"].unique()) <= {"shapley", UNCHANGED}
    # the manifest counts the non-empty clearances by ranking
    counts = json.loads((multi_out / "manifest.json").read_text())["counts"]
    by_source = cl.filter(pl.col("cleared").list.len() > 0)["source"].value_counts()
    for src in (*RANKINGS, SINGLES):
        want = by_source.filter(pl.col("source") == src)["count"].sum()
        assert counts[f"cleared_by_{src}"] == want


def test_theorem_2_on_the_rows(locomo_runs):
    """Non-negative gain, and a clearance is only chosen with the gold answer on what is kept (verified): read back
    from utilities/, the agent's own outputs on the kept context."""
    multi_out, _ = locomo_runs
    cl = pl.read_parquet(multi_out / "clearances")
    ctx = pl.read_parquet(multi_out / "contexts")
    util = pl.read_parquet(multi_out / "utilities")
    assert (cl["gain"] >= 0).all()
    for row in cl.filter(pl.col("cleared").list.len() > 0).iter_rows(named=True):
        pos = dict(ctx.filter(pl.col("query_id") == row["query_id"]).select("memory_id", "position").iter_rows())
        k = len(pos)
        kept = ((1 << k) - 1) & ~sum(1 << pos[m] for m in row["cleared"])
        u = util.filter((pl.col("query_id") == row["query_id"]) & (pl.col("coalition") == kept))
        assert u.height == 1 and u["correct"][0]
        assert u["utility"][0] == pytest.approx(row["cleared_utility"])
        assert row["gain"] > 0


def test_more_rankings_never_recover_less_nor_clear_more(locomo_runs):
    multi_out, chain_out = locomo_runs
    a = pl.read_parquet(multi_out / "clearances").select("query_id", "recovered", "cleared", "source")
    b = pl.read_parquet(chain_out / "clearances").select("query_id", "recovered", "cleared")
    j = a.join(b, on="query_id", suffix="_chain")
    assert j.height == a.height == b.height > 0
    for r in j.iter_rows(named=True):
        if r["recovered_chain"]:
            assert r["recovered"], r["query_id"]
            if r["recovered"]:
                assert len(r["cleared"]) <= len(r["cleared_chain"]), r["query_id"]
    rec_multi = int(j["recovered"].fill_null(False).sum())
    rec_chain = int(j["recovered_chain"].fill_null(False).sum())
    assert rec_multi >= rec_chain


def test_probability_mode_prefers_the_shapley_chain(tmp_path):
    """Same cases, estimates and seed, `probability`, B=64: wherever the chain alone clears, the shipped clearance
    clears the same set from the chain; another ranking's candidate appears only where the chain cleared nothing."""
    if not LOCOMO.exists():
        pytest.skip(f"needs LoCoMo at {LOCOMO}")
    multi_out, chain_out = shipped_and_chain(tmp_path, utility="probability")
    a = pl.read_parquet(multi_out / "clearances").select("query_id", "cleared", "source", "gain", "evaluations",
                                                         "baseline_correct", "recovered")
    b = pl.read_parquet(chain_out / "clearances").select("query_id", "cleared", "source")
    j = a.join(b, on="query_id", suffix="_chain")
    assert j.height == a.height == b.height > 0
    assert (j["evaluations"] <= 64).all()
    for r in j.iter_rows(named=True):
        if r["source_chain"] == "shapley":
            assert (r["cleared"], r["source"]) == (r["cleared_chain"], "shapley"), r["query_id"]
        elif r["source"] != UNCHANGED:
            assert r["source"] in {"surrogate", "loo", SINGLES} and r["gain"] > 0, r["query_id"]
            assert r["source_chain"] == UNCHANGED and not r["baseline_correct"] and r["recovered"], r["query_id"]
    assert (j["source_chain"] == "shapley").any()
    assert (j["source"].is_in(["surrogate", "loo", SINGLES])).any()  # the fallback does clear on this conversation


def test_a_part_written_before_the_source_column_still_reads(tmp_path):
    """Run folders written before `source` existed still resume, report and serve as --previous: their parts lack
    the column and read back with nulls beside new parts that have it."""
    _, out = run(tmp_path, "c", InputSpec(), budget=20, utility="correct")
    new = pl.read_parquet(out / "clearances")
    folder = tmp_path / "mixed" / "clearances"
    folder.mkdir(parents=True)
    for f in (out / "clearances").glob("*.parquet"):
        (folder / f.name).write_bytes(f.read_bytes())
    old = pq.read_table(sorted((out / "clearances").glob("*.parquet"))[0]).drop_columns(["source"])
    legacy = write_part(old, folder, prefix="part-01d")
    parts.check_schema(legacy, CLEARANCES)  # a missing added column is not a version error
    df = parts.read_dataset(tmp_path / "mixed", "clearances", CLEARANCES)
    assert df.height == new.height + old.num_rows
    assert df.columns == CLEARANCES.names
    assert df["source"].null_count() == old.num_rows
    assert df["source"].drop_nulls().is_in(list(SOURCES)).all()
    # a column that was never optional is still refused, by name
    (tmp_path / "bad").mkdir()
    bad = write_part(old.drop_columns(["gain"]), tmp_path / "bad", prefix="part-bad")
    with pytest.raises(SchemaVersionError, match="no column 'gain'"):
        parts.check_schema(bad, CLEARANCES)


def test_the_report_shows_the_chosen_candidate_of_any_ranking(locomo_runs):
    """The report's candidate table lists the Shapley chain; a clearance another ranking proposed is added to it,
    marked chosen and named, so every cleared query shows exactly one chosen candidate: the one in clearances/."""
    from pipeline.report.data import load_run, query_records

    multi_out, _ = locomo_runs
    records = query_records(load_run(multi_out))
    cleared = [r for r in records if r["cleared"]]
    assert cleared
    for r in cleared:
        chosen = [c for c in r["candidates"] if c["chosen"]]
        assert len(chosen) == 1 and sorted(chosen[0]["removed"]) == sorted(r["cleared"]), r["query"]
        assert chosen[0]["source"] == r["source"] and chosen[0]["correct"] is True
        assert chosen[0]["utility"] == pytest.approx(r["cleared_utility"])
