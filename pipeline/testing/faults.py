"""Agents that fail the way engines fail, for tests of the callers (the worker, the driver, Ray's restarts).

`DyingAgent` answers like the reader agent until its engine "dies": the call that finds no marker file creates it and
raises an error named like vLLM's EngineDeadError. A restarted actor rebuilds the agent from the same arguments, finds
the marker and answers, as a real actor does after Ray restarts it with a fresh engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from pipeline.agents.base import AgentRequest, AgentResponse
from pipeline.agents.reader import ReaderAgent


class EngineDeadError(RuntimeError):
    """Stands in for vllm.v1.engine.exceptions.EngineDeadError (recognised by its name, as the real one is)."""


class DyingAgent:
    """The reader agent, whose engine dies once per `marker` file (after `calls_before` good calls)."""

    name = "reader"

    def __init__(self, marker: str | Path, calls_before: int = 1, error: type[BaseException] = EngineDeadError):
        self.inner, self.marker, self.calls_before, self.error = ReaderAgent(), str(marker), calls_before, error
        self.calls = 0

    def fingerprint(self) -> str:
        return self.inner.fingerprint()  # the same agent as the reader: outputs must match an undisturbed run

    def answer_batch(self, requests: Sequence[AgentRequest]) -> list[AgentResponse]:
        self.calls += 1
        if self.calls > self.calls_before and not Path(self.marker).exists():
            Path(self.marker).write_text("died\n")
            raise self.error("EngineCore encountered an issue. See stack trace (above) for the root cause.")
        return self.inner.answer_batch(requests)

    def close(self) -> None:
        self.inner.close()
