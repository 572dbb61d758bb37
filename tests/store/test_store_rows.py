"""Typed rows of every dataset (`pipeline.store.rows`) follow their Arrow schemas, and a run folder whose Parquet lacks
a column that `report` or `curate` reads is one line naming the file and the column (exit 2), never defaults."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import polars as pl
import pytest

from pipeline.cli.main import main
from pipeline.store.rows import ROWS, AttributionRow, UtilityRow, columns
from pipeline.store.schemas import DATASETS


@pytest.mark.parametrize("name", sorted(DATASETS))
def test_each_dataset_has_a_typed_row_with_its_schema_fields_in_order(name):
    assert set(ROWS) == set(DATASETS)
    assert [f.name for f in dataclasses.fields(ROWS[name])] == DATASETS[name].names


def test_a_misspelt_column_is_an_error_where_the_row_is_made():
    with pytest.raises(TypeError, match="shapely"):
        AttributionRow(run_id="r", pool_id="p", query_id="q", memory_id="m", position=0, loo=0.0,
                       loo_inconclusive=True, shapely=0.0, shapley_se=0.0, harmful=False, rank=None,
                       estimator="exact", permutations=0, stop_reason=None)
    cols = {n: [] for n in DATASETS["utilities"].names}
    assert columns(UtilityRow, cols) is cols
    with pytest.raises(TypeError, match=r"unknown \['latency'\], missing \['latency_s'\]"):
        columns(UtilityRow, {**{n: [] for n in cols if n != "latency_s"}, "latency": []})


@pytest.fixture(scope="module")
def audited(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("rows") / "run"
    assert main(["audit", "--out", str(out), "--executor", "local", "--dense", "off", "--no-progress"]) == 0
    return out


@pytest.mark.parametrize("command", ["report", "curate"])
@pytest.mark.parametrize("dataset,column", [("attributions", "shapley"), ("interactions", "label"),
                                            ("clearances", "recovered"), ("contexts", "text"),
                                            ("utilities", "answer")])
def test_a_part_without_a_column_is_one_line_naming_file_and_column(audited, tmp_path, capsys, command, dataset,
                                                                    column):
    run = tmp_path / "run"
    shutil.copytree(audited, run)
    part = sorted((run / dataset).glob("*.parquet"))[0]
    pl.read_parquet(part).drop(column).write_parquet(part)  # rewritten in place, as a user's polars session would
    capsys.readouterr()
    args = ["report", str(run), "--figures", "none", "--out", str(tmp_path / "r.html")] if command == "report" \
        else ["curate", str(run), "--out", str(tmp_path / "c.parquet")]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert str(part) in err and f"no column '{column}'" in err, err
    assert not (tmp_path / "r.html").exists() and not (tmp_path / "c.parquet").exists()
