"""`meclear report`: the page opened in headless Chromium (screenshot, DOM after scripts), escaping of user text,
trends over a previous run of a changed pool, and the eval folder through the same page code."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

from pipeline.audit.run import AuditConfig, InputSpec, audit, sample_paths
from pipeline.cli.main import main
from pipeline.report.page import json_for_script
from tests.chromium import dump_dom, needs_chromium, screenshot
from tests.data_paths import LOCOMO

FAST = AuditConfig(executor="local", dense="off")
PAYLOAD = ("<script>alert(1)</script> "
           "</script><script>document.documentElement.setAttribute('data-xss','script')</script> "
           "<img src=x onerror=\"document.documentElement.setAttribute('data-xss','img')\">")


def _write_pool(path: Path, drop: set[str] = frozenset(), edit: dict[str, str] | None = None) -> Path:
    mem, _ = sample_paths()
    rows = [json.loads(line) for line in mem.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r["memory_id"] not in drop]
    for r in rows:
        if edit and r["memory_id"] in edit:
            r["text"] = r["text"] + " " + edit[r["memory_id"]]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _audit(tmp: Path, name: str, memories: Path) -> Path:
    _, queries = sample_paths()
    out = tmp / name
    audit(InputSpec(memories=[str(memories)], queries=[str(queries)]), FAST, out, progress=False)
    return out


def _html_tag(dom: str) -> str:
    return re.search(r"<html[^>]*>", dom).group(0)


@pytest.fixture(scope="module")
def sample(tmp_path_factory, sample_audit) -> Path:
    out = sample_audit.copy(tmp_path_factory.mktemp("report") / "run")  # the report is written into the run
    assert main(["report", str(out), "--no-progress"]) == 0
    return out


def test_json_in_script_cannot_close_the_tag():
    text = json_for_script({"t": "</script><script>x()</script> & <!--"})
    assert "<" not in text and ">" not in text and "&" not in text
    assert json.loads(text) == {"t": "</script><script>x()</script> & <!--"}


@needs_chromium
def test_report_screenshot_shows_the_pool_summary(sample, tmp_path):
    page = sample / "report.html"
    html = page.read_text()
    # no external assets: nothing is fetched (namespace URIs such as xmlns="http://www.w3.org/2000/svg" are names)
    assert not re.search(r"(src|href)\s*=\s*[\"']?(https?:|//)|url\(\s*[\"']?(https?:|//)|@import", html)
    png = screenshot(page.as_uri() + "#q=ben/ben-q1", tmp_path / "shot.png")
    imread = pytest.importorskip("matplotlib.image", reason="reads the screenshot: pip install 'meclear[eval]'").imread
    img = imread(png)[..., :3]
    assert img.shape[0] >= 1000 and img.shape[1] >= 1200
    nonwhite = (img < 0.95).any(axis=2).mean()
    assert 0.03 < nonwhite < 0.9, f"screenshot looks blank or broken ({nonwhite:.3f} non-white)"
    header = img[:40, :, :]  # the dark header band (#1f3b57)
    assert np.abs(header.mean(axis=(0, 1)) - np.array([0x1F, 0x3B, 0x57]) / 255).max() < 0.12
    dom = dump_dom(page.as_uri() + "#q=ben/ben-q1")
    pools = dom[dom.index('id="pools"'):dom.index('id="queries"')]
    for text in ("queries audited", "harmful memory flags", "recovered by clearance", "ana", "ben", "chen", "dara",
                 "<svg"):
        assert text in pools, text
    # the list was rendered by the page's script, and the detail of the query in the URL opened with its figure
    assert dom.count("<tr data-i=") == 36
    detail = dom[dom.index('id="detail"'):]
    assert "What is Ben's favorite drink?" in detail and "ben-03, ben-02" in detail and "<svg" in detail
    assert 'data-detail="ben/ben-q1"' in dom


@needs_chromium
def test_script_in_a_memory_shows_as_text_and_does_not_run(tmp_path):
    pool = _write_pool(tmp_path / "mem.jsonl", edit={"ana-02": PAYLOAD})
    out = _audit(tmp_path, "xss", pool)
    assert main(["report", str(out), "--figures", "all", "--no-progress"]) == 0
    url = (out / "report.html").as_uri() + "#q=ana/ana-q1"
    dom = dump_dom(url)
    assert "data-xss" not in _html_tag(dom), "a script from a memory ran"
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in dom  # shown as text in the frozen-context table
    assert "&lt;img src=x onerror=" in dom
    # controls, so that both checks can fail: unescaped, the payload's scripts do run here; and a page that opens an
    # alert() dialog never finishes its dump in headless Chromium (the dialog blocks), so the report above finishing
    # its dump is evidence that no dialog opened
    control = tmp_path / "control.html"
    control.write_text(f"<!DOCTYPE html><html><body><p>{PAYLOAD.replace('alert(1)', '')}</p></body></html>")
    assert "data-xss" in _html_tag(dump_dom(control.as_uri()))
    dialog = tmp_path / "dialog.html"
    dialog.write_text("<!DOCTYPE html><html><body><script>alert(1)</script></body></html>")
    with pytest.raises(subprocess.TimeoutExpired):
        dump_dom(dialog.as_uri(), timeout=15)


@needs_chromium
def test_previous_run_shows_a_memory_that_became_harmful(tmp_path, sample_audit):
    night1 = _audit(tmp_path, "night1", _write_pool(tmp_path / "m1.jsonl", drop={"ana-02"}))
    night2 = sample_audit.copy(tmp_path / "night2")  # the whole sample pool: ana-02 (stale city) is back
    out = tmp_path / "trend.html"
    assert main(["report", str(night2), "--previous", str(night1), "--out", str(out), "--no-progress"]) == 0
    dom = dump_dom(out.as_uri())
    trends = dom[dom.index('id="trends"'):dom.index('id="queries"')]
    became = trends[trends.index("Became harmful"):trends.index("Stopped being harmful")]
    assert "ana-02" in became and "Porto" in became  # id and text of the memory that turned harmful
    assert "<td>ana</td><td>ana-02</td>" in became.replace("\n", "")
    stopped = trends[trends.index("Stopped being harmful"):]
    assert "ana-02" not in stopped
    assert "<svg" in trends and "night1" in trends and "night2" in trends


def test_report_rejects_a_folder_that_is_not_a_run(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(tmp_path) in err
    assert not (tmp_path / "report.html").exists()


@pytest.mark.skipif(not LOCOMO.is_file(), reason=f"{LOCOMO} not available")
def test_eval_folder_renders_through_the_same_page(tmp_path):
    ev = tmp_path / "eval"
    assert main(["eval", "--locomo", str(LOCOMO), "--conversations", "conv-26", "--replicates", "50",
                 "--max-cases", "2", "--methods", "meclear_l4,loo", "--dense", "off", "--executor", "local",
                 "--no-progress", "--out", str(ev)]) == 0
    assert main(["report", str(ev)]) == 0
    html = (ev / "report.html").read_text()
    assert "meclear_l4" in html and "loo" in html and "data:image/png;base64," in html
    assert "from 1 conversations" in html or "from 1 conversation" in html
