"""The bad-input catalogue: every kind of bad input, setting, output folder or job config fails the same way: exit
code 2, one line on stderr naming what was wrong and where, and nothing written anywhere."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from pipeline.cli import main

ROOT = Path(__file__).resolve().parents[1]
MEM = [{"memory_id": "m1", "text": "Ana moved to Lisbon last spring."},
       {"memory_id": "m2", "text": "Ana is allergic to peanuts."}]
QRY = [{"query_id": "q1", "question": "Where does Ana live?", "answer": "Lisbon", "options": ["Lisbon", "Porto"]}]
LOCOMO_CONV = {"sample_id": "c1", "conversation": {"session_1_date_time": "1 May 2023", "session_1": [
    {"dia_id": "D1:1", "speaker": "Ana", "text": "I moved to Lisbon."}]},
    "qa": [{"question": "Where does Ana live?", "answer": "Lisbon", "category": 1}]}


def jsonl(path: Path, rows) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def pair(t: Path, mem=MEM, qry=QRY) -> list[str]:
    return ["--memories", str(jsonl(t / "in" / "mem.jsonl", mem)), "--queries", str(jsonl(t / "in" / "q.jsonl", qry))]


def locomo(t: Path, data) -> list[str]:
    p = t / "in" / "locomo.json"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data if isinstance(data, bytes) else json.dumps(data).encode())
    return ["--locomo", str(p)]


def job(t: Path, text: str) -> list[str]:
    p = t / "in" / "job.yaml"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text.replace("OUT", str(t / "out")))
    return ["JOB", str(p)]


def _bytes_file(t: Path, name: str, data: bytes) -> Path:
    p = t / "in" / name
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data)
    return p


# kind -> (arguments built in a fresh folder, words the one-line message must hold)
CASES = {
    "invalid_json_line": (lambda t: pair(t, mem=[MEM[0], "{not json"]), "mem.jsonl:line 2: is not valid JSON"),
    "record_not_an_object": (lambda t: pair(t, mem=["[1, 2]"]), "mem.jsonl:line 1: must be a JSON object"),
    "non_utf8_jsonl": (lambda t: ["--memories", str(_bytes_file(t, "mem.jsonl", b'{"memory_id": "\xff"}\n')),
                                  "--queries", str(jsonl(t / "in" / "q.jsonl", QRY))], "line 1: is not UTF-8 text"),
    "missing_text": (lambda t: pair(t, mem=[{"memory_id": "m1"}]), "field 'text' is missing"),
    "empty_memory_id": (lambda t: pair(t, mem=[{"memory_id": " ", "text": "x"}]), "field 'memory_id' is empty"),
    "nan_memory_id": (lambda t: pair(t, mem=['{"memory_id": NaN, "text": "x"}']), "field 'memory_id' must be a string or an integer, got nan"),
    "one_and_one_point_zero_are_one_id": (lambda t: pair(t, mem=[{"memory_id": 1, "text": "a"}, {"memory_id": 1.0, "text": "b"}]),
                                          "field 'memory_id' '1' repeats"),
    "duplicate_memory_id": (lambda t: pair(t, mem=[MEM[0], MEM[0]]), "mem.jsonl:line 2: field 'memory_id' 'm1' repeats"),
    "memory_text_too_long": (lambda t: [*pair(t, mem=[{"memory_id": "m1", "text": "x" * 51}]), "--max-memory-chars", "50"],
                             "field 'text' has 51 characters; the limit is 50"),
    "metadata_not_an_object": (lambda t: pair(t, mem=[{**MEM[0], "metadata": [1]}]), "field 'metadata' must be an object"),
    "query_for_unknown_pool": (lambda t: pair(t, qry=[{**QRY[0], "pool_id": "nope"}]), "'nope' is not a loaded pool"),
    "duplicate_query_id": (lambda t: pair(t, qry=[QRY[0], QRY[0]]), "q.jsonl:line 2: field 'query_id' 'q1' repeats"),
    "answer_not_among_options": (lambda t: pair(t, qry=[{**QRY[0], "answer": "Faro"}]), "does not include the answer 'Faro'"),
    "options_equal_after_normalisation": (lambda t: pair(t, qry=[{**QRY[0], "options": ["Lisbon", "the lisbon."]}]),
                                          "equal after normalisation"),
    "too_few_options": (lambda t: pair(t, qry=[{**QRY[0], "options": ["Lisbon"]}]), "needs at least 2 options"),
    "queries_without_memories": (lambda t: ["--queries", str(jsonl(t / "in" / "q.jsonl", QRY))],
                                 "and queries must be given together"),
    "missing_input_file": (lambda t: ["--memories", str(t / "nope.jsonl"), "--queries", str(t / "q.jsonl")], "nope.jsonl: does not exist"),
    "folder_without_input_files": (lambda t: ["--memories", str(_bytes_file(t, "notes.txt", b"x").parent), "--queries",
                                              str(t / "q.jsonl")], "is a folder with no input files"),
    "unsupported_extension": (lambda t: ["--memories", str(_bytes_file(t, "mem.csv", b"a,b")), "--queries", str(t / "q.jsonl")],
                              "has unsupported extension '.csv'"),
    "corrupt_parquet": (lambda t: ["--memories", str(_bytes_file(t, "mem.parquet", b"PAR1garbage")), "--queries",
                                   str(t / "q.jsonl")], "cannot be read as Parquet"),
    "same_file_name_in_two_folders": (lambda t: ["--memories", str(jsonl(t / "in" / "a" / "pool.jsonl", MEM)), "--memories",
                                                 str(jsonl(t / "in" / "b" / "pool.jsonl", MEM)), "--queries",
                                                 str(jsonl(t / "in" / "q.jsonl", QRY))], "the pool named after the file, 'pool', is also"),
    "pool_id_in_some_rows_only": (lambda t: pair(t, mem=[{**MEM[0], "pool_id": "a"}, MEM[1]]),
                                  "field 'pool_id' is given in some rows (line 1) and not in others (line 2)"),
    "no_query_records": (lambda t: pair(t, qry=[]), "holds no query records"),
    "locomo_non_utf8": (lambda t: locomo(t, b'[{"sample_id": "\xff"}]'), "locomo.json:byte 16: is not UTF-8 text"),
    "locomo_is_a_folder": (lambda t: ["--locomo", str(_bytes_file(t, "x.json", b"[]").parent)], "is a folder; give the LoCoMo json file"),
    "locomo_wrong_types": (lambda t: locomo(t, [{**LOCOMO_CONV, "qa": "x"}]), "conversation 0: field 'qa' must be a list, got str"),
    "locomo_turn_text_not_text": (lambda t: locomo(t, [{**LOCOMO_CONV, "conversation": {"session_1": [
        {"dia_id": "D1:1", "speaker": "Ana", "text": 5}]}}]), "conversation 0 session_1 turn 0: field 'text' must be a string"),
    "locomo_empty": (lambda t: locomo(t, []), "holds no conversations"),
    "locomo_no_questions": (lambda t: locomo(t, [{**LOCOMO_CONV, "qa": []}]), "field 'qa' holds no answerable questions"),
    "locomo_not_a_list": (lambda t: locomo(t, {"a": 1}), "must be a JSON list of LoCoMo conversations"),
    "locomo_unknown_conversation": (lambda t: [*locomo(t, [LOCOMO_CONV]), "--conversations", "zz"], "conversations ['zz'] not found"),
    "locomo_and_memories_together": (lambda t: [*locomo(t, [LOCOMO_CONV]), *pair(t)], "give either locomo or memories/mem0 + queries"),
    "out_is_an_existing_file": (lambda t: ["OUT", str(_bytes_file(t, "file.txt", b"x"))], "is an existing file; give a folder"),
    "out_under_a_file_is_unwritable": (lambda t: ["OUT", str(_bytes_file(t, "file.txt", b"x") / "sub")], "is not a writable folder"),
    "out_is_the_memories_folder": (lambda t: [*pair(t), "OUT", str(t / "in")], "holds the input"),
    "out_holds_foreign_files": (lambda t: ["OUT", str(_bytes_file(t, "notes.txt", b"x").parent)], "holds files meclear did not write"),
    "agent_option_without_equals": (lambda t: ["--agent-option", "foo"], "--agent-option 'foo': expected KEY=VALUE"),
    "agent_option_unknown_key_under_ray": (lambda t: ["--agent-option", "bogus=1", "--executor", "ray"],
                                           "agent 'reader' (--agent-option): unknown key(s) ['bogus']"),
    "agent_option_bad_value": (lambda t: ["--agent-option", "beta=-1"], "reader.beta: must be > 0"),
    "transformers_model_missing": (lambda t: ["--agent", "transformers", "--model", str(t / "no-model")], "is not a folder"),
    "top_k_out_of_range": (lambda t: ["--top-k", "40"], "top_k=40; allowed 1..20"),
    "exact_with_large_k": (lambda t: ["--estimator", "exact", "--top-k", "20"], "exact is allowed up to top_k=16"),
    "negative_tau": (lambda t: ["--tau", "-1"], "tau=-1.0; must be >= 0"),
    "negative_max_queries": (lambda t: ["--max-queries", "-1"], "max_queries=-1; must be >= 0"),
    "zero_batch_size": (lambda t: ["--batch-size", "0"], "batch_size=0; must be >= 1"),
    "reuse_without_utilities": (lambda t: ["--reuse", str(_bytes_file(t, "x.txt", b"x").parent)], "has no utilities/ folder"),
    "job_out_unknown_placeholder": (lambda t: job(t, "inputs: {}\nout: OUT/{user}\naudit: {executor: local}\n"),
                                    "has an unknown placeholder ('user'); allowed: {date}"),
    "job_inputs_a_list": (lambda t: job(t, "inputs: [a, b]\nout: OUT\n"), "inputs must be a mapping of settings, got list"),
    "job_config_is_a_folder": (lambda t: ["JOB", str(_bytes_file(t, "x.txt", b"x").parent)], "is a folder; give the YAML file"),
    "job_top_k_true": (lambda t: job(t, "inputs: {}\nout: OUT\naudit: {top_k: true}\n"), "top_k=True; must be an integer"),
    "job_unknown_key": (lambda t: job(t, "inputs: {}\nout: OUT\nwhen: nightly\n"), "unknown key(s) ['when']"),
    "job_memories_not_paths": (lambda t: job(t, "inputs: {memories: [1], queries: q}\nout: OUT\n"),
                               "memories must be a path or a list of paths"),
}


def _nightly_main():
    spec = importlib.util.spec_from_file_location("nightly_audit", ROOT / "jobs" / "nightly_audit.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def _tree(folder: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else None) for p in sorted(folder.rglob("*"))}


def test_catalogue_has_at_least_30_kinds():
    assert len(CASES) >= 30


@pytest.mark.parametrize("kind", sorted(CASES))
def test_bad_input_is_one_line_exit_2_and_writes_nothing(kind, tmp_path, capsys):
    build, words = CASES[kind]
    args = build(tmp_path)
    before = _tree(tmp_path)
    if args[0] == "JOB":
        rc = _nightly_main()(["--config", args[1], "--no-progress"])
    else:
        out = str(tmp_path / "out")
        if "OUT" in args:
            i = args.index("OUT")
            out = args[i + 1]
            args = args[:i] + args[i + 2:]
        rc = main(["audit", *args, "--out", out, "--dense", "off", "--no-progress",
                   *([] if "--executor" in args else ["--executor", "local"])])
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert rc == 2, (kind, err)
    assert len(err.splitlines()) == 1, err
    assert words in err, err
    assert _tree(tmp_path) == before  # nothing written, nothing removed
