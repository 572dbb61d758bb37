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
