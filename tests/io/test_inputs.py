"""Input validation: every malformed record is a named error with file, line/row and field; exit 2; nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.cli.main import main
from pipeline.core.errors import InputError
from pipeline.io.loaders import load_pools, load_queries
from pipeline.io.locomo import load_locomo
from tests.data_paths import LOCOMO


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


GOOD_MEM = [{"memory_id": "m1", "text": "Ana lives in Lisbon."}, {"memory_id": "m2", "text": "Ana likes tea."}]
GOOD_Q = [{"query_id": "q1", "pool_id": "pool", "question": "Where does Ana live?", "answer": "Lisbon",
           "options": ["Lisbon", "Porto"]}]


@pytest.mark.parametrize(
    "rows, where, field, words",
    [
        ([GOOD_MEM[0], {"text": "no id"}], "line 2", "memory_id", "missing"),
        ([GOOD_MEM[0], {"memory_id": "m2", "text": ""}], "line 2", "text", "empty"),
        ([GOOD_MEM[0], {"memory_id": "m2", "text": 5}], "line 2", "text", "string"),
        ([GOOD_MEM[0], GOOD_MEM[0]], "line 2", "memory_id", "repeats"),
        ([GOOD_MEM[0], "{not json"], "line 2", None, "not valid JSON"),
        ([GOOD_MEM[0], {"memory_id": "m2", "text": "x", "metadata": [1]}], "line 2", "metadata", "object"),
    ],
)
def test_bad_memory_records_are_named(tmp_path, rows, where, field, words):
    path = write_jsonl(tmp_path / "pool.jsonl", rows)
    with pytest.raises(InputError) as err:
        load_pools(path)
    e = err.value
    assert e.where == where and e.field == field and words in str(e) and "pool.jsonl" in str(e)


@pytest.mark.parametrize(
    "row, field, words",
    [
        ({**GOOD_Q[0], "options": ["Porto", "Madrid"]}, "options", "does not include the answer"),
        ({**GOOD_Q[0], "options": ["Lisbon"]}, "options", "at least 2"),
        ({**GOOD_Q[0], "pool_id": "nope"}, "pool_id", "not a loaded pool"),
        ({k: v for k, v in GOOD_Q[0].items() if k != "question"}, "question", "missing"),
        ({**GOOD_Q[0], "options": "Lisbon,Porto"}, "options", "list of strings"),
    ],
)
def test_bad_query_records_are_named(tmp_path, row, field, words):
    pools = load_pools(write_jsonl(tmp_path / "pool.jsonl", GOOD_MEM))
    path = write_jsonl(tmp_path / "q.jsonl", [GOOD_Q[0] | {"query_id": "q0"}, row])
    with pytest.raises(InputError) as err:
        load_queries(path, pools)
    assert err.value.where == "line 2" and err.value.field == field and words in str(err.value)


def test_parquet_rows_and_pool_id_column(tmp_path):
    table = pa.Table.from_pylist(
        [{"pool_id": "a", "memory_id": "1", "text": "x"}, {"pool_id": "b", "memory_id": "1", "text": "y"},
         {"pool_id": "b", "memory_id": "2", "text": None}]
    )
    pq.write_table(table, tmp_path / "mem.parquet")
    with pytest.raises(InputError) as err:
        load_pools(tmp_path / "mem.parquet")
    assert err.value.where == "row 2" and err.value.field == "text"
    pq.write_table(table.slice(0, 2), tmp_path / "mem.parquet")
    pools = load_pools(tmp_path / "mem.parquet")
    assert sorted(pools) == ["a", "b"]  # the same memory_id in two pools is fine


def test_cli_bad_input_exits_2_and_writes_nothing(tmp_path, capsys):
    mem = write_jsonl(tmp_path / "pool.jsonl", GOOD_MEM)
    qry = write_jsonl(tmp_path / "q.jsonl", [{**GOOD_Q[0], "answer": "Faro"}])
    out = tmp_path / "out"
    code = main(["audit", "--memories", str(mem), "--queries", str(qry), "--out", str(out), "--executor", "local"])
    assert code == 2
    assert not out.exists()
    err = capsys.readouterr().err
    assert "q.jsonl:line 1" in err and "'options'" in err


def test_cli_rejects_bad_settings_before_writing(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["audit", "--top-k", "64", "--out", str(out), "--executor", "local"]) == 2
    assert "top_k=64" in capsys.readouterr().err and not out.exists()
    assert main(["audit", "--agent-option", "bogus=1", "--out", str(out), "--executor", "local"]) == 2
    assert "unknown key" in capsys.readouterr().err and not out.exists()


@pytest.mark.skipif(not LOCOMO.exists(), reason="LoCoMo is read from ../shared")
def test_locomo_loader_turns_and_questions():
    pools, queries = load_locomo(LOCOMO, conversations=["conv-26"])
    pool = pools["conv-26"]
    first = pool.memories[0]
    assert first.memory_id == "D1:1" and first.text.startswith("[1:56 pm on 8 May, 2023] Caroline: ")
    assert any("[shares a photo:" in m.text for m in pool.memories)  # image captions are kept
    cats = {q.category for q in queries}
    assert cats == {"1", "2", "3", "4", "5"}
    for q in queries:
        assert q.answer in q.options and len(q.options) == 4
    adversarial = [q for q in queries if q.category == "5"]
    assert adversarial and all(q.answer for q in adversarial)  # read from adversarial_answer
    again = load_locomo(LOCOMO, conversations=["conv-26"])[1]
    assert [q.options for q in again] == [q.options for q in queries]  # deterministic


def test_locomo_bad_file(tmp_path):
    bad = tmp_path / "locomo.json"
    bad.write_text(json.dumps([{"sample_id": "x", "qa": []}]))
    with pytest.raises(InputError, match="conversation 0: field 'conversation'"):
        load_locomo(bad)
