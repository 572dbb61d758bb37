"""One case's coalition outcomes, evaluated once and shared by every method and both utility modes.

An agent response gives P(gold option) and the binary outcome (the gold option is the strict argmax) at once, so a
coalition is evaluated once and both utility modes are read off it: `probability` is P(gold), `correct` is the outcome
as 0/1 (`pipeline.agents.utility.outcome`, `in_mode`: the same reading as the audit's). Each method still sees only
the coalitions it asks for (through a `CachedOracle` that counts them), so the sharing saves agent calls without
letting one method use another's evaluations.
"""

from __future__ import annotations

import numpy as np

from pipeline.agents.base import Agent
from pipeline.agents.utility import UTILITY_MODES, in_mode, outcome
from pipeline.cases import Case


class CaseOutcomes:
    """Lazily filled 2^K tables of P(gold) (or token-F1 for open answers) and the binary outcome of one case."""

    def __init__(self, agent: Agent, case: Case):
        self.agent, self.case = agent, case
        n = 1 << case.k
        self.probability = np.full(n, np.nan)
        self.correct = np.zeros(n, dtype=bool)

    @property
    def evaluations(self) -> int:
        """Distinct coalitions the agent has answered for this case."""
        return int(np.count_nonzero(~np.isnan(self.probability)))

    def fetch(self, masks: np.ndarray) -> None:
        """Evaluate, in one agent batch, the coalitions among `masks` not evaluated yet."""
        masks = np.unique(np.asarray(masks, dtype=np.int64))
        new = masks[np.isnan(self.probability[masks])]
        if not new.size:
            return
        q = self.case.query
        responses = self.agent.answer_batch([self.case.request(int(m)) for m in new])
        for m, r in zip(new.tolist(), responses, strict=True):
            self.probability[m], self.correct[m] = outcome(r, q.options, q.answer)

    def outcome(self, masks: np.ndarray) -> np.ndarray:
        """The binary outcomes of `masks` (evaluating what is missing)."""
        masks = np.asarray(masks, dtype=np.int64)
        self.fetch(masks)
        return self.correct[masks]

    def mode(self, utility: str):
        """A batched evaluator `evaluate(masks) -> (utilities, correct)` in one utility mode."""
        if utility not in UTILITY_MODES:
            raise ValueError(f"utility mode {utility!r}; allowed {UTILITY_MODES}")

        def evaluate(masks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            masks = np.asarray(masks, dtype=np.int64)
            self.fetch(masks)
            ok = self.correct[masks]
            return in_mode(self.probability[masks], ok, utility), ok

        return evaluate
