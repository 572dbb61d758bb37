"""One case's coalition outcomes, evaluated once and shared by every method and both utility modes.

An agent response gives P(gold option) and the binary outcome (the gold option is the strict argmax) at once, so a
coalition is evaluated once and both utility modes are read off it: `probability` is P(gold), `correct` is the outcome
as 0/1 (`pipeline.agents.utility.outcome`, `in_mode`: the same reading as the audit's). Each method still sees only
the coalitions it asks for (through a `CachedOracle` that counts them), so the sharing saves agent calls without
letting one method use another's evaluations.

The table is lazy and sparse: it holds only the coalitions some method asked for (the union of their requests), in a
dict keyed by bitmask, never a dense 2^K array. At K=20 a dense pair of tables would be 9 MiB per case and invite
enumeration; the budgeted benchmark touches a few thousand coalitions per case at most.
"""

from __future__ import annotations

import numpy as np

from pipeline.agents.base import Agent
from pipeline.agents.utility import UTILITY_MODES, in_mode, outcome
from pipeline.audit.cases import Case


class CaseOutcomes:
    """Lazily filled, sparse tables of P(gold) (or token-F1 for open answers) and the binary outcome of one case."""

    def __init__(self, agent: Agent, case: Case):
        self.agent, self.case = agent, case
        self._probability: dict[int, float] = {}
        self._correct: dict[int, bool] = {}
        self.batches = 0  # agent batches sent (one per fetch with something new)

    @property
    def evaluations(self) -> int:
        """Distinct coalitions the agent has answered for this case."""
        return len(self._probability)

    def fetch(self, masks: np.ndarray) -> None:
        """Evaluate, in one agent batch, the coalitions among `masks` not evaluated yet."""
        masks = np.unique(np.asarray(masks, dtype=np.int64))
        new = [m for m in masks.tolist() if m not in self._probability]
        if not new:
            return
        q = self.case.query
        responses = self.agent.answer_batch([self.case.request(m) for m in new])
        self.batches += 1
        for m, r in zip(new, responses, strict=True):
            self._probability[m], self._correct[m] = outcome(r, q.options, q.answer)

    def _read(self, masks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        flat = masks.ravel().tolist()
        p = np.array([self._probability[m] for m in flat], dtype=np.float64).reshape(masks.shape)
        ok = np.array([self._correct[m] for m in flat], dtype=bool).reshape(masks.shape)
        return p, ok

    def outcome(self, masks: np.ndarray) -> np.ndarray:
        """The binary outcomes of `masks` (evaluating what is missing)."""
        masks = np.asarray(masks, dtype=np.int64)
        self.fetch(masks)
        return self._read(masks)[1]

    def mode(self, utility: str):
        """A batched evaluator `evaluate(masks) -> (utilities, correct)` in one utility mode."""
        if utility not in UTILITY_MODES:
            raise ValueError(f"utility mode {utility!r}; allowed {UTILITY_MODES}")

        def evaluate(masks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            masks = np.asarray(masks, dtype=np.int64)
            self.fetch(masks)
            p, ok = self._read(masks)
            return in_mode(p, ok, utility), ok

        return evaluate
