"""SIGTERM and SIGHUP handled the way Ctrl-C is: what `ray job stop`, Kubernetes, Slurm and a closed terminal send.

`handled()` turns either signal into `Terminated` (a KeyboardInterrupt, so every `finally` and `except
KeyboardInterrupt` that already shuts agents and engines down and releases the lock runs for it too) raised in the main
thread; the command then prints one line and exits 128 + the signal's number (143 for SIGTERM, 129 for SIGHUP), the
shell's convention, so a scheduler reads which signal stopped the run. A second signal during that cleanup is ignored:
the cleanup is already under way (a scheduler's grace period ends with SIGKILL anyway). `ray.init` installs its own
SIGTERM handler (a bare `sys.exit`, which under Ray ended in a C++ stack dump and exit 134), so `reinstall()` runs
again after Ray starts.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Iterator

SIGNALS = (signal.SIGTERM, signal.SIGHUP)
_state: dict = {"active": False, "fired": None}  # fired: the signal received, if any


class Terminated(KeyboardInterrupt):
    """The process was sent SIGTERM or SIGHUP; `exit_code` is 128 + the signal number."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum
        self.name = signal.Signals(signum).name
        self.exit_code = 128 + signum


def _raise(signum: int, frame) -> None:
    if _state["fired"]:  # cleanup from the first one is running: let it finish
        return
    _state["fired"] = signum
    raise Terminated(signum)


def reinstall() -> None:
    """Put the handlers back (after a library replaced them, as `ray.init` does with SIGTERM)."""
    if _state["active"] and threading.current_thread() is threading.main_thread():
        for s in SIGNALS:
            signal.signal(s, _raise)


@contextmanager
def handled() -> Iterator[None]:
    """SIGTERM and SIGHUP raise `Terminated` in the main thread for the body; the previous handlers come back after."""
    if threading.current_thread() is not threading.main_thread():  # signal handlers can only be set there
        yield
        return
    previous = {s: signal.getsignal(s) for s in SIGNALS}
    _state.update(active=True, fired=None)
    reinstall()
    try:
        yield
    finally:
        _state["active"] = False
        for s, h in previous.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)


def stopped_line(prog: str, exc: KeyboardInterrupt) -> tuple[str, int]:
    """(the one line a command prints when stopped by a signal, its exit code): 130 for Ctrl-C, 128 + n otherwise."""
    from pipeline.core.errors import EXIT_INTERRUPTED

    # Ray's `ray.get` re-raises whatever interrupted its wait as a plain KeyboardInterrupt: the signal is read back from
    # what the handler recorded, not only from the exception's type.
    signum = exc.signum if isinstance(exc, Terminated) else _state["fired"]
    if signum:
        return f"{prog}: stopped by {signal.Signals(signum).name}; agents shut down, lock released", 128 + signum
    return f"{prog}: interrupted; agents shut down", EXIT_INTERRUPTED
