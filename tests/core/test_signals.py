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

from tests.agents.test_llm_startup import _alive
from tests.data_paths import LOCOMO

ROOT = Path(__file__).resolve().parents[2]

SLOW_CLI = """
import sys, time
from pathlib import Path
from pipeline.agents.reader import ReaderAgent
from pipeline.cli.main import main

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
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli.main", "audit", "--out", str(out), "--executor", "ray",
                             "--actors", "1", "--dense", "off", "--no-progress", "--locomo", str(LOCOMO)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_running(proc, out, timeout=240)
    tree = {p.pid for p in psutil.Process(proc.pid).children(recursive=True)}
    assert tree, "Ray started no process"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-3000:]
    _assert_stopped_cleanly(err, out, tree)


def _assert_stopped_cleanly(log: str, out: Path, tree: set[int]) -> None:
    """One line last, no C++ stack dump or traceback, the lock released, none of `tree` alive 30 s later."""
    assert log.strip().splitlines()[-1] == "meclear: stopped by SIGTERM; agents shut down, lock released", log[-3000:]
    for dump in ("*** SIG", "Stack trace", "Traceback"):
        assert dump not in log, log[-3000:]
    assert not (out / ".meclear.lock").exists()
    deadline = time.monotonic() + 30
    while _alive(tree) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = [(pid, psutil.Process(pid).cmdline()[:2]) for pid in _alive(tree)]
    assert not left, f"processes left 30 s after SIGTERM: {left}"


def _free_ports(n: int) -> list[int]:
    import socket

    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _stop_head(temp_dir: str) -> None:
    """Stop only this test's head: the processes whose command line names its private temp dir, and their children
    (`ray stop` would stop every Ray on the machine)."""
    procs = [p for p in psutil.process_iter(["cmdline"]) if p.pid != os.getpid()
             and any(temp_dir in a for a in (p.info["cmdline"] or []))]
    tree = list({*procs, *(c for p in procs for c in p.children(recursive=True))})
    for p in tree:
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(tree, timeout=10)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass


@pytest.mark.ray
@pytest.mark.skipif(not LOCOMO.exists(), reason="LoCoMo is not beside the checkout")
def test_ray_job_stop_of_an_audit_on_a_ray_start_head(tmp_path):
    """`ray job stop` (SIGTERM to the entrypoint, SIGKILL 3 s later): one line, no C++ dump, the lock released, and
    neither the entrypoint nor its actors alive 30 s later. A private head: loopback, own temp dir and ports."""
    ray_bin = str(Path(sys.executable).with_name("ray"))
    temp_dir = tempfile.mkdtemp(prefix="msj-", dir="/tmp")
    gcs, dash, agent, client = _free_ports(4)
    env = os.environ | {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    address = f"http://127.0.0.1:{dash}"
    out = tmp_path / "o"
    try:
        subprocess.run([ray_bin, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={gcs}",
                        "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", "--include-dashboard=true",
                        f"--dashboard-agent-listen-port={agent}", f"--ray-client-server-port={client}",
                        f"--temp-dir={temp_dir}", "--num-cpus=2", "--disable-usage-stats"],
                       env=env, check=True, capture_output=True, timeout=180)
        runtime_env = json.dumps({"env_vars": {"PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "disabled"}})
        job = ["--address", address]
        deadline = time.monotonic() + 120
        while True:  # the job agent comes up a little after `ray start` returns
            sub = subprocess.run([ray_bin, "job", "submit", *job, "--no-wait", "--submission-id", "stop-me",
                                  "--runtime-env-json", runtime_env, "--", sys.executable, "-m", "pipeline.cli.main",
                                  "audit", "--out", str(out), "--executor", "ray", "--actors", "1", "--dense", "off",
                                  "--no-progress", "--locomo", str(LOCOMO)], env=env, capture_output=True, text=True)
            if sub.returncode == 0 or time.monotonic() > deadline:
                break
            time.sleep(3)
        assert sub.returncode == 0, sub.stderr[-2000:]
        deadline = time.monotonic() + 180
        while not (out / "manifest.json").exists() and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(2.0)
        assert (out / ".meclear.lock").exists(), "the job is not running"
        job_tree = set()
        for p in psutil.process_iter(["cmdline"]):
            if f"--out {out}" in " ".join(p.info["cmdline"] or []):
                job_tree |= {p.pid, *(c.pid for c in p.children(recursive=True))}
            if "AgentWorker" in (p.info["cmdline"] or [""])[0]:
                try:
                    if temp_dir in " ".join(p.parent().cmdline()):  # an actor of this head's raylet
                        job_tree.add(p.pid)
                except psutil.Error:
                    pass
        assert job_tree
        subprocess.run([ray_bin, "job", "stop", *job, "stop-me"], env=env, check=True, capture_output=True,
                       timeout=60)
        logs = subprocess.run([ray_bin, "job", "logs", *job, "stop-me"], env=env, capture_output=True, text=True).stdout
        _assert_stopped_cleanly(logs, out, job_tree)
    finally:
        _stop_head(temp_dir)
