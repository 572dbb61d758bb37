"""Engine processes die with their owner, even when the owner is killed with SIGKILL (as `ray.kill` does to an agent
actor): real processes, no engine needed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager

import pytest

psutil = pytest.importorskip("psutil")

# An owner that starts a long-lived child (standing in for an engine worker), guards it, prints its pid, then waits.
OWNER = r"""
import subprocess, sys, time
from pipeline.core import reaper
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
watcher = reaper.guard([child.pid])
print(child.pid, watcher.pid, flush=True)
time.sleep(600)
"""


def _gone(pid: int, timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


@contextmanager
def _owner(script: str):
    """Run `script` as the owner process; yields (owner, child pid, watcher pid); kills what is left afterwards."""
    env = os.environ | {"PYTHONPATH": os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))}
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    child, watcher = map(int, owner.stdout.readline().split())
    try:
        yield owner, child, watcher
    finally:
        for pid in (child, watcher):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_killed_owner_takes_its_engine_processes_along():
    with _owner(OWNER) as (owner, child, watcher):
        assert not _gone(child, timeout_s=1.5)  # the watcher leaves it alone while the owner lives
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait()
        assert _gone(child), "the guarded child outlived its owner"
        assert _gone(watcher), "the watcher did not exit after its owner"


def test_nothing_to_guard_starts_no_watcher():
    from pipeline.core import reaper

    assert reaper.guard([]) is None


# As OWNER, but the child's recorded start time is not its own: what the watcher sees when the engine process died
# earlier and its id was reused by an unrelated process (the child here stands in for that process).
REUSED = r"""
import subprocess, sys, time
from pipeline.core import reaper
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], stdout=subprocess.DEVNULL)
watcher = reaper.guard([child.pid], started={child.pid: reaper.start_time(child.pid) - 1})
print(child.pid, watcher.pid, flush=True)
time.sleep(600)
"""


def test_a_reused_process_id_is_not_killed():
    with _owner(REUSED) as (owner, child, watcher):
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait()
        assert _gone(watcher), "the watcher did not exit after its owner"
        assert not _gone(child, timeout_s=1.0), "the watcher killed a process whose start time did not match"


def test_start_time_names_one_process():
    from pipeline.core import reaper

    me = reaper.start_time(os.getpid())
    assert isinstance(me, int) and me > 0
    assert reaper.start_time(os.getpid()) == me
    assert abs(psutil.Process().create_time() - psutil.boot_time() - me / os.sysconf("SC_CLK_TCK")) < 2.0
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert reaper.start_time(child.pid) is None  # reaped: gone
