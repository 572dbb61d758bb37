"""The run folder (pipeline/store): one output-safety rule for every command, damaged parts set aside and named,
schema versions checked before any work, a full disk as one line, and report/curate on runs they cannot read as one
line. Each test is a defect of issue 17 (or the typed-manifest part of issue 19) that failed before the fix."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
from pathlib import Path

import polars as pl
import pyarrow.parquet as pq
import pytest

from pipeline.audit.run import AuditConfig, InputSpec, audit, sample_paths
from pipeline.cli.main import main
from pipeline.store import writer
from tests.data_paths import LOCOMO
from tests.golden import EVAL_ARGS

BASE = ["--executor", "local", "--dense", "off", "--no-progress"]


def _audit(out: Path, *extra: str) -> int:
    return main(["audit", "--out", str(out), *BASE, *extra])


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _one_line(capsys, *words: str) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    for w in words:
        assert w in err, err
    return err


@pytest.fixture(scope="module")
def bank_run(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(run folder, its memory bank, its query set): an audit of copies of the sample pool."""
    root = tmp_path_factory.mktemp("bank")
    mem, qry = root / "memories.jsonl", root / "queries.jsonl"
    for src, dst in zip(sample_paths(), (mem, qry)):
        shutil.copy(src, dst)
    run = root / "runs" / "audit"
    assert _audit(run, "--memories", str(mem), "--queries", str(qry)) == 0
    return run, mem, qry


def test_curate_out_the_memory_bank_is_refused_and_the_bank_untouched(bank_run, capsys):
    run, mem, _ = bank_run
    before = mem.read_bytes()
    assert main(["curate", str(run), "--out", str(mem)]) == 2
    _one_line(capsys, str(mem))
    assert mem.read_bytes() == before


@pytest.mark.parametrize("target", ["manifest.json", "clearances/PART", "utilities/x.parquet"])
@pytest.mark.parametrize("command", ["report", "curate"])
def test_report_or_curate_out_inside_the_run_is_refused(bank_run, capsys, command, target):
    run, _, _ = bank_run
    if target == "clearances/PART":
        target = str(next((run / "clearances").glob("*.parquet")).relative_to(run))
    before = _tree(run)
    args = [command, str(run), "--out", str(run / target)] + (["--figures", "none"] if command == "report" else [])
    assert main(args) == 2
    _one_line(capsys, "--out")
    assert _tree(run) == before


def test_curate_out_a_folder_is_one_line_and_leaves_no_tmp(bank_run, tmp_path, capsys):
    run, _, _ = bank_run
    assert main(["curate", str(run), "--out", str(tmp_path)]) == 2
    _one_line(capsys, "is a folder")
    assert os.listdir(tmp_path) == []


def test_the_readme_flow_works_in_one_folder_tree(tmp_path, capsys, sample_audit):
    """audit, report, rerun (resumes: the run knows its report), curate beside it, eval beside it; eval into the audit
    folder and an audit into the eval folder are refused (folders of another kind)."""
    tree = tmp_path / "runs"
    run = sample_audit.copy(tree / "audit")  # what `meclear audit --out runs/audit` writes
    assert main(["report", str(run), "--figures", "none", "--no-progress"]) == 0 and (run / "report.html").is_file()
    assert _audit(run) == 0  # was exit 2: "holds files meclear did not write ('report.html')"
    assert main(["report", str(run), "--figures", "none", "--no-progress"]) == 0  # the run's own report, replaced
    assert main(["curate", str(run), "--out", str(tree / "curation.parquet")]) == 0
    assert main(["curate", str(run), "--out", str(tree / "curation.parquet")]) == 0  # its own file, replaced
    capsys.readouterr()
    if not LOCOMO.exists():
        pytest.skip("LoCoMo is not beside the checkout")
    before = _tree(run)
    assert main([*EVAL_ARGS, "--out", str(run)]) == 2
    _one_line(capsys, "audit run folder")
    assert main([*EVAL_ARGS, "--out", str(run / "eval")]) == 2
    _one_line(capsys, "inside")
    assert _tree(run) == before
    assert main([*EVAL_ARGS, "--out", str(tree / "eval")]) == 0
    assert main(["report", str(tree / "eval"), "--no-progress"]) == 0
    capsys.readouterr()
    assert _audit(tree / "eval") == 2
    _one_line(capsys, "eval output folder")


def _sample(out: Path, reuse=()):
    return audit(InputSpec(), AuditConfig(executor="local", dense="off"), out, progress=False, reuse=reuse)


