"""Engine processes die with their owner, however the owner dies.

A vLLM engine runs in child processes (EngineCore, and on CPU a VLLM::Worker under it). When Ray kills an agent actor
(`ray.kill`, a driver that exits or is killed, a node shutting down a job), the actor gets SIGKILL and has no chance to
shut its engine down; the engine core follows it, but its worker was seen to live on, holding a core and its memory
(measured: a `VLLM::Worker` left running after the driver was terminated mid-build). `guard` starts a small watcher
process that outlives the owner, polls it, and kills the recorded engine processes once it is gone.
"""

from __future__ import annotations

import os
import subprocess
import sys

_WATCHER = r"""
import os, signal, sys, time
owner, pids = int(sys.argv[1]), [int(p) for p in sys.argv[2:]]
def alive(pid):
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
while alive(owner):
    time.sleep(1.0)
for pid in pids:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
"""


def descendants(pid: int | None = None) -> list[int]:
    """Process ids below `pid` (default: this process), children first; empty without psutil."""
    try:
        import psutil  # a vLLM dependency: present wherever engines run
    except ImportError:
        return []
    try:
        return [p.pid for p in psutil.Process(pid or os.getpid()).children(recursive=True)]
    except psutil.Error:
        return []


def guard(pids: list[int], owner: int | None = None) -> subprocess.Popen | None:
    """Kill `pids` once `owner` (default: this process) has exited. The watcher runs in its own session so a signal
    to the owner's process group does not take it down first; it exits by itself after the owner."""
    if not pids:
        return None
    owner = owner or os.getpid()
    return subprocess.Popen([sys.executable, "-c", _WATCHER, str(owner), *map(str, pids)], start_new_session=True,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            close_fds=True)
