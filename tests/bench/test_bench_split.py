"""jobs/bench_split.py (issue 30, item 1): the clearance's share of the budget replayed on the same FI-LoCoMo cases;
the audit's rule (`--reserves audit`) against the old constant, on one LoCoMo conversation with the reader."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tests.data_paths import LOCOMO

ROOT = Path(__file__).resolve().parents[2]


def test_the_rule_recovers_at_least_what_the_constant_did(tmp_path, capsys):
    if not LOCOMO.exists():
        pytest.skip(f"needs LoCoMo at {LOCOMO}")
    spec = importlib.util.spec_from_file_location("bench_split", ROOT / "jobs" / "bench_split.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "split.json"
    mod.main(["--locomo", str(LOCOMO), "--conversations", "conv-26", "--budgets", "64", "--reserves", "2,audit",
              "--utility", "correct,probability", "--out", str(out)])
    printed = capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    by = {(r["utility"], r["reserve"], r["audit_rule"]): r for r in rows}
    rule, const = by[("correct", 8, True)], by[("correct", 2, False)]
    assert rule["cases"] == const["cases"] > 20
    assert rule["recovery"] >= const["recovery"] and rule["mean_evaluations"] <= 64
    # probability mode's rule is the constant: the same outcomes
    assert by[("probability", 2, True)]["exact_set_match"] == by[("probability", 2, False)]["exact_set_match"]
    assert "| correct | 64 | 8 (audit) |" in printed and "conv-26" in rule["per_conversation"]
