"""Coalition evaluation: one case's coalitions through an agent, scored once into both utilities.

Runs wherever the agent lives (in process or inside a Ray actor) and does not know which. A response gives P(gold)
(token-F1 for open answers) and the binary outcome at once, so an `ItemResult` carries both and the utility mode is
chosen by whoever reads it (`ItemResult.utility`): no worker is told the mode.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import numpy as np

from pipeline.agents import AgentSpec, build_agent
from pipeline.agents.base import Agent
from pipeline.agents.utility import in_mode, outcome
from pipeline.text import gold_index
from pipeline.cases import Case
from pipeline.errors import AgentStartError, ConfigError, MeClearError


@dataclass(frozen=True)
class WorkItem:
    """Coalitions of one case to evaluate. Items of one case always go to the same agent (prefix-cache affinity)."""

    case_index: int
    case: Case
    masks: np.ndarray  # int64
    stage: str  # "plan" or "clearance"


@dataclass(frozen=True)
class ItemResult:
    case_index: int
    stage: str
    masks: np.ndarray
    probability: np.ndarray  # P(gold option), or mean token-F1 for open answers
    correct: np.ndarray
    answer: list[str]
    gold_prob: list[float | None]
    prompt_tokens: list[int | None]
    cached_tokens: list[int | None]
    latency_s: list[float | None]
    error: str | None = None  # the agent failed on this item (a data reason); the other fields are then empty

    def utility(self, mode: str) -> np.ndarray:
        """The utilities in `mode` ('probability' or 'correct')."""
        return in_mode(self.probability, self.correct, mode)


def _one_line(exc: BaseException) -> str:
    """An exception as one line that says what was wrong. A pydantic ValidationError (how vLLM refuses settings) puts
    only "1 validation error for ModelConfig" on its first line; its errors' messages name the setting."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        try:
            msgs = [str(e.get("msg", "")) for e in errors()]
        except Exception:  # noqa: BLE001 - not pydantic after all
            msgs = []
        if any(msgs):
            return f"{type(exc).__name__}: {'; '.join(m for m in msgs if m)}".replace("\n", " ")[:500]
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"[:500]


def _failed(it: WorkItem, exc: Exception) -> ItemResult:
    empty = np.zeros(0)
    reason = f"{type(exc).__name__}: {exc}".splitlines()[0][:500]
    return ItemResult(it.case_index, it.stage, np.asarray(it.masks, dtype=np.int64), empty, empty.astype(bool),
                      [], [], [], [], [], error=reason)


def evaluate_items(agent: Agent, items: list[WorkItem]) -> list[ItemResult]:
    """Answer every coalition of every item in one agent batch, then score each response. When the batch raises, each
    item is retried alone, so an agent error on one case marks that case only (ItemResult.error)."""
    try:
        return _evaluate(agent, items)
    except Exception as exc:  # noqa: BLE001 - any agent failure on a case is recorded, not fatal
        if len(items) == 1:
            return [_failed(items[0], exc)]
    out = []
    for it in items:
        try:
            out.extend(_evaluate(agent, [it]))
        except Exception as exc:  # noqa: BLE001
            out.append(_failed(it, exc))
    return out


def _evaluate(agent: Agent, items: list[WorkItem]) -> list[ItemResult]:
    requests = [it.case.request(int(m)) for it in items for m in it.masks]
    t0 = time.perf_counter()
    responses = agent.answer_batch(requests)
    per_request = (time.perf_counter() - t0) / max(len(requests), 1)
    out, pos = [], 0
    for it in items:
        q = it.case.query
        g = gold_index(q.options, q.answer) if q.options else -1
        resp = responses[pos : pos + len(it.masks)]
        pos += len(it.masks)
        scored = [outcome(r, q.options, q.answer) for r in resp]
        out.append(
            ItemResult(
                case_index=it.case_index,
                stage=it.stage,
                masks=np.asarray(it.masks, dtype=np.int64),
                probability=np.array([s[0] for s in scored], dtype=float),
                correct=np.array([s[1] for s in scored], dtype=bool),
                answer=[r.answer for r in resp],
                gold_prob=[float(r.option_probs[g]) if g >= 0 else None for r in resp],
                prompt_tokens=[r.prompt_tokens for r in resp],
                cached_tokens=[r.cached_tokens for r in resp],
                latency_s=[r.latency_s if r.latency_s is not None else per_request for r in resp],
            )
        )
    return out


class AgentWorker:
    """The worker of the audit's pools (in process or a Ray actor): builds its agent once and evaluates tasks of
    WorkItems. A build failure is kept as one line and its exit code and returned by `fingerprint`, so the driver
    reports it as such (`agent_fingerprint`) instead of an actor traceback. `agent`: an already built agent (tests)."""

    def __init__(self, spec: AgentSpec, agent: Agent | None = None):
        self.agent, self.error = agent, None
        if agent is not None:
            return
        try:
            self.agent = build_agent(spec)
        except MeClearError as exc:
            self.error = (str(exc), exc.exit_code)
        except Exception as exc:  # noqa: BLE001 - an engine that cannot start
            self.error = (f"agent {spec.name!r} could not start: {_one_line(exc)}", 2)

    def fingerprint(self) -> str | tuple[str, int]:
        return self.error if self.agent is None else self.agent.fingerprint()

    def pid(self) -> int:
        return os.getpid()

    def evaluate(self, items: list[WorkItem]) -> list[ItemResult]:
        return evaluate_items(self.agent, items)

    def reset_prefix_cache(self) -> bool:
        """Empty the engine's prefix cache (the throughput benchmark starts every repetition cold)."""
        return bool(self.agent.reset_prefix_cache())

    def close(self) -> None:
        if self.agent is not None:
            self.agent.close()


def agent_fingerprint(built: list) -> str:
    """The one fingerprint of a pool's agents (`AgentWorker.fingerprint` of each worker); raises the first build
    failure as AgentStartError with its exit code, or ConfigError when the workers built different agents."""
    failures = [b for b in built if isinstance(b, (tuple, list))]
    if failures:
        message, code = failures[0]
        err = AgentStartError(message)
        err.exit_code = code
        raise err
    fps = set(built)
    if len(fps) != 1:
        raise ConfigError(f"ray executor: actors built different agents {sorted(fps)}; check the agent settings")
    return fps.pop()
