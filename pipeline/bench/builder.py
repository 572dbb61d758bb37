"""FI-LoCoMo case builder: clean queries, injected faults, re-retrieval, and a causal check under the evaluated agent.

For each LoCoMo QA item with evidence (categories 1-4) and multiple-choice options, the clean frozen context (K=5) is
retrieved; the query is clean when the agent answers it correctly there. For each clean query and mechanism the
builder writes fault sets (`pipeline.bench.faults`), appends them to the benchmark's in-memory copy of the pool,
re-runs retrieval, and keeps the first fault set whose records are all in the new frozen context and which passes its
mechanism's check on the agent's binary outcome (N = the frozen context, F = the faults in it):

- direct: wrong on N, right on N minus F (one record);
- redundant: wrong on N, wrong on N minus any single fault (LOO is blind), right on N minus F (r >= 2 records);
- joint: wrong on N, right on N minus either fault (each alone is harmless), right on N minus F (two records).

The source file is only read; injected records exist only in memory. Everything is seeded per query and mechanism,
so a case does not depend on which shard built it or on the other queries.
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from pipeline.agents.base import Agent
from pipeline.agents.utility import score
from pipeline.bench.faults import MECHANISMS, STRONG_TEMPLATES, FaultSpec, content_words, fault_memories, fault_specs
from pipeline.bench.index import PoolIndex
from pipeline.bench.oracle import CaseOracle
from pipeline.cases import Case, case_seed
from pipeline.configs import check
from pipeline.game.plan import full_mask
from pipeline.io.records import Pool, Query

log = logging.getLogger(__name__)

CATEGORIES = ("1", "2", "3", "4")  # LoCoMo single-hop, temporal, open-domain, multi-hop (5 = adversarial, excluded)
BLOCK = 32  # clean queries tried together, so their candidate faults are embedded in shared batches


@dataclass(frozen=True)
class BuildConfig:
    """How cases are built. max_cases caps the kept cases of each mechanism over the whole run (0: no cap)."""

    top_k: int = 5
    redundancy: int = 2  # r, records per redundant conflict
    max_cases: int = 0
    max_distractors: int = 2  # distractors tried per (query, mechanism)
    mechanisms: tuple[str, ...] = MECHANISMS
    seed: int = 0

    def __post_init__(self) -> None:
        w = "build config"
        check(isinstance(self.top_k, int) and 2 <= self.top_k <= 20, w, f"top_k={self.top_k!r}; allowed 2..20")
        check(isinstance(self.redundancy, int) and 2 <= self.redundancy <= min(len(STRONG_TEMPLATES), self.top_k), w,
              f"redundancy={self.redundancy!r}; allowed 2..{min(len(STRONG_TEMPLATES), self.top_k)}")
        check(isinstance(self.max_cases, int) and self.max_cases >= 0, w, f"max_cases={self.max_cases!r}; must be >= 0")
        check(isinstance(self.max_distractors, int) and self.max_distractors >= 1, w,
              f"max_distractors={self.max_distractors!r}; must be >= 1")
        check(bool(self.mechanisms) and set(self.mechanisms) <= set(MECHANISMS), w,
              f"mechanisms={self.mechanisms!r}; allowed a non-empty subset of {MECHANISMS}")


@dataclass(frozen=True)
class BenchCase:
    """One fault-injected case: the query, its frozen context over pool + faults, and which positions are faults."""

    case_id: str  # '<query_id>:<mechanism>'
    mechanism: str
    case: Case
    faults: tuple[str, ...]  # memory ids of the injected records (all inside the frozen context)
    spec: FaultSpec

    @property
    def conversation(self) -> str:
        return self.case.query.pool_id

    @property
    def fault_positions(self) -> tuple[int, ...]:
        ids = self.case.context.memory_ids
        return tuple(ids.index(f) for f in self.faults)


@dataclass
class MechanismCount:
    tried: int = 0  # clean queries for which a fault set of this mechanism was attempted
    verified: int = 0  # ... of which one passed the causal check
    candidates: int = 0  # fault sets written
    not_retrieved: int = 0  # ... with a record outside the frozen context
    check_failed: int = 0  # ... retrieved, but failing the mechanism check


@dataclass
class BuildResult:
    cases: list[BenchCase]
    eligible: int  # queries of categories 1-4 with evidence and options
    clean: int  # ... answered correctly on the clean context
    counts: dict[str, MechanismCount] = field(default_factory=dict)


def check_masks(mechanism: str, k: int, positions: tuple[int, ...]) -> list[int]:
    """The coalitions the mechanism check needs: N, N minus F, and N minus each single fault (redundant, joint)."""
    full = full_mask(k)
    f_all = sum(1 << p for p in positions)
    masks = [full, full & ~f_all]
    if mechanism in ("redundant", "joint"):
        masks += [full & ~(1 << p) for p in positions]
    return masks


def passes(mechanism: str, correct: list[bool]) -> bool:
    """Whether the outcomes on `check_masks(...)` (same order) show the mechanism."""
    full_ok, cleared_ok, *singles = correct
    if full_ok or not cleared_ok:
        return False
    if mechanism == "redundant":
        return not any(singles)
    if mechanism == "joint":
        return all(singles)
    return True


def verify(agent: Agent, case: BenchCase) -> bool:
    """Re-check a case's mechanism under `agent` (fresh evaluations)."""
    masks = check_masks(case.mechanism, case.case.k, case.fault_positions)
    return passes(case.mechanism, CaseOracle(agent, case.case).outcome(np.array(masks)).tolist())


