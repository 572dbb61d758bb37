"""Executors run evaluation tasks (lists of WorkItems) on agents. The driver in `pipeline.audit` talks to this small
contract only; `LocalExecutor` runs in process, `pipeline.ray_exec.RayExecutor` on an actor pool."""

from __future__ import annotations

from collections import deque
from typing import Protocol

from pipeline.agents import AgentSpec, build_agent
from pipeline.stage import ItemResult, WorkItem, evaluate_items


class Executor(Protocol):
    n_workers: int
    max_inflight: int  # tasks in flight per worker

    def submit(self, worker: int, items: list[WorkItem]) -> None: ...

    def next_done(self) -> tuple[int, list[ItemResult]]:
        """Block until a submitted task finishes; return (worker, its results)."""
        ...

    def close(self) -> None: ...


class LocalExecutor:
    """One agent in this process; tasks run when collected. For tests and Ray-less use."""

    def __init__(self, spec: AgentSpec, utility_mode: str, agent=None):
        self.agent = agent if agent is not None else build_agent(spec)
        self.utility_mode = utility_mode
        self.n_workers, self.max_inflight = 1, 1
        self._queue: deque[list[WorkItem]] = deque()
        self.fingerprint = self.agent.fingerprint()

    def submit(self, worker: int, items: list[WorkItem]) -> None:
        self._queue.append(items)

    def next_done(self) -> tuple[int, list[ItemResult]]:
        return 0, evaluate_items(self.agent, self._queue.popleft(), self.utility_mode)

    def close(self) -> None:
        self.agent.close()
