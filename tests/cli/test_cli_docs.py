"""The audit CLI, its --help, docs/cli.md, docs/deploy.md and the job configs agree; terminal output is safe;
progress off a TTY is plain lines."""

from __future__ import annotations

import argparse
import io
import re
from dataclasses import fields
from pathlib import Path

import yaml

from pipeline.audit.reduce import ClearanceRow
from pipeline.audit.run import AuditConfig, AuditResult, InputSpec
from pipeline.cli.main import build_parser, print_summary, safe
from pipeline.core.progress import progress_bar

ROOT = Path(__file__).resolve().parents[2]


def _audit_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return sub.choices["audit"]


def _shown(value) -> str:
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def test_every_audit_flag_has_help_and_its_default_in_help_and_docs():
    cli_md = (ROOT / "docs" / "cli.md").read_text()
    parser = _audit_parser()
    text = parser.format_help()
    for action in parser._actions:
        flag = next((f for f in action.option_strings if f.startswith("--")), None)
        if flag in (None, "--help"):
            continue
        assert action.help and action.help != argparse.SUPPRESS, f"{flag} has no help"
        if action.default in (None, False, [], "", argparse.SUPPRESS):
            continue
        shown = _shown(action.default)
        assert f"(default: {action.default})" in " ".join(text.split()), f"--help does not show the default of {flag}"
        line = next((x for x in cli_md.splitlines() if x.startswith(f"- `{flag}")), "")
        assert f"(default: `{shown}`)" in line, f"docs/cli.md lacks '{flag}' with its default {shown}: " \
                                               "run `python -m pipeline.cli.clidoc > docs/cli.md`"


def test_job_config_keys_are_settings_and_job_flags_documented_in_docs():
    deploy = (ROOT / "docs" / "deploy.md").read_text()
    raw = yaml.safe_load((ROOT / "jobs" / "configs" / "nightly_audit.yaml").read_text())
    assert set(raw["audit"]) <= {f.name for f in fields(AuditConfig)}
    assert set(raw["inputs"]) <= {f.name for f in fields(InputSpec)}
    for flag in ("--config", "--reuse", "--no-progress"):
        assert flag in (ROOT / "jobs" / "nightly_audit.py").read_text() and flag in deploy
    for ref in re.findall(r"[\w/]+\.yaml", (ROOT / "jobs" / "configs" / "nightly_audit.yaml").read_text()):
        assert (ROOT / "jobs" / "configs" / Path(ref).name).exists(), f"nightly_audit.yaml points to missing {ref}"


def test_ids_are_printed_with_control_characters_escaped(capsys):
    evil = "q\x1b]0;pwned\x07\x1b[2J"
    assert safe(evil) == "q\\x1b]0;pwned\\x07\\x1b[2J"
    clearance = ClearanceRow(run_id="r", pool_id="p", query_id=evil, context_hash="h", question="q?", gold="b",
                             options=["a", "b"], answer_before="a\x1b[5m", answer_after="b", cleared=["m\x1b[31m"],
                             baseline_utility=0.1, cleared_utility=0.9, gain=0.8, baseline_correct=False,
                             recovered=True, reason=None, harmful=1, candidates=2, evaluations=3, estimator="exact")
    result = AuditResult("r", Path("o\x1b[1m"), 1, 1, 1, 1, 1, 3, 0, 3, {}, [clearance])
    print_summary(result, 1.0)
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "q\\x1b]0;pwned" in out


def test_progress_off_a_terminal_is_plain_periodic_lines():
    stream = io.StringIO()
    bar = progress_bar(total=4, desc="cases", unit="case", every_s=0.0, stream=stream)
    for _ in range(4):
        bar.update(1)
    bar.close()
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue() and len(lines) == 5
    assert lines[-1].startswith("cases: 4/4 cases (100%)")


def test_verbose_is_accepted_before_and_after_the_subcommand():
    parser = build_parser()
    assert parser.parse_args(["audit", "-v"]).verbose and parser.parse_args(["-v", "audit"]).verbose
    assert not parser.parse_args(["audit"]).verbose