def cap_cases(cases: list[BenchCase], cap: int) -> list[BenchCase]:
    """The first `cap` cases of each mechanism, in the given order (cap 0: all)."""
    if not cap:
        return list(cases)
    seen: Counter[str] = Counter()
    out = []
    for c in cases:
        seen[c.mechanism] += 1
        if seen[c.mechanism] <= cap:
            out.append(c)
    return out


def eligible_queries(queries: list[Query]) -> list[Query]:
    return [q for q in queries if q.category in CATEGORIES and q.evidence and len(q.options) >= 2]


def _rng(seed: int, query_id: str, mechanism: str) -> np.random.Generator:
    digest = int.from_bytes(hashlib.sha256(f"{query_id}\0{mechanism}".encode()).digest()[:8], "little")
    return np.random.default_rng(np.random.SeedSequence([seed, digest]))


def clean_queries(agent: Agent, index: PoolIndex, queries: list[Query]) -> list[tuple[Query, np.ndarray | None]]:
    """(query, question embedding) of the queries the agent answers correctly on their clean frozen context."""
    q_emb = index.embed([q.question for q in queries])
    cases = [Case(q, index.freeze(q, None if q_emb is None else q_emb[i]), 0) for i, q in enumerate(queries)]
    responses = agent.answer_batch([c.request(full_mask(c.k)) for c in cases])  # one batch for the whole pool
    return [
        (q, None if q_emb is None else q_emb[i])
        for i, (q, r) in enumerate(zip(queries, responses, strict=True))
        if score(r, q.options, q.answer, "correct")[1]
    ]


def build_pool(
    agent: Agent, index: PoolIndex, pool: Pool, queries: list[Query], config: BuildConfig, progress=None
) -> BuildResult:
    """Build the cases of one pool (conversation). Stops trying a mechanism once it has config.max_cases cases."""
    eligible = eligible_queries([q for q in queries if q.pool_id == pool.pool_id])
    clean = clean_queries(agent, index, eligible)
    idf = index.idf(pool.pool_id)
    counts = {m: MechanismCount() for m in config.mechanisms}
    kept: list[BenchCase] = []
    cap = config.max_cases or None

    def full(m: str) -> bool:
        return cap is not None and counts[m].verified >= cap

    step = BLOCK if cap is None else max(4, min(BLOCK, cap))  # a small cap should not try queries it never keeps
    for start in range(0, len(clean), step):
        pending = []  # [query, q_emb, mechanism, candidates, index of the next candidate]
        for query, q_emb in clean[start : start + step]:
            words = content_words(query.question, idf)
            for m in config.mechanisms:
                if full(m):
                    continue
                counts[m].tried += 1
                rng = _rng(config.seed, query.query_id, m)
                case_id = f"{query.query_id}:{m}"
                specs = fault_specs(m, query, pool, len(words), config.redundancy, rng, config.max_distractors)
                cands = [(sp, fault_memories(pool.pool_id, case_id, sp, query.question, words)) for sp in specs]
                pending.append([query, q_emb, m, cands, 0])
        # Waves: candidate j of every unresolved (query, mechanism) is embedded in one batch, so only the fault sets
        # actually tried are embedded (MiniLM on 2 cores is the builder's main cost).
        while pending:
            tries = [(e, *e[3][e[4]]) for e in pending]
            emb = index.embed([f.text for _, _, faults in tries for f in faults])
            offsets = np.cumsum([0] + [len(faults) for _, _, faults in tries])
            still = []
            for j, (e, spec, faults) in enumerate(tries):
                query, q_emb, m = e[0], e[1], e[2]
                counts[m].candidates += 1
                ctx = index.freeze(query, q_emb, faults, None if emb is None else emb[offsets[j] : offsets[j + 1]])
                ids = tuple(f.memory_id for f in faults)
                if not set(ids) <= set(ctx.memory_ids):
                    counts[m].not_retrieved += 1
                else:
                    case_id = f"{query.query_id}:{m}"
                    seed = case_seed(config.seed, query.pool_id, case_id)
                    bc = BenchCase(case_id, m, Case(query, ctx, seed), ids, spec)
                    if verify(agent, bc):
                        counts[m].verified += 1
                        kept.append(bc)
                        continue
                    counts[m].check_failed += 1
                e[4] += 1
                if e[4] < len(e[3]):
                    still.append(e)
            pending = still
        if progress is not None:
            progress(min(start + step, len(clean)), len(clean))
    order = {q.query_id: i for i, (q, _) in enumerate(clean)}
    kept.sort(key=lambda c: (order[c.case.query.query_id], MECHANISMS.index(c.mechanism)))
    kept = cap_cases(kept, config.max_cases)
    log.info("%s: %d eligible, %d clean, kept %s", pool.pool_id, len(eligible), len(clean),
             {m: c.verified for m, c in counts.items()})
    return BuildResult(kept, len(eligible), len(clean), counts)
