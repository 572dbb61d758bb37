"""An iterator run ahead in a background thread, into a bounded queue: the audit's retrieval stage feeds the driver's
evaluation loop this way, so agents work on the first pools' cases while later pools are still embedded and indexed.

The producer's exception is raised in the consumer at the point it was reached (after every item produced before
it); `close()` stops the producer at its next item (it is a daemon thread, so a driver that exits never waits on it).
`thread=False` produces each item lazily in the consumer's own thread instead (same order, no concurrency).
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Generic, Iterable, Iterator, TypeVar

T = TypeVar("T")

_END = object()


class Prefetch(Generic[T]):
    """Items of `source`, produced up to `ahead` items ahead of the consumer by a background thread.

    `get(block)` returns the next item, `Prefetch.EMPTY` when `block=False` and none is ready yet, or `Prefetch.DONE`
    once the source is exhausted. `busy_s`: the producer's own time (what the stage cost, overlapped or not)."""

    EMPTY = object()
    DONE = object()

    def __init__(self, source: Iterable[T], ahead: int, name: str = "prefetch", thread: bool = True):
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, ahead))
        self._stop = threading.Event()
        self._done = False
        self.busy_s = 0.0
        self._inline = None if thread else iter(source)  # no thread: each get() produces the next item itself
        self._thread = threading.Thread(target=self._run, args=(iter(source),), name=name, daemon=True)
        if thread:
            self._thread.start()

    def _run(self, it: Iterator[T]) -> None:
        try:
            while not self._stop.is_set():
                t = time.perf_counter()
                try:
                    item = next(it)
                except StopIteration:
                    break
                finally:
                    self.busy_s += time.perf_counter() - t
                self._put(item)
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, raised there
            self._put(_Failure(exc))
            return
        self._put(_END)

    def _put(self, item: object) -> None:
        while not self._stop.is_set():  # a full queue never blocks a stopped producer
            try:
                self._queue.put(item, timeout=0.5)
                return
            except queue.Full:
                continue

    def get(self, block: bool = True) -> T | object:
        if self._done:
            return self.DONE
        if self._inline is not None:  # lazily, in the caller's thread (`block` is moot: the caller does the work)
            t = time.perf_counter()
            try:
                return next(self._inline)
            except StopIteration:
                self._done = True
                return self.DONE
            finally:
                self.busy_s += time.perf_counter() - t
        # waits of 1 s, so Ctrl-C reaches the consumer within a second while the producer works
        while True:
            try:
                item = self._queue.get(timeout=1.0) if block else self._queue.get_nowait()
                break
            except queue.Empty:
                if not block:
                    return self.EMPTY
        if item is _END:
            self._done = True
            return self.DONE
        if isinstance(item, _Failure):
            self._done = True
            raise item.exc
        return item

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)


class _Failure:
    def __init__(self, exc: BaseException):
        self.exc = exc
