"""Engine processes die with their owner, however the owner dies.

A vLLM engine runs in child processes (EngineCore, and on CPU a VLLM::Worker under it). When Ray kills an agent actor
(`ray.kill`, a driver that exits or is killed, a node shutting down a job), the actor gets SIGKILL and has no chance to
shut its engine down; the engine core follows it, but its worker was seen to live on, holding a core and its memory
(measured: a `VLLM::Worker` left running after the driver was terminated mid-build). `guard` starts a small watcher
process that outlives the owner, polls it, and kills the recorded engine processes once it is gone.

A process id is recorded with its start time (`start_time`) and the watcher kills only a process whose start time still
matches: an engine process that died earlier may have had its id reused by an unrelated process, which must live.
"""

from __future__ import annotations

import os
import subprocess
import sys

_WATCHER = r"""
import os, signal, sys, time
owner = int(sys.argv[1])
pids = [tuple(int(v) for v in a.split(":")) for a in sys.argv[2:]]  # pid:start time in clock ticks
def started(pid):
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None
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
for pid, start in pids:
    if started(pid) != start:  # gone, or its id now belongs to another process
        continue
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
"""


def start_time(pid: int) -> int | None:
    """When process `pid` started, in clock ticks after boot (field 22 of /proc/<pid>/stat), or None when it is gone.
    A process id and its start time name one process for good: ids are reused, (id, start time) pairs are not.
    The field is read after the last ')' because the command name before it may hold spaces and parentheses."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


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


def guard(pids: list[int], owner: int | None = None,
          started: dict[int, int | None] | None = None) -> subprocess.Popen | None:
    """Kill `pids` once `owner` (default: this process) has exited, each only if it is still the process that had
    that id now (same start time). `started`: start times recorded earlier (default: read now, when the pids are
    known to be the engine's). The watcher runs in its own session so a signal to the owner's process group does not
    take it down first; it exits by itself after the owner."""
    started = dict(started or {})
    marks = [f"{p}:{t}" for p in pids if (t := started.get(p, start_time(p))) is not None]
    if not marks:
        return None
    owner = owner or os.getpid()
    return subprocess.Popen([sys.executable, "-c", _WATCHER, str(owner), *marks], start_new_session=True,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            close_fds=True)