def _damage(part: Path, how: str) -> None:
    data = part.read_bytes()
    part.write_bytes({"truncated": data[: len(data) // 2], "zero": b"", "garbage": os.urandom(len(data))}[how])


@pytest.mark.parametrize("how", ["truncated", "zero", "garbage"])
def test_a_damaged_part_is_quarantined_named_and_evaluated_again(tmp_path, caplog, how, sample_audit):
    out = sample_audit.copy(tmp_path / "o")
    part = next((out / "utilities").glob("*.parquet"))  # compacted: the one part holds every utility
    _damage(part, how)
    with caplog.at_level(logging.WARNING):
        again = _sample(out)
    named = [r for r in caplog.records if part.name in r.getMessage()]
    assert len(named) == 1 and "quarantine" in named[0].getMessage()
    assert (out / "quarantine" / "utilities" / part.name).is_file()
    # what it held, evaluated again
    assert again.evaluated == sample_audit.counts()["coalitions_evaluated"] and again.reused == 0
    got, want = pl.read_parquet(out / "clearances").drop("run_id"), pl.read_parquet(sample_audit.run() / "clearances")
    assert got.sort("pool_id", "query_id").equals(want.drop("run_id").sort("pool_id", "query_id"))


def test_a_damaged_part_in_a_reuse_folder_is_skipped_named_and_left_alone(tmp_path, caplog, sample_audit):
    night1 = sample_audit.copy(tmp_path / "night1")
    part = next((night1 / "utilities").glob("*.parquet"))
    _damage(part, "truncated")
    before = _tree(night1)
    with caplog.at_level(logging.WARNING):
        second = _sample(tmp_path / "night2", reuse=[str(night1)])
    assert any(part.name in r.getMessage() and "skipped" in r.getMessage() for r in caplog.records)
    assert second.evaluated == sample_audit.counts()["coalitions_evaluated"] and second.imported == 0
    assert _tree(night1) == before  # an input: never written


def test_a_part_of_another_schema_version_is_one_line_before_any_evaluation(tmp_path, capsys, sample_audit):
    out = sample_audit.copy(tmp_path / "o")
    part = next((out / "utilities").glob("*.parquet"))
    table = pq.read_table(part).replace_schema_metadata({b"meclear.schema_version": b"99"})
    part.unlink()
    new = writer.write_part(table, out / "utilities")  # a whole part, correctly named, of version 99
    pq.write_table(table, new)  # (write_part stamps the current version: put 99 back, then name it by its digest)
    os.replace(new, out / "utilities" / f"part-{writer.digest(new)[:24]}.parquet")
    before = _tree(out)
    assert _audit(out) == 2
    _one_line(capsys, "schema version 99", "version 1", "utilities/part-")
    assert _tree(out) == before  # refused before the manifest says `running`


def test_a_manifest_of_another_schema_version_is_one_line(tmp_path, capsys, sample_audit):
    out = sample_audit.copy(tmp_path / "o")
    m = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps(m | {"schema_version": 7}))
    before = _tree(out)
    for args in (["audit", "--out", str(out), *BASE], ["report", str(out), "--figures", "none"],
                 ["curate", str(out), "--out", str(tmp_path / "c.parquet")]):
        assert main(args) == 2, args
        _one_line(capsys, "manifest.json", "version 7", "version 1")
    assert _tree(out) == before


@pytest.mark.parametrize("command", ["report", "curate"])
def test_report_or_curate_on_a_killed_run_is_one_line(tmp_path, capsys, command, sample_audit):
    out = sample_audit.copy(tmp_path / "o")
    m = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps({k: m[k] for k in ("run_id", "status", "attempt", "datasets")}
                                                  | {"status": "running"}))  # what a killed run leaves
    args = [command, str(out)] + (["--figures", "none"] if command == "report" else ["--out", str(tmp_path / "c.pq")])
    assert main(args) == 2  # was exit 1: KeyError 'agent'
    _one_line(capsys, "has not finished")


@pytest.mark.parametrize("command", ["report", "curate"])
def test_a_missing_column_is_one_line_naming_the_file_and_the_column(tmp_path, capsys, command, sample_audit):
    out = sample_audit.copy(tmp_path / "o")
    part = next((out / "clearances").glob("*.parquet"))
    table = pq.read_table(part).drop(["gain"])
    part.unlink()
    new = writer.write_part(table, out / "clearances", part.name.rsplit("-", 1)[0])
    args = [command, str(out)] + (["--figures", "none"] if command == "report" else ["--out", str(tmp_path / "c.pq")])
    assert main(args) == 2
    _one_line(capsys, str(new), "'gain'")


def test_a_damaged_part_in_a_run_report_reads_is_one_line_naming_it(tmp_path, capsys, sample_audit):
    out = sample_audit.copy(tmp_path / "o")
    part = next((out / "attributions").glob("*.parquet"))
    _damage(part, "truncated")
    assert main(["report", str(out), "--figures", "none"]) == 2
    _one_line(capsys, str(part), "damaged")


def test_a_full_disk_is_one_line_leaves_no_half_file_and_the_rerun_resumes(tmp_path, capsys, monkeypatch):
    """ENOSPC mid-run (issue 17: a 36-line traceback). Arrow writes the file itself, so the fault is injected where
    it writes: the third part written gets half its bytes, then the OS error a full disk gives."""
    out = tmp_path / "o"
    real, calls = pq.write_table, {"n": 0}

    def full(table, where, **kw):
        calls["n"] += 1
        if calls["n"] == 3:
            Path(where).write_bytes(b"PAR1" + b"\0" * 100)
            raise OSError(errno.ENOSPC, "No space left on device", str(where))
        return real(table, where, **kw)

    monkeypatch.setattr(writer.pq, "write_table", full)
    assert _audit(out, "--batch-size", "8") == 2
    _one_line(capsys, "disk full", "rerun")
    assert not [p for p in out.rglob("*.tmp")]  # nothing half-written under any name
    assert not (out / ".meclear.lock").exists()
    monkeypatch.setattr(writer.pq, "write_table", real)
    assert _audit(out) == 0


def test_a_finished_manifest_missing_a_field_is_one_line_naming_it(tmp_path, capsys, sample_audit):
    out = sample_audit.copy(tmp_path / "o")
    m = json.loads((out / "manifest.json").read_text())
    del m["config"]["tau"]
    (out / "manifest.json").write_text(json.dumps(m))
    assert main(["report", str(out), "--figures", "none"]) == 2
    _one_line(capsys, "manifest.json", "config.tau")
