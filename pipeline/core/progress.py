"""Progress on stderr: a tqdm bar on a terminal; plain periodic lines otherwise (job logs get no carriage returns)."""

from __future__ import annotations

import sys
import time


class _Lines:
    """`desc: n/total (pct%), rate/s` every `every_s` seconds and once at the end."""

    def __init__(self, total: int, desc: str, unit: str, every_s: float, stream):
        self.total, self.desc, self.unit, self.every_s, self.stream = total, desc, unit, every_s, stream
        self.n, self.t0 = 0, time.monotonic()
        self._last = self.t0

    def _line(self) -> None:
        dt = max(time.monotonic() - self.t0, 1e-9)
        pct = 100.0 * self.n / self.total if self.total else 100.0
        print(f"{self.desc}: {self.n}/{self.total} {self.unit}s ({pct:.0f}%), {self.n / dt:.1f} {self.unit}/s, "
              f"{dt:.0f} s", file=self.stream, flush=True)

    def update(self, n: int = 1) -> None:
        self.n += n
        if time.monotonic() - self._last >= self.every_s:
            self._last = time.monotonic()
            self._line()

    def close(self) -> None:
        self._line()


class _Off:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(total: int, desc: str, unit: str, enabled: bool = True, every_s: float = 30.0, stream=None):
    """A progress reporter with `update(n)` and `close()`."""
    stream = stream if stream is not None else sys.stderr
    if not enabled:
        return _Off()
    if hasattr(stream, "isatty") and stream.isatty():
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=desc, unit=unit, file=stream)
    return _Lines(total, desc, unit, every_s, stream)
