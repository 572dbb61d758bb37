"""Terminal safety everywhere (issue 17, item 8): a crafted memory bank (ids, texts and field names holding ANSI/OSC
escapes, BEL and the right-to-left override U+202E) cannot reach the terminal raw through any command: `audit`,
`curate`, `report`, `eval`, log warnings and error messages all print it escaped (`pipeline.core.text.safe`)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from pipeline.audit.run import sample_paths
from pipeline.cli.main import main
from pipeline.core.text import safe

# ESC ] 0 ; ... BEL retitles a terminal, ESC [ 2 J clears it, U+202E reverses what follows, U+2066 isolates it
CRAFT = "\x1b]0;pwned\x07\x1b[2J\u202e\u2066"
RAW = ("\x1b", "\x07", "\u202e", "\u2066", "\x9b")


def _raw(text: str) -> list[str]:
    return [c for c in RAW if c in text]


def test_safe_escapes_controls_and_bidi_characters():
    assert safe("a\x1b[2Jb\x07\x9b") == "a\\x1b[2Jb\\x07\\x9b"
    assert safe("abc\u202edef\u2066\u2069\u200f\u061c\u2028") == "abc\\u202edef\\u2066\\u2069\\u200f\\u061c\\u2028"
    assert safe("Lisbon, São Paulo, 東京 ✓") == "Lisbon, São Paulo, 東京 ✓"  # printable text stays as it is


@pytest.fixture(scope="module")
def crafted_run(tmp_path_factory) -> tuple[Path, str, str]:
    """The sample pool in which every pool id, memory id and text carries the crafted sequence, plus an unknown field
    whose name carries it too (the loader warns about it). Returns (folder, memories file, queries file)."""
    t = tmp_path_factory.mktemp("crafted")
    mem, queries = sample_paths()
    rows = [json.loads(line) for line in mem.read_text().splitlines() if line.strip()]
    crafted = t / f"pool{CRAFT}.jsonl"  # the file name reaches the warning and the summary
    crafted.write_text("".join(json.dumps({**r, "pool_id": r["pool_id"] + CRAFT, "memory_id": r["memory_id"] + CRAFT,
                                           "text": CRAFT + r["text"], f"note{CRAFT}": 1}) + "\n" for r in rows))
    q = t / "queries.jsonl"
    q.write_text("".join(json.dumps({**(r := json.loads(line)), "pool_id": r["pool_id"] + CRAFT}) + "\n"
                         for line in queries.read_text().splitlines() if line.strip()))
    return t, str(crafted), str(q)


def _run_cli(args: list[str], capsys) -> tuple[int, str]:
    root = logging.getLogger()
    handlers = list(root.handlers)
    for h in handlers:  # pytest's capture handlers stay; the CLI's own stream handler is what a user sees
        root.removeHandler(h)
    try:
        rc = main(args)
    finally:
        for h in list(root.handlers):
            root.removeHandler(h)
        for h in handlers:
            root.addHandler(h)
    cap = capsys.readouterr()
    return rc, cap.out + cap.err


def test_audit_curate_and_report_print_crafted_ids_and_text_escaped(crafted_run, capsys):
    t, mem, q = crafted_run
    run = t / "run"
    rc, printed = _run_cli(["audit", "--memories", mem, "--queries", q, "--out", str(run), "--executor", "local",
                            "--dense", "off", "--no-progress"], capsys)
    assert rc == 0, printed
    assert "ignoring field(s)" in printed and "\\x1b" in printed  # the warning was printed, escaped
    assert _raw(printed) == []

    rc, printed = _run_cli(["curate", str(run), "--out", str(t / "curation.parquet")], capsys)
    assert rc == 0, printed
    assert "\\x1b]0;pwned\\x07\\x1b[2J\\u202e" in printed  # the crafted ids and texts are in the table, escaped
    assert _raw(printed) == []

    report_out = t / f"report{CRAFT}.html"
    rc, printed = _run_cli(["report", str(run), "--out", str(report_out), "--figures", "none", "--no-progress"], capsys)
    assert rc == 0, printed
    assert "meclear report:" in printed and "\\u202e" in printed
    assert _raw(printed) == []
    assert "Glyph" not in printed  # figure labels are escaped too: no raw control character reaches matplotlib


def test_eval_and_error_messages_escape_crafted_paths(tmp_path, capsys):
    crafted = tmp_path / f"locomo{CRAFT}.json"
    rc, printed = _run_cli(["eval", "--locomo", str(crafted), "--out", str(tmp_path / "eval"), "--no-progress"], capsys)
    assert rc == 2 and "does not exist" in printed, printed
    assert "meclear eval:" in printed  # the headline line with the path was printed, escaped
    assert _raw(printed) == []
    rc, printed = _run_cli(["audit", "--memories", str(crafted), "--queries", str(crafted), "--out",
                            str(tmp_path / "out"), "--executor", "local", "--dense", "off"], capsys)
    assert rc == 2 and _raw(printed) == [] and "\\u202e" in printed, printed
