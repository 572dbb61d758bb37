"""`.meclear.lock`: one run at a time per output folder, held with `fcntl.flock` on the open lock file.

The kernel holds the lock, not the file: it goes with the process however that process ends (kill -9 included), so a
lock file left behind is just a file, and the next run takes it over. Exactly one process can: `flock(LOCK_EX |
LOCK_NB)` admits one holder per file, and a taker checks that the file it locked is still the one at the path (a
holder unlinks the file on release while still holding it; a process that opened the old file before then holds a
lock on a file nobody else can reach, notices, and tries again). The file's text (pid, host, start time) is only for
the message a second run prints; its content is never trusted: a lock file holding garbage (pid "abc") that nobody
holds is taken over like any stale one. A lock path that is not a regular file (a folder, a FIFO) is refused with one
line. flock also works on NFS v4 (Linux emulates it with byte-range locks there); on other network file systems a run
on another host may not see the lock.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import stat
import time
from pathlib import Path

from pipeline.core.errors import OutputError

log = logging.getLogger(__name__)

LOCK = ".meclear.lock"


class OutLock:
    """`.meclear.lock` in the output folder, held for the run. Use as a context manager."""

    def __init__(self, out: Path):
        self.path = Path(out) / LOCK
        self.held = False
        self._fd: int | None = None
        self._created: Path | None = None  # the topmost folder this lock created, removed again if left empty

    def acquire(self) -> None:
        missing = [p for p in [self.path.parent, *self.path.parent.parents] if not p.exists()]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._created = missing[-1] if missing else None
        for _ in range(100):  # each retry means a holder released between our open and our flock
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner = self._owner(fd)
                os.close(fd)
                raise OutputError(f"--out {self.path.parent}: in use by pid {owner.get('pid')} on {owner.get('host')} "
                                  f"since {owner.get('started')}; wait for it or stop it") from None
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # locked a file its holder unlinked on release: not the lock any more
                os.close(fd)
                continue
            before = os.fstat(fd).st_size
            if before:
                log.warning("%s: taking over a stale lock (%s)", self.path, self._owner(fd))
            info = {"pid": os.getpid(), "host": socket.gethostname(),
                    "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(info).encode(), 0)
            self._fd, self.held = fd, True
            return
        raise OutputError(f"--out {self.path.parent}: could not take the lock {self.path}")

    def _open(self) -> int:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
        except IsADirectoryError:
            raise OutputError(f"--out {self.path.parent}: {LOCK} is a folder, not meclear's lock file; "
                              "remove it and rerun") from None
        except OSError as exc:  # a symlink (ELOOP), no permission, ...
            raise OutputError(f"--out {self.path.parent}: cannot open the lock {self.path} ({exc.strerror})") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise OutputError(f"--out {self.path.parent}: {LOCK} is not a regular file; remove it and rerun")
        return fd

    @staticmethod
    def _owner(fd: int) -> dict:
        """The holder's note (pid, host, start); placeholders where it is unreadable (it is never trusted)."""
        try:
            data = json.loads(os.pread(fd, 4096, 0) or b"{}")
        except (ValueError, OSError):
            data = None
        data = data if isinstance(data, dict) else {}
        return {k: data.get(k, "?") for k in ("pid", "host", "started")}

    def release(self) -> None:
        if not self.held:
            return
        # Unlinked while still held, then closed: a process waiting on the old file sees it was replaced (`acquire`).
        try:
            if os.fstat(self._fd).st_ino == os.stat(self.path).st_ino:
                self.path.unlink()
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd, self.held = None, False
        if self._created is not None:  # a run that wrote nothing leaves no folder behind
            for p in [self.path.parent, *self.path.parent.parents]:
                try:
                    p.rmdir()
                except OSError:
                    break
                if p == self._created:
                    break

    def __enter__(self) -> "OutLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
