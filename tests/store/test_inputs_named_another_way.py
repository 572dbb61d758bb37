"""Issue 29: a run folder's inputs are named by resolved path (and device/inode), so no command's working directory
changes what it protects; a run given twice, unfinished, or of another kind is one line (exit 2), nothing written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pipeline.audit.run import AuditConfig, InputSpec, audit, sample_paths
from pipeline.cli.main import main
from pipeline.store import manifest as manifests

FAST = AuditConfig(executor="local", dense="off")


def _tree(folder: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else None) for p in sorted(folder.rglob("*"))}


@pytest.fixture()
def bank_run(tmp_path, monkeypatch):
    """An audit of a memory bank folder, run with relative paths from tmp_path; the test then works from elsewhere."""
    mem, queries = sample_paths()
    (tmp_path / "bank").mkdir()
    shutil.copy(mem, tmp_path / "bank" / "memories.jsonl")
    shutil.copy(queries, tmp_path / "queries.jsonl")
    monkeypatch.chdir(tmp_path)
    audit(InputSpec(memories=("bank",), queries=("queries.jsonl",)), FAST, "run", progress=False)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    return tmp_path


def test_the_manifest_names_inputs_by_resolved_path_device_and_inode(bank_run):
    m = manifests.read(bank_run / "run")
    bank = (bank_run / "bank" / "memories.jsonl").resolve()
    rec = next(i for i in m.inputs if i["path"] == str(bank))
    assert (rec["device"], rec["inode"]) == (bank.stat().st_dev, bank.stat().st_ino)
    assert m.input_folders == [str((bank_run / "bank").resolve())]


@pytest.mark.parametrize("out", ["../bank/memories.jsonl", "../bank/curation.parquet", "link.parquet"])
def test_curate_from_another_folder_never_writes_into_the_bank(bank_run, out, capsys):
    (bank_run / "elsewhere" / "link.parquet").symlink_to(bank_run / "bank" / "memories.jsonl")
    before = _tree(bank_run / "bank")
    assert main(["curate", "../run", "--out", out]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "which this curation reads or its run was made from" in err, err
    assert _tree(bank_run / "bank") == before


def test_a_hard_link_to_an_input_is_refused_by_device_and_inode(bank_run, capsys):
    (bank_run / "elsewhere" / "hard.jsonl").hardlink_to(bank_run / "queries.jsonl")
    assert main(["curate", "../run", "--out", "hard.jsonl"]) == 2
    assert "is the same file as an input" in capsys.readouterr().err


@pytest.mark.parametrize("second", ["../run", "../run/", "./../run/.", "COPY", "LINK"])
def test_a_run_given_twice_is_one_line_and_nothing_written(bank_run, second, capsys):
    if second == "COPY":
        shutil.copytree(bank_run / "run", bank_run / "copy")
        second = "../copy"
    elif second == "LINK":
        (bank_run / "elsewhere" / "lnk").symlink_to(bank_run / "run")
        second = "lnk"
    assert main(["curate", "../run", second, "--out", "c.parquet"]) == 2
    assert "(given twice); give each run once" in capsys.readouterr().err
    assert main(["report", "../run", "--previous", second, "--out", "r.html", "--no-progress"]) == 2
    assert "(given twice)" in capsys.readouterr().err
    assert not Path("c.parquet").exists() and not Path("r.html").exists()


@pytest.mark.parametrize("edit,words", [
    ({"status": None}, "status None is not one of"),
    ({"status": "running"}, "the run has not finished"),
    ({"kind": "eval"}, "kind 'eval'"),
])
def test_a_run_that_is_unfinished_or_of_another_kind_is_refused_everywhere(bank_run, edit, words, capsys):
    shutil.copytree(bank_run / "run", bank_run / "night2")
    p = bank_run / "night2" / "manifest.json"
    p.write_text(json.dumps(json.loads(p.read_text()) | edit))
    for argv in (["curate", "../night2", "--out", "c.parquet"],
                 ["report", "../run", "--previous", "../night2", "--out", "r.html", "--no-progress"]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and words in err, err


def test_an_eval_folder_as_previous_is_named_as_one(bank_run, capsys):
    ev = bank_run / "ev"
    ev.mkdir()
    (ev / "summary.json").write_text("{}")
    (ev / "cases.parquet").write_bytes(b"PAR1")
    assert main(["report", "../run", "--previous", "../ev", "--out", "r.html", "--no-progress"]) == 2
    assert "is an eval output; --previous takes audit run folders only" in capsys.readouterr().err


def test_glob_characters_in_out_are_literal(tmp_path, capsys):
    out = tmp_path / "night[1]*"
    assert main(["audit", "--out", str(out), "--executor", "local", "--dense", "off", "--no-progress"]) == 0
    assert manifests.read(out).status == "complete"
    reused = tmp_path / "b[2]"
    assert main(["audit", "--out", str(reused), "--reuse", str(out), "--executor", "local", "--dense", "off",
                 "--no-progress"]) == 0
    assert manifests.read(reused).counts["coalitions_imported_from_reuse"] > 0


def test_top_k_one_audits(tmp_path):
    assert main(["audit", "--out", str(tmp_path / "k1"), "--top-k", "1", "--executor", "local", "--dense", "off",
                 "--no-progress"]) == 0
    assert manifests.read(tmp_path / "k1").counts["cases"] == 36


def test_report_progress_is_plain_lines_off_a_terminal(bank_run, capsys):
    assert main(["report", "../run", "--out", "r.html", "--figures", "all"]) == 0
    err = capsys.readouterr().err
    assert "\r" not in err and "query figures:" in err


def test_bidi_controls_are_visible_in_the_page():
    from pipeline.report.page import document

    page = document("t\u202e", "s", ["<p>x</p>"], {"q": ["a\u202eb", "\u2066c"]})
    assert "\u202e" not in page and "\u2066" not in page and "\\u202e" in page
