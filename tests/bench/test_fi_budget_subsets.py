"""jobs/fi_budget_subsets.py: per-subset budget curves of a finished run, and runs over disjoint conversations joined
(a long LLM run split by --conversations): the same numbers as one run holding every row, and a conversation, case or
run folder given twice refused, whatever the working directory."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import polars as pl
import pytest

from pipeline.bench.curves import budget_curves

ROOT = Path(__file__).resolve().parents[2]
METHODS = ("auto_b32", "contextcite_b32")
CONFIG = {"methods": list(METHODS), "utility": ["correct"], "replicates": 50, "seed": 0, "top_k": 10,
          "conversations": []}


def _job():
    spec = importlib.util.spec_from_file_location("fi_budget_subsets", ROOT / "jobs" / "fi_budget_subsets.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _rows(conversations: list[str]) -> list[dict]:
    """Four cases per conversation; the default clears the fault on three of them, ContextCite on one."""
    rows = []
    for conv in conversations:
        for i in range(4):
            for method, hit in (("auto_b32", i < 3), ("contextcite_b32", i == 0)):
                rows.append({"case_id": f"{conv}:q{i}:direct", "conversation": conv, "utility": "correct",
                             "method": method, "faults": ["m1"], "cleared": ["m1"] if hit else ["m2"],
                             "full_ranking": ["m1", "m2"], "ranking": ["m1"], "recovered": hit, "evaluations": 30})
    return rows


def _run(folder: Path, conversations: list[str], **config) -> Path:
    folder.mkdir(parents=True)
    pl.DataFrame(_rows(conversations)).write_parquet(folder / "cases.parquet")
    cfg = {**CONFIG, "conversations": conversations, **config}
    (folder / "summary.json").write_text(json.dumps({"config": cfg}))
    return folder


def test_joined_runs_give_the_numbers_of_one_run_with_every_row(tmp_path, monkeypatch, capsys):
    _run(tmp_path / "a", ["conv-1", "conv-2"])
    _run(tmp_path / "b", ["conv-3"])
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # relative paths from another folder
    _job().main(["--run", "../a", "--run", str(tmp_path / "b"), "--subset", "first=conv-1", "--rest", "others",
                 "--out", "joined.json"])
    got = json.loads((elsewhere / "joined.json").read_text())
    assert got["all"]["n_cases"] == 12 and got["all"]["conversations"] == ["conv-1", "conv-2", "conv-3"]
    assert got["others"]["conversations"] == ["conv-2", "conv-3"] and got["others"]["n_cases"] == 8
    want = budget_curves(_rows(["conv-1", "conv-2", "conv-3"]), METHODS, ("correct",), 50, 0, ("contextcite",))
    auto = got["all"]["curves"]["correct"]["all"]["auto"][0]
    assert auto == json.loads(json.dumps(want["correct"]["all"]["auto"][0]))
    assert auto["vs_contextcite"]["task_recovery"]["value"] == pytest.approx(0.75 - 0.25)
    assert "# all: conv-1, conv-2, conv-3 (12 cases)" in capsys.readouterr().out


def test_a_run_folder_given_twice_is_refused_however_it_is_written(tmp_path, monkeypatch):
    _run(tmp_path / "a", ["conv-1"])
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit, match="same folder as --run a: a run given twice"):
        _job().main(["--run", "a", "--run", str(tmp_path / "a" / ".." / "a"), "--out", "x.json"])
    assert not (tmp_path / "x.json").exists()


def test_a_conversation_in_two_runs_is_refused(tmp_path):
    a, b = _run(tmp_path / "a", ["conv-1", "conv-2"]), _run(tmp_path / "b", ["conv-2"])
    with pytest.raises(SystemExit, match="conv-2 is in both --run .*a and --run .*b: joined runs must cover disjoint"):
        _job().main(["--run", str(a), "--run", str(b), "--out", str(tmp_path / "x.json")])
    assert not (tmp_path / "x.json").exists()


def test_runs_with_other_settings_are_refused(tmp_path):
    a, b = _run(tmp_path / "a", ["conv-1"]), _run(tmp_path / "b", ["conv-2"], seed=1, top_k=20)
    with pytest.raises(SystemExit, match=r"differs from --run .*a in seed, top_k \(only conversations may differ"):
        _job().main(["--run", str(a), "--run", str(b), "--out", str(tmp_path / "x.json")])


def test_several_runs_need_an_explicit_out_and_a_finished_run(tmp_path):
    a, b = _run(tmp_path / "a", ["conv-1"]), _run(tmp_path / "b", ["conv-2"])
    with pytest.raises(SystemExit, match="--out is required with several --run folders"):
        _job().main(["--run", str(a), "--run", str(b)])
    assert not (a / "subsets.json").exists()
    (b / "cases.parquet").unlink()
    with pytest.raises(SystemExit, match=r"--run .*b: no cases.parquet \(not a finished"):
        _job().main(["--run", str(a), "--run", str(b), "--out", str(tmp_path / "x.json")])
