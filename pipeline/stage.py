"""The evaluation stage: one case's coalitions through an agent, as utility rows. Runs wherever the agent lives (in
process or inside a Ray actor); it does not know which."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from pipeline.agents.base import Agent
from pipeline.agents.utility import score
from pipeline.cases import Case
from pipeline.text import gold_index


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
    utility: np.ndarray
    correct: np.ndarray
    answer: list[str]
    gold_prob: list[float | None]
    prompt_tokens: list[int | None]
    cached_tokens: list[int | None]
    latency_s: list[float | None]
    error: str | None = None  # the agent failed on this item (a data reason); the other fields are then empty


def _failed(it: WorkItem, exc: Exception) -> ItemResult:
    empty = np.zeros(0)
    reason = f"{type(exc).__name__}: {exc}".splitlines()[0][:500]
    return ItemResult(it.case_index, it.stage, np.asarray(it.masks, dtype=np.int64), empty, empty.astype(bool),
                      [], [], [], [], [], error=reason)


def evaluate_items(agent: Agent, items: list[WorkItem], utility_mode: str) -> list[ItemResult]:
    """Answer every coalition of every item in one agent batch, then score each response. When the batch raises, each
    item is retried alone, so an agent error on one case marks that case only (ItemResult.error)."""
    try:
        return _evaluate(agent, items, utility_mode)
    except Exception as exc:  # noqa: BLE001 - any agent failure on a case is recorded, not fatal
        if len(items) == 1:
            return [_failed(items[0], exc)]
    out = []
    for it in items:
        try:
            out.extend(_evaluate(agent, [it], utility_mode))
        except Exception as exc:  # noqa: BLE001
            out.append(_failed(it, exc))
    return out


def _evaluate(agent: Agent, items: list[WorkItem], utility_mode: str) -> list[ItemResult]:
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
        scored = [score(r, q.options, q.answer, utility_mode) for r in resp]
        out.append(
            ItemResult(
                case_index=it.case_index,
                stage=it.stage,
                masks=np.asarray(it.masks, dtype=np.int64),
                utility=np.array([s[0] for s in scored], dtype=float),
                correct=np.array([s[1] for s in scored], dtype=bool),
                answer=[r.answer for r in resp],
                gold_prob=[float(r.option_probs[g]) if g >= 0 else None for r in resp],
                prompt_tokens=[r.prompt_tokens for r in resp],
                cached_tokens=[r.cached_tokens for r in resp],
                latency_s=[r.latency_s if r.latency_s is not None else per_request for r in resp],
            )
        )
    return out
