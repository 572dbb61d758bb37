"""`meclear eval`: a missing optional dependency is found before any work, with the install command; the outputs
appear all together or not at all."""

from __future__ import annotations

import importlib.util

import pytest

from pipeline.bench import report
from pipeline.cli.main import main


def test_missing_matplotlib_fails_before_any_work_with_the_install_command(tmp_path, capsys, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    out = tmp_path / "eval"
    rc = main(["eval", "--locomo", str(tmp_path / "never-read.json"), "--out", str(out), "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1
    assert "needs matplotlib" in err and "pip install -e '.[eval]'" in err
    assert not out.exists()


def test_a_failure_while_rendering_leaves_no_partial_outputs(tmp_path, monkeypatch):
    def broken_figure(summary, path):
        raise RuntimeError("figure failed")

    monkeypatch.setattr(report, "figure", broken_figure)
    with pytest.raises(RuntimeError, match="figure failed"):
        report.write_outputs(tmp_path, [], {"n_cases": 1})
    assert list(tmp_path.iterdir()) == []  # no cases.parquet or summary.json without summary.md and figure.png
