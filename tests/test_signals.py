"""SIGTERM and SIGHUP, as a scheduler sends them, stop a run the way Ctrl-C does: the agents closed, the lock
released, one line, exit 128 + the signal (143, 129); under Ray no C++ stack dump and no Ray process left 30 s later."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from data_paths import LOCOMO
from test_llm_startup import _alive

ROOT = Path(__file__).resolve().parents[1]

SLOW_CLI = """
import sys, time
from pathlib import Path
from pipeline.agents.reader import ReaderAgent
from pipeline.cli import main

answer = ReaderAgent.answer_batch
ReaderAgent.answer_batch = lambda self, requests: (time.sleep(0.2), answer(self, requests))[1]
ReaderAgent.close = lambda self: Path(sys.argv[2]).write_text("closed")
sys.exit(main(["audit", "--out", sys.argv[1], "--executor", "local", "--dense", "off", "--batch-size", "32"]))
"""


def _wait_running(proc: subprocess.Popen, out: Path, timeout: float = 120) -> None:
    """Until the run has opened its folder (manifest `running`), then a moment more: mid-evaluation."""
    deadline = time.monotonic() + timeout
    while not (out / "manifest.json").exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    time.sleep(1.0)
    assert proc.poll() is None, proc.communicate()[1][-3000:]


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_sigterm_and_sighup_close_the_agent_release_the_lock_and_exit_128_plus_n(tmp_path, sig, code):
    out, marker = tmp_path / "o", tmp_path / "closed"
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", SLOW_CLI, str(out), str(marker)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_running(proc, out)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err[-2000:]
    name = signal.Signals(sig).name
    assert err.strip().splitlines()[-1] == f"meclear: stopped by {name}; agents shut down, lock released", err[-2000:]
    assert "Traceback" not in err
    assert marker.read_text() == "closed" and not (out / ".meclear.lock").exists()
    assert json.loads((out / "manifest.json").read_text())["status"] == "running"  # never mistaken for complete


@pytest.mark.skipif(not LOCOMO.exists(), reason="LoCoMo is not beside the checkout")
def test_sigterm_under_ray_leaves_no_stack_dump_and_no_ray_process(tmp_path):
    """An embedded Ray (`--executor ray`): issue 17 saw exit 134 with a C++ stack dump, the lock left, and Ray's agents
    orphaned for about 2 minutes."""
    out = tmp_path / "o"
    ray_tmp = tempfile.mkdtemp(prefix="ms-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    env = os.environ | {"PYTHONPATH": str(ROOT), "RAY_TMPDIR": ray_tmp}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "audit", "--out", str(out), "--executor", "ray",
                             "--actors", "1", "--dense", "off", "--no-progress", "--locomo", str(LOCOMO)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_running(proc, out, timeout=240)
    tree = {p.pid for p in psutil.Process(proc.pid).children(recursive=True)}
    assert tree, "Ray started no process"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-3000:]
    assert err.strip().splitlines()[-1] == "meclear: stopped by SIGTERM; agents shut down, lock released", err[-3000:]
    for dump in ("*** SIG", "Stack trace", "Traceback"):
        assert dump not in err, err[-3000:]
    assert not (out / ".meclear.lock").exists()
    deadline = time.monotonic() + 30
    while _alive(tree) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = [(pid, psutil.Process(pid).cmdline()[:2]) for pid in _alive(tree)]
    assert not left, f"Ray processes left 30 s after SIGTERM: {left}"
