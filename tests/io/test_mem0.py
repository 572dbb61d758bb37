"""The mem0 export loader: the fixture loads (user_id = pool), malformed rows give one-line errors naming file, row
and field, and an audit runs from it through the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest

from pipeline.cli.main import main
from pipeline.core.errors import InputError
from pipeline.io.mem0 import load_mem0

FIXTURE = Path(__file__).parents[1] / "fixtures" / "mem0"


def test_fixture_loads_as_pools_by_user():
    pools = load_mem0(FIXTURE / "export.json")
    assert sorted(pools) == ["maya", "tomas"]
    maya = pools["maya"].memories
    assert [m.memory_id for m in maya] == [f"5f0c1a52-000{i}" for i in range(1, 6)]
    assert maya[0].text == "Maya keeps bees on the roof of her apartment building"
    assert maya[0].timestamp == "2025-03-02T09:14:00-08:00" and maya[0].metadata == {"source": "chat"}
    assert maya[1].metadata is None


def test_list_and_jsonl_layouts_load_the_same(tmp_path):
    records = json.loads((FIXTURE / "export.json").read_text())["results"]
    (tmp_path / "list.json").write_text(json.dumps(records))
    (tmp_path / "export.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    ref = load_mem0(FIXTURE / "export.json")
    for name in ("list.json", "export.jsonl"):
        got = load_mem0(tmp_path / name)
        assert {k: p.memories for k, p in got.items()} == {k: p.memories for k, p in ref.items()}


@pytest.mark.parametrize(
    "edit, where, field, problem",
    [
        ({"memory": ""}, "row 2", "memory", "is empty"),
        ({"memory": None}, "row 2", "memory", "is missing"),
        ({"id": ["x"]}, "row 2", "id", "must be a string"),
        ({"user_id": None}, "row 2", "user_id", "is missing"),
        ({"metadata": "tags"}, "row 2", "metadata", "must be an object"),
        ({"id": "5f0c1a52-0001"}, "row 2", "id", "repeats for user 'maya'"),
    ],
)
def test_malformed_rows_name_file_row_and_field(tmp_path, edit, where, field, problem):
    records = json.loads((FIXTURE / "export.json").read_text())["results"]
    records[2] = {**records[2], **edit}
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"results": records}))
    with pytest.raises(InputError) as exc:
        load_mem0(bad)
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith(f"{bad}:{where}: field '{field}'") and problem in msg


def test_malformed_jsonl_line_and_layout(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "memory": "x", "user_id": "u"}\n{not json}\n')
    with pytest.raises(InputError, match=r"bad\.jsonl:line 2: is not valid JSON"):
        load_mem0(bad)
    obj = tmp_path / "obj.json"
    obj.write_text('{"data": []}')
    with pytest.raises(InputError, match="'results' list"):
        load_mem0(obj)


def test_audit_from_a_mem0_export(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["audit", "--mem0", str(FIXTURE / "export.json"), "--queries", str(FIXTURE / "queries.jsonl"),
                 "--executor", "local", "--dense", "off", "--top-k", "3", "--out", str(out), "--no-progress"]) == 0
    cl = pl.read_parquet(out / "clearances").sort("query_id")
    q1 = cl.filter(pl.col("query_id") == "maya-q1").row(0, named=True)
    assert q1["cleared"] == ["5f0c1a52-0003"] and q1["recovered"] is True  # the stale clover-honey memory
    assert q1["answer_before"] == "clover honey" and q1["answer_after"] == q1["gold"] == "wildflower honey"
    assert cl.filter(pl.col("query_id") != "maya-q1")["recovered"].is_null().all()
    bad = tmp_path / "bad.json"
    bad.write_text('[{"id": "1", "memory": "m", "user_id": "maya"}, {"id": "2", "user_id": "maya"}]')
    capsys.readouterr()
    assert main(["audit", "--mem0", str(bad), "--queries", str(FIXTURE / "queries.jsonl"), "--executor", "local",
                 "--out", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"meclear: error: {bad}:row 1: field 'memory' is missing (required)"
    assert not (tmp_path / "none").exists()
