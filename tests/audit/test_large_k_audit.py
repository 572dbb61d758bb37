"""`meclear audit` beyond K=20 (issue 30, item 4): a LoCoMo conversation at K=32 and K=63 under a budget, sampled
estimators only, every query within its budget, rows for every one of the K memories; exact refused above its cap."""

from __future__ import annotations

import json

import polars as pl
import pytest

from pipeline.cli.main import main
from tests.data_paths import LOCOMO


@pytest.mark.parametrize("k", [32, 63])
def test_audit_at_large_k_under_a_budget(tmp_path, k):
    if not LOCOMO.exists():
        pytest.skip(f"needs LoCoMo at {LOCOMO}")
    out = tmp_path / f"k{k}"
    rc = main(["audit", "--locomo", str(LOCOMO), "--conversations", "conv-26", "--max-queries", "6", "--top-k", str(k),
               "--budget", "256", "--utility", "correct", "--out", str(out), "--executor", "local", "--dense", "off",
               "--no-progress"])
    assert rc == 0
    cl = pl.read_parquet(out / "clearances")
    att = pl.read_parquet(out / "attributions")
    assert cl.height == 6 and (cl["evaluations"] <= 256).all()
    per_query = att.group_by("query_id").agg(pl.col("position").sort())
    assert all(p.to_list() == list(range(k)) for p in per_query["position"])
    # `auto` under this budget: the sparse surrogate's Shapley values (never exact above K=20; 256 < 2^K / 4)
    assert set(att["estimator"].unique()) == set(cl["estimator"].unique()) == {"sparseshap"}
    inter = pl.read_parquet(out / "interactions")
    assert inter.height == 6 * k * (k - 1) // 2
    util = pl.read_parquet(out / "utilities")
    assert util["coalition"].min() >= 0 and util["coalition"].max() <= (1 << k) - 1
    counts = json.loads((out / "manifest.json").read_text())["counts"]
    assert counts["max_evaluations_per_case"] <= 256


def test_exact_above_its_cap_is_one_line_exit_2(tmp_path, capsys):
    out = tmp_path / "x"
    rc = main(["audit", "--top-k", "21", "--estimator", "exact", "--budget", str(1 << 22), "--out", str(out),
               "--executor", "local", "--dense", "off", "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "exact" in err and not out.exists()


def test_auto_at_a_small_correct_budget_runs_without_the_loo_screen(tmp_path):
    """K=20, 64 evaluations, `correct`: `auto` drops the LOO screen (pipeline.game.plan.auto_measures_loo). The
    `loo` columns are null, the first pass asks no leave-one-out coalition, no clearance is a (no longer free) single
    removal or LOO's, every query stays within its budget, and the manifest counts the cases."""
    if not LOCOMO.exists():
        pytest.skip(f"needs LoCoMo at {LOCOMO}")
    out = tmp_path / "lean"
    rc = main(["audit", "--locomo", str(LOCOMO), "--conversations", "conv-26", "--max-queries", "8", "--top-k", "20",
               "--budget", "64", "--utility", "correct", "--out", str(out), "--executor", "local", "--dense", "off",
               "--no-progress"])
    assert rc == 0
    att, cl = pl.read_parquet(out / "attributions"), pl.read_parquet(out / "clearances")
    assert cl.height == 8 and (cl["evaluations"] <= 64).all()
    assert att["loo"].null_count() == att["loo_inconclusive"].null_count() == att.height == 8 * 20
    assert att["shapley"].null_count() == 0 and set(att["estimator"].unique()) == {"sparseshap"}
    assert set(cl["source"].drop_nulls().unique()) <= {"shapley", "surrogate", "unchanged"}
    util = pl.read_parquet(out / "utilities")
    plan = util.filter(pl.col("stage") == "plan")
    assert plan.filter(pl.col("size") == 19).height == 0  # no N minus one memory in the first pass
    assert plan.group_by("query_id").len()["len"].max() <= 64
    counts = json.loads((out / "manifest.json").read_text())["counts"]
    assert counts["cases_without_loo"] == 8
    # the report (its figures draw LOO bars) takes the null column: the memory tables show LOO blank
    assert main(["report", str(out), "--figures", "all", "--no-progress"]) == 0
    page = (out / "report.html").read_text()
    assert '"loo": null' in page or '"loo":null' in page
    # the same run at 8 evaluations per memory keeps the screen: every `loo` measured
    out2 = tmp_path / "screened"
    assert main(["audit", "--locomo", str(LOCOMO), "--conversations", "conv-26", "--max-queries", "8", "--top-k", "20",
                 "--budget", "160", "--utility", "correct", "--out", str(out2), "--executor", "local", "--dense",
                 "off", "--no-progress"]) == 0
    assert pl.read_parquet(out2 / "attributions")["loo"].null_count() == 0
    assert json.loads((out2 / "manifest.json").read_text())["counts"]["cases_without_loo"] == 0
