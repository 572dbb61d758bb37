"""Worker pools: the contract shared by the audit's driver and the benchmark's sharding, and its in-process form.

A pool holds `n_workers` copies of a worker object, each built once (an agent, a retrieval index), and calls their
methods by name. `submit` sends a call to a chosen worker and `next_done` collects whichever finished first: the
audit's scheduler picks workers itself, so a case's second pass reaches the worker whose prefix cache holds it. `map`
runs a method over items with every worker kept busy (the benchmark). `call_all` calls every worker once (its
fingerprint, a cache reset). `LocalPool` holds one worker in this process; `pipeline.exec.ray_pool.RayPool` Ray actors.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Iterator, Protocol, Sequence


class WorkerPool(Protocol):
    n_workers: int
    max_inflight: int  # calls in flight per worker

    def submit(self, worker: int, method: str, *args: Any) -> None: ...

    def next_done(self) -> tuple[int, Any]:
        """Block until a submitted call finishes; return (worker, its result)."""
        ...

    def call_all(self, method: str, *args: Any) -> list: ...

    def map(self, method: str, items: Sequence[Any], pins: Sequence[int | None] | None = None) -> Iterator[Any]: ...

    def close(self) -> None: ...


def map_calls(pool: WorkerPool, method: str, items: Sequence[Any],
              pins: Sequence[int | None] | None = None) -> Iterator[Any]:
    """`method(item)` for each item, in order of submission, each worker kept at `max_inflight` calls; yields the
    results as they finish. `pins[i]`, when given and not None, is the worker item i must run on."""
    todo = deque(range(len(items)))
    inflight = [0] * pool.n_workers

    def feed() -> None:
        for w in range(pool.n_workers):
            while inflight[w] < pool.max_inflight:
                i = next((i for i in todo if pins is None or pins[i] is None or pins[i] == w), None)
                if i is None:
                    break
                todo.remove(i)
                pool.submit(w, method, items[i])
                inflight[w] += 1

    feed()
    while any(inflight):
        w, result = pool.next_done()
        inflight[w] -= 1
        feed()
        yield result


class LocalPool:
    """One worker in this process; a submitted call runs when it is collected. For tests and Ray-less use."""

    in_process = True  # its worker computes in the caller's thread (the driver's), under the same GIL

    def __init__(self, worker: Any):
        self.worker = worker
        self.n_workers, self.max_inflight = 1, 1
        self._queue: deque[tuple[str, tuple]] = deque()

    def submit(self, worker: int, method: str, *args: Any) -> None:
        self._queue.append((method, args))

    def next_done(self) -> tuple[int, Any]:
        method, args = self._queue.popleft()
        return 0, getattr(self.worker, method)(*args)

    def call_all(self, method: str, *args: Any) -> list:
        return [getattr(self.worker, method)(*args)]

    def map(self, method: str, items: Sequence[Any], pins: Sequence[int | None] | None = None) -> Iterator[Any]:
        return map_calls(self, method, items, pins)

    def close(self) -> None:
        self.worker.close()
