"""A case is one query with its frozen context: the unit that the game, the agents and the outputs are keyed by."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from pipeline.agents.base import AgentRequest
from pipeline.io.records import Query
from pipeline.retrieval.frozen import FrozenContext


@dataclass(frozen=True)
class Case:
    query: Query
    context: FrozenContext
    seed: int  # per-case seed for permutation sampling, independent of case order

    @property
    def key(self) -> str:
        return f"{self.query.pool_id}/{self.query.query_id}/{self.context.context_hash}"

    @property
    def k(self) -> int:
        return self.context.k

    def request(self, mask: int) -> AgentRequest:
        """The agent request for one coalition: kept memories in frozen-context order."""
        texts = tuple(t for i, t in enumerate(self.context.texts) if mask >> i & 1)
        return AgentRequest(self.key, self.query.question, self.query.options, texts)


def case_seed(seed: int, pool_id: str, query_id: str) -> int:
    """A per-case seed derived from the run seed and the case's ids (so adding queries does not reshuffle others)."""
    digest = hashlib.sha256(f"{pool_id}\0{query_id}".encode()).digest()
    return int(np.random.SeedSequence([seed, int.from_bytes(digest[:8], "little")]).generate_state(1)[0])


def make_cases(queries: list[Query], contexts: list[FrozenContext], seed: int) -> list[Case]:
    return [Case(q, c, case_seed(seed, q.pool_id, q.query_id)) for q, c in zip(queries, contexts)]
