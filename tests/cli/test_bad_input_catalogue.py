"""The bad-input catalogue: every kind of bad input, setting, output folder or job config fails the same way: exit
code 2, one line on stderr naming what was wrong and where, and nothing written anywhere."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

from pipeline.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
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


# kind -> (arguments built in a fresh folder, words the one-line message must hold, or a tuple of such parts)
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
    "top_k_out_of_range": (lambda t: ["--top-k", "64"], "top_k=64; allowed 1..63"),
    "exact_with_large_k": (lambda t: ["--estimator", "exact", "--top-k", "20"], "exact is allowed up to top_k=16"),
    "negative_tau": (lambda t: ["--tau", "-1"], "tau=-1.0; must be >= 0"),
    "negative_max_queries": (lambda t: ["--max-queries", "-1"], "max_queries=-1; must be >= 0"),
    "zero_batch_size": (lambda t: ["--batch-size", "0"], "batch_size=0; must be >= 1"),
    "reuse_without_utilities": (lambda t: ["--reuse", str(_bytes_file(t, "x.txt", b"x").parent)], "has no utilities/ folder"),
    "job_out_unknown_placeholder": (lambda t: job(t, "inputs: {}\nout: OUT/{user}\naudit: {executor: local}\n"),
                                    "has an unknown placeholder ('user'); allowed: {date}"),
    "job_inputs_a_list": (lambda t: job(t, "inputs: [a, b]\nout: OUT\n"), "inputs must be a mapping of settings, got list"),
    "job_config_is_a_folder": (lambda t: ["JOB", str(_bytes_file(t, "x.txt", b"x").parent)], "is a folder; give the YAML file"),
    "job_top_k_true": (lambda t: job(t, "inputs: {}\nout: OUT\naudit: {top_k: true}\n"), "top_k=True; allowed 1..63"),
    "job_unknown_key": (lambda t: job(t, "inputs: {}\nout: OUT\nwhen: nightly\n"), "unknown key(s) ['when']"),
    "job_memories_not_paths": (lambda t: job(t, "inputs: {memories: [1], queries: q}\nout: OUT\n"),
                               "memories must be a path or a list of paths"),
}


def _fifo(t: Path, name: str) -> Path:
    """A named pipe with no writer: reading it would block for good, so it must be refused, never opened."""
    p = t / "in" / name
    p.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(p)
    return p


def mem0(t: Path, data, name: str = "export.json") -> list[str]:
    raw = data if isinstance(data, bytes) else (data if isinstance(data, str) else json.dumps(data)).encode()
    return ["--mem0", str(_bytes_file(t, name, raw)), "--queries", str(jsonl(t / "in" / "q.jsonl", [Q_MEM0]))]


def _parquet_memories(t: Path) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = t / "in" / "mem.parquet"
    p.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"memory_id": ["m1"], "text": [5]}), p)
    return ["--memories", str(p), "--queries", str(jsonl(t / "in" / "q.jsonl", QRY))]


def _nested(depth: int) -> str:
    return '{"a": ' * depth + "1" + "}" * depth


M0 = {"id": "a1", "memory": "Ana moved to Lisbon last spring.", "user_id": "ana"}
Q_MEM0 = {**QRY[0], "pool_id": "ana"}
HUGE_INT = "9" * 5000  # more digits than Python converts (sys.get_int_max_str_digits(): 4,300)

# Issue 17 (item 5): bad settings, files and records found by a probe, and the limits on what a user can make huge
# (pipeline.io.records: MAX_*; README, Inputs: limits). Each is exit 2, one line, nothing written.
CASES |= {
    "seed_negative": (lambda t: ["--seed", "-5"], "seed=-5; allowed 0..2**63-1"),
    "seed_too_large": (lambda t: ["--seed", str(2**64)], "seed=18446744073709551616; allowed 0..2**63-1"),
    "tau_nan": (lambda t: ["--tau", "nan"], "tau=nan; must be a finite number"),
    "kappa_infinite": (lambda t: ["--kappa", "inf"], "kappa=inf; must be a finite number"),
    "gpus_per_actor_infinite": (lambda t: ["--gpus-per-actor", "inf"], "gpus_per_actor=inf; must be a finite number"),
    "permutations_beyond_the_cap": (lambda t: ["--permutations", "1000000"], "permutations=1000000; allowed 0..10,000"),
    "adaptive_z_infinite": (lambda t: ["--estimator", "adaptive", "--adaptive-z", "inf"], "adaptive_z=inf; must be a finite number"),
    "permutations_negative": (lambda t: ["--permutations", "-2"], "permutations=-2; allowed 0..10,000"),
    "agent_option_infinite": (lambda t: ["--agent-option", "beta=.inf"], "beta=inf; must be a finite number"),
    "agent_option_nan": (lambda t: ["--agent-option", "beta=.nan"], "beta=nan; must be a finite number"),
    "agent_option_huge": (lambda t: ["--agent-option", "beta=1.0e+300"], "reader.beta: must be > 0 and <= 1e+06"),
    "agent_option_infinite_under_ray": (lambda t: ["--agent-option", "beta=-.inf", "--executor", "ray"],
                                        "beta=-inf; must be a finite number"),
    "job_tau_infinite": (lambda t: job(t, "inputs: {}\nout: OUT\naudit: {tau: .inf}\n"), "tau=inf; must be a finite number"),
    "job_config_is_a_fifo": (lambda t: ["JOB", str(_fifo(t, "job.yaml"))], "is not a regular file (a FIFO"),
    "locomo_options_beyond_the_limit": (lambda t: [*locomo(t, [LOCOMO_CONV]), "--locomo-options", "1000"],
                                        "locomo_options=1000; must be 0 (open answers) or 2..64"),
    # files that are not regular files would block the reader for good
    "memories_file_is_a_fifo": (lambda t: ["--memories", str(_fifo(t, "mem.jsonl")), "--queries",
                                           str(jsonl(t / "in" / "q.jsonl", QRY))], "mem.jsonl: is not a regular file"),
    "fifo_inside_a_queries_folder": (lambda t: ["--memories", str(jsonl(t / "in" / "mem.jsonl", MEM)), "--queries",
                                                str(_fifo(t, "qs/q.jsonl").parent)], "q.jsonl: is not a regular file"),
    "folder_named_like_an_input_file": (lambda t: ["--memories", str(jsonl(t / "in" / "mem" / "sub.jsonl" / "x.jsonl", MEM).parent.parent),
                                                   "--queries", str(jsonl(t / "in" / "q.jsonl", QRY))], "sub.jsonl: is a folder; give a file"),
    "locomo_file_is_a_fifo": (lambda t: ["--locomo", str(_fifo(t, "locomo.json"))], "locomo.json: is not a regular file"),
    "mem0_file_is_a_fifo": (lambda t: ["--mem0", str(_fifo(t, "export.json")), "--queries",
                                       str(jsonl(t / "in" / "q.jsonl", [Q_MEM0]))], "export.json: is not a regular file"),
    "parquet_text_not_a_string": (_parquet_memories, "mem.parquet:row 0: field 'text' must be a string, got int"),
    # memories JSONL
    "memory_id_of_5000_digits": (lambda t: pair(t, mem=['{"memory_id": ' + HUGE_INT + ', "text": "x"}']),
                                 "mem.jsonl:line 1: holds a number with more than 4,300 digits"),
    "memory_id_too_long": (lambda t: pair(t, mem=[{"memory_id": "m" * 2000, "text": "x"}]),
                           "field 'memory_id' has 2,000 characters; the limit is 1,000"),
    "metadata_nested_200000_levels": (lambda t: pair(t, mem=['{"memory_id": "m1", "text": "x", "metadata": '
                                                             + _nested(200_000) + "}"]),
                                      "mem.jsonl:line 1: is JSON nested too deeply to read"),
    "metadata_deeper_than_the_limit": (lambda t: pair(t, mem=['{"memory_id": "m1", "text": "x", "metadata": '
                                                              + _nested(40) + "}"]),
                                       "field 'metadata' is nested more than 32 levels deep"),
    "metadata_string_not_json": (lambda t: pair(t, mem=[{**MEM[0], "metadata": "{oops"}]),
                                 "field 'metadata' is a string but not a JSON object"),
    "memory_id_a_fraction": (lambda t: pair(t, mem=[{"memory_id": 1.5, "text": "x"}]),
                             "field 'memory_id' must be a string or an integer, got 1.5"),
    "speaker_not_text": (lambda t: pair(t, mem=[{**MEM[0], "speaker": ["Ana"]}]), "field 'speaker' must be a string, got list"),
    # queries JSONL
    "duplicate_query_id_across_files": (lambda t: ["--memories", str(jsonl(t / "in" / "mem.jsonl", MEM)), "--queries",
                                                   str(jsonl(t / "in" / "q1.jsonl", QRY)), "--queries",
                                                   str(jsonl(t / "in" / "q2.jsonl", QRY))],
                                        ("q2.jsonl:line 1: field 'query_id' 'q1' repeats in pool 'mem' (first at ", "in/q1.jsonl line 1)")),
    "options_beyond_the_limit": (lambda t: pair(t, qry=[{**QRY[0], "options": ["Lisbon", *(f"city {i}" for i in range(10_000))]}]),
                                 "field 'options' has 10,001 options; the limit is 64"),
    "option_text_too_long": (lambda t: pair(t, qry=[{**QRY[0], "options": ["Lisbon", "P" * 1001]}]),
                             "field 'options[1]' has 1,001 characters; the limit is 1,000"),
    "question_too_long": (lambda t: pair(t, qry=[{**QRY[0], "question": "why " * 2501}]),
                          "field 'question' has 10,004 characters; the limit is 10,000"),
    "answer_too_long": (lambda t: pair(t, qry=[{**QRY[0], "answer": "L" * 1001}]),
                        "field 'answer' has 1,001 characters; the limit is 1,000"),
    "options_not_a_list_of_strings": (lambda t: pair(t, qry=[{**QRY[0], "options": "Lisbon"}]), "field 'options' must be a list of strings"),
    "question_missing": (lambda t: pair(t, qry=[{k: v for k, v in QRY[0].items() if k != "question"}]),
                         "field 'question' is missing"),
    "evidence_not_a_list": (lambda t: pair(t, qry=[{**QRY[0], "evidence": "m1"}]), "field 'evidence' must be a list of memory ids"),
    "query_nested_200000_levels": (lambda t: pair(t, qry=['{"query_id": "q1", "x": ' + _nested(200_000) + "}"]),
                                   "q.jsonl:line 1: is JSON nested too deeply to read"),
    # mem0 exports
    "mem0_not_json": (lambda t: mem0(t, "{oops"), "export.json:line 1: is not valid JSON"),
    "mem0_object_without_results": (lambda t: mem0(t, {"items": []}), "must be a list of memories or an object with a 'results' list"),
    "mem0_record_not_an_object": (lambda t: mem0(t, [1]), "export.json:row 0: must be a JSON object, got int"),
    "mem0_memory_missing": (lambda t: mem0(t, [{"id": "a1", "user_id": "ana"}]), "field 'memory' is missing"),
    "mem0_metadata_not_an_object": (lambda t: mem0(t, [{**M0, "metadata": [1]}]), "field 'metadata' must be an object or null"),
    "mem0_duplicate_id": (lambda t: mem0(t, [M0, M0]), "field 'id' 'a1' repeats for user 'ana'"),
    "mem0_empty": (lambda t: mem0(t, []), "holds no memories"),
    "mem0_non_utf8": (lambda t: mem0(t, b'[{"id": "\xff"}]'), "export.json:byte 9: is not UTF-8 text"),
    "mem0_memory_too_long": (lambda t: [*mem0(t, [M0]), "--max-memory-chars", "10"],
                             "field 'memory' has 32 characters; the limit is 10 (--max-memory-chars)"),
    "mem0_jsonl_nested_200000_levels": (lambda t: mem0(t, '{"id": "a1", "metadata": ' + _nested(200_000) + "}\n", "export.jsonl"),
                                        "export.jsonl:line 1: is JSON nested too deeply to read"),
    "mem0_id_of_5000_digits": (lambda t: mem0(t, '[{"id": ' + HUGE_INT + "}]"), "holds a number with more than 4,300 digits"),
    "mem0_and_memories_together": (lambda t: [*mem0(t, [M0]), "--memories", str(jsonl(t / "in" / "mem.jsonl", MEM))],
                                   "give either memories or mem0, not both"),
    # LoCoMo
    "locomo_nested_200000_levels": (lambda t: locomo(t, ("[" * 200_000 + "]" * 200_000).encode()),
                                    "locomo.json: is JSON nested too deeply to read"),
    "locomo_turn_too_long": (lambda t: [*locomo(t, [LOCOMO_CONV]), "--max-memory-chars", "20"],
                             "conversation 0 session_1 turn 0: field 'text' has 36 characters; the limit is 20"),
    "locomo_question_too_long": (lambda t: locomo(t, [{**LOCOMO_CONV, "qa": [{**LOCOMO_CONV["qa"][0], "question": "q" * 10_001}]}]),
                                 "conversation 0 qa 0: field 'question' has 10,001 characters; the limit is 10,000"),
    "locomo_sample_id_too_long": (lambda t: locomo(t, [{**LOCOMO_CONV, "sample_id": "c" * 1001}]),
                                  "conversation 0: field 'sample_id' has 1,001 characters; the limit is 1,000"),
    "locomo_sample_id_missing": (lambda t: locomo(t, [{k: v for k, v in LOCOMO_CONV.items() if k != "sample_id"}]),
                                 "conversation 0: field 'sample_id' is missing"),
    "locomo_qa_item_not_an_object": (lambda t: locomo(t, [{**LOCOMO_CONV, "qa": [1]}]), "conversation 0 qa 0: must be an object"),
    "locomo_not_json": (lambda t: locomo(t, b"[{oops"), "locomo.json:line 1: is not valid JSON"),
}


# Issue 29: inputs named another way, repeated, or built to be expensive (a probe of 220 kinds found each of these).
LAUGHS = "a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 10)}]\n" for i in range(8))
FLOW_LAUGHS = "[&a [1,1,1,1,1,1,1,1,1,1], " + ", ".join(
    f"&{chr(98 + i)} [{','.join([f'*{chr(97 + i)}'] * 10)}]" for i in range(8)) + "]"
LONE = "\\udc00"  # a JSON escape of a lone surrogate: valid JSON, not encodable UTF-8


def _prev_run_folder(t: Path) -> Path:
    (t / "prev" / "utilities").mkdir(parents=True)
    return t / "prev"


CASES |= {
    "job_yaml_nested_aliases": (lambda t: job(t, LAUGHS + "inputs: {}\nout: OUT\n"), "expands to more than 100,000 values"),
    "job_yaml_recursive_alias": (lambda t: job(t, "inputs: &a {x: *a}\nout: OUT\n"), "holds a recursive alias"),
    "job_key_given_twice": (lambda t: job(t, "inputs: {}\nout: OUT\nout: OUT\n"), "key 'out' is given twice in one mapping"),
    "job_nested_key_given_twice": (lambda t: job(t, "inputs: {}\nout: OUT\naudit: {tau: 0.1, tau: 0.2}\n"), "key 'tau' is given twice"),
    "job_integer_of_5000_digits": (lambda t: job(t, f"inputs: {{}}\nout: OUT\naudit: {{seed: {HUGE_INT}}}\n"),
                                   "holds an integer with more than 4,300 digits"),
    "job_config_over_a_mebibyte": (lambda t: job(t, "inputs: {}\nout: OUT\n#" + "x" * (1 << 20) + "\n"), "the limit is 1,048,576"),
    "job_yaml_error_is_short": (lambda t: job(t, "inputs: {}\nout: OUT\naudit: {" + "x" * 100_000 + ": [\n"), "not valid YAML"),
    "agent_option_nested_aliases": (lambda t: ["--agent-option", "beta=" + FLOW_LAUGHS], "expands to more than 100,000 values"),
    "agent_option_integer_of_5000_digits": (lambda t: ["--agent-option", f"beta={HUGE_INT}"], "holds an integer with more than 4,300 digits"),
    "agent_option_given_twice": (lambda t: ["--agent-option", "beta=1", "--agent-option", "beta=2"], "'beta': is given twice"),
    "memory_text_lone_surrogate": (lambda t: pair(t, mem=['{"memory_id": "m1", "text": "a' + LONE + 'b"}']),
                                   "mem.jsonl:line 1: field 'text' holds a lone surrogate escape (\\udc00)"),
    "memory_id_lone_surrogate": (lambda t: pair(t, mem=['{"memory_id": "' + LONE + '", "text": "x"}']),
                                 "field 'memory_id' holds a lone surrogate"),
    "question_lone_surrogate": (lambda t: pair(t, qry=['{"query_id": "q1", "question": "' + LONE + '?", "answer": "Lisbon"}']),
                                "q.jsonl:line 1: field 'question' holds a lone surrogate"),
    "locomo_turn_lone_surrogate": (lambda t: locomo(t, json.dumps([LOCOMO_CONV]).replace("I moved", LONE + "I moved").encode()),
                                   "field '[0].conversation.session_1[0].text' holds a lone surrogate"),
    "mem0_memory_lone_surrogate": (lambda t: mem0(t, json.dumps([M0]).replace("Ana moved", LONE)),
                                   "field '[0].memory' holds a lone surrogate"),
    "locomo_sample_id_twice": (lambda t: locomo(t, [LOCOMO_CONV, LOCOMO_CONV]),
                               "conversation 1: field 'sample_id' 'c1' repeats (first at conversation 0)"),
    "locomo_dia_id_twice": (lambda t: locomo(t, [{**LOCOMO_CONV, "conversation": {"session_1": [
        {"dia_id": "D1:1", "speaker": "Ana", "text": "a"}, {"dia_id": "D1:1", "speaker": "Ana", "text": "b"}]}}]),
                            "session_1 turn 1: field 'dia_id' 'D1:1' repeats in conversation 'c1' (first at session_1 turn 0)"),
    "locomo_conversation_without_sessions": (lambda t: locomo(t, [{**LOCOMO_CONV, "conversation": {"speaker_a": "Ana"}}]),
                                             ("locomo.json:conversation 0: field 'conversation' holds no turns")),
    "out_under_proc": (lambda t: ["OUT", "/proc/meclear-out"], "is under /proc, a kernel pseudo-filesystem"),
    "out_under_sys": (lambda t: ["OUT", "/sys/kernel/meclear"], "is under /sys, a kernel pseudo-filesystem"),
    "reuse_is_the_out_folder": (lambda t: ["--reuse", str(t / "out")], "is the same folder as --out"),
    "reuse_is_the_out_folder_named_another_way": (lambda t: ["--reuse", str(t / "out") + "/./"], "is the same folder as --out"),
    "reuse_given_twice": (lambda t: ["--reuse", str(_prev_run_folder(t)), "--reuse", str(t / "prev") + "/"],
                          "give each --reuse folder once"),
    "adaptive_z_negative": (lambda t: ["--estimator", "adaptive", "--adaptive-z", "-1"], "adaptive_z=-1.0; must be a finite number > 0"),
    "adaptive_z_zero": (lambda t: ["--estimator", "adaptive", "--adaptive-z", "0"], "adaptive_z=0.0; must be a finite number > 0"),
}


def _nightly_main():
    spec = importlib.util.spec_from_file_location("nightly_audit", ROOT / "jobs" / "nightly_audit.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def _tree(folder: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else None) for p in sorted(folder.rglob("*"))}


def test_catalogue_has_at_least_80_kinds():
    assert len(CASES) >= 80


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
    for part in words if isinstance(words, tuple) else (words,):  # a tuple: every part, in the line
        assert part in err, err
    assert _tree(tmp_path) == before  # nothing written, nothing removed


def test_the_error_line_of_a_huge_yaml_file_is_short(tmp_path, capsys):
    args = job(tmp_path, "inputs: {}\nout: OUT\naudit: {" + "x" * 100_000 + ": [\n")
    assert _nightly_main()(["--config", args[1], "--no-progress"]) == 2
    assert len(capsys.readouterr().err) < 600
