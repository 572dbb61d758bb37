"""FI-LoCoMo case builder: clean queries, injected faults, re-retrieval, and a causal check under the evaluated agent.

For each LoCoMo QA item with evidence (categories 1-4) and multiple-choice options, the clean frozen context (K=5) is
retrieved; the query is clean when the agent answers it correctly there. For each clean query and mechanism the
builder writes fault sets (`pipeline.bench.faults`), appends them to the benchmark's in-memory copy of the pool,
re-runs retrieval, and keeps the first fault set whose records are all in the new frozen context and which passes its
mechanism's check on the agent's binary outcome (N = the frozen context, F = the faults in it):

- direct: wrong on N, right on N minus F (one record);
- redundant: wrong on N, wrong on N minus any single fault (LOO is blind), right on N minus F (r >= 2 records);
- joint: wrong on N, right on N minus either fault (each alone is harmless), right on N minus F (two records).

Fault positions are balanced: a retrieved fault set whose records would put a context position more than
POSITION_SLACK records ahead of the conversation's per-position mean is skipped before any agent call, and the next
(weaker) candidate is tried, so faults spread over the whole context instead of sitting at positions 0-1 (where the
strong templates, which restate the question, are retrieved). Deterministic given the seed and the query order.

Economies for an expensive agent (issue 7): every agent answer is cached by its request (question, options, memories)
for the whole build (`CachedAgent`); the clean check runs block by block, only for the queries still needed; the
causal check asks the cheapest condition first (N, then N minus F, then the single removals) and stops at the first
failure, for groups of candidates in one agent batch per stage (`prefetch_group`, `prefetch_verify`; issue 18); a
conversation stops once every mechanism's quota is met; progress is shown within a conversation.

The source file is only read; injected records exist only in memory. Everything is seeded per query and mechanism,
so a case does not depend on which shard built it or on the other queries.
"""

from __future__ import annotations

import hashlib
import logging
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from pipeline.agents.base import Agent, AgentRequest, AgentResponse
from pipeline.agents.utility import score
from pipeline.audit.cases import Case, case_seed
from pipeline.audit.settings import check_setting
from pipeline.bench.faults import (
    MECHANISMS,
    STRONG_TEMPLATES,
    FaultSpec,
    content_words,
    fault_memories,
    fault_specs,
)
from pipeline.bench.outcomes import CaseOutcomes
from pipeline.bench.reretrieval import PoolIndex
from pipeline.core.validation import check
from pipeline.game.plan import full_mask
from pipeline.io.records import Pool, Query
from pipeline.retrieval.frozen import DEFAULT_TOP_K

log = logging.getLogger(__name__)

CATEGORIES = ("1", "2", "3", "4")  # LoCoMo single-hop, temporal, open-domain, multi-hop (5 = adversarial, excluded)
BLOCK = 32  # clean queries tried together, so their candidate faults are embedded in shared batches
PREFETCH = ("off", "wave", "groups")  # how causal checks are batched (BuildConfig.prefetch)
POSITION_SLACK = 1  # a position may run this many fault records ahead of the per-position mean of its conversation


def position_slack(top_k: int) -> int:
    """The balancing slack for a context of `top_k`: POSITION_SLACK per five positions (1 at K=5, 2 at K=10, 4 at
    K=20). Why: with the K=5 slack at K=10, 95% of retrieved fault sets on conv-26 were skipped as over-full (a
    conversation's faults fill ten positions slowly, so the mean stays low) and a conversation yielded 23 cases."""
    return max(POSITION_SLACK, POSITION_SLACK * top_k // 5)


class CachedAgent:
    """Wraps an Agent: answers each distinct request (question, options, memories) once, and counts the requests
    forwarded to the agent by phase (`calls[phase]`) and those answered from the cache (`hits`). cache=False only
    counts (the methods phase must re-ask the agent). Other attributes (e.g. `drop_memories`) pass through, counted.
    """

    def __init__(self, agent: Agent, cache: bool = True, phase: str = "build"):
        self.agent, self.cache, self.phase = agent, cache, phase
        self._answers: dict[tuple, AgentResponse] = {}
        self.calls: Counter[str] = Counter()
        self.hits = 0

    def fingerprint(self) -> str:
        return self.agent.fingerprint()

    def answer_batch(self, requests: list[AgentRequest]) -> list[AgentResponse]:
        keys = [(r.question, tuple(r.options), tuple(r.memories)) for r in requests]
        if not self.cache:
            self.calls[self.phase] += len(requests)
            return self.agent.answer_batch(requests)
        todo = {}
        for key, r in zip(keys, requests, strict=True):
            if key not in self._answers and key not in todo:
                todo[key] = r
        self.hits += len(requests) - len(todo)
        if todo:
            self.calls[self.phase] += len(todo)
            for key, resp in zip(todo, self.agent.answer_batch(list(todo.values())), strict=True):
                self._answers[key] = resp
        return [self._answers[k] for k in keys]

    def close(self) -> None:
        self.agent.close()

    def __getattr__(self, name: str):
        attr = getattr(self.agent, name)  # AttributeError when the agent lacks it, so hasattr() stays truthful
        if name == "drop_memories" and callable(attr):
            def counted(*args, **kwargs):
                self.calls[self.phase + "_filter"] += 1
                return attr(*args, **kwargs)
            return counted
        return attr


@dataclass(frozen=True)
class BuildConfig:
    """How cases are built. max_cases caps the kept cases of each mechanism over the whole run (0: no cap)."""

    top_k: int = DEFAULT_TOP_K
    redundancy: int | tuple[int, ...] = 2  # r, records per redundant conflict; several: one redundant variant each
    max_cases: int = 0
    max_queries: int = 0  # clean-check at most the first N eligible queries of each conversation (0: all)
    max_distractors: int = 2  # distractors tried per (query, mechanism)
    mechanisms: tuple[str, ...] = MECHANISMS
    seed: int = 0
    balance_positions: bool = True  # skip fault sets that would over-fill a context position (see module doc)
    # How the causal checks reach the agent (the kept cases are the same every way; `benchmarks/build_cost.py`
    # measures them): "off" per-candidate `verify` calls (up to three agent batches a candidate); "wave" every
    # candidate of a wave in one batch per stage (`prefetch_verify`); "groups" the same for the candidates the
    # decisions are likely to need (`prefetch_group`), so that few requests are asked for nothing.
    prefetch: str = "groups"

    def __post_init__(self) -> None:
        w = "build config"
        check_setting("top_k", self.top_k, w, low=2)  # room for a redundant pair
        check_setting("seed", self.seed, w)
        rs = (self.redundancy,) if isinstance(self.redundancy, int) else tuple(self.redundancy)
        object.__setattr__(self, "redundancy", rs)
        hi = min(len(STRONG_TEMPLATES), self.top_k)
        check(bool(rs) and len(set(rs)) == len(rs) and all(isinstance(r, int) and not isinstance(r, bool)
                                                          and 2 <= r <= hi for r in rs), w,
              f"redundancy={rs!r}; allowed distinct values in 2..{hi}")
        check(isinstance(self.max_cases, int) and self.max_cases >= 0, w, f"max_cases={self.max_cases!r}; must be >= 0")
        check(isinstance(self.max_queries, int) and not isinstance(self.max_queries, bool) and self.max_queries >= 0, w,
              f"max_queries={self.max_queries!r}; must be >= 0")
        check(isinstance(self.max_distractors, int) and self.max_distractors >= 1, w,
              f"max_distractors={self.max_distractors!r}; must be >= 1")
        check(bool(self.mechanisms) and set(self.mechanisms) <= set(MECHANISMS), w,
              f"mechanisms={self.mechanisms!r}; allowed a non-empty subset of {MECHANISMS}")
        check(self.prefetch in PREFETCH, w, f"prefetch={self.prefetch!r}; allowed {', '.join(PREFETCH)}")


    @property
    def variants(self) -> tuple[tuple[str, str, int], ...]:
        """(label, mechanism, records) of every fault variant built: one per mechanism, and one redundant variant per
        r. The first r is labelled 'redundant' (so a single-r build keeps its case ids), the others 'redundant_r<r>'."""
        out = []
        for m in self.mechanisms:
            if m == "redundant":
                out += [(variant_label(r, self.redundancy[0]), m, r) for r in self.redundancy]
            else:
                out.append((m, m, 1 if m == "direct" else 2))
        return tuple(out)


def variant_label(r: int, primary: int) -> str:
    return "redundant" if r == primary else f"redundant_r{r}"


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
    def variant(self) -> str:
        """The fault variant: the mechanism, or 'redundant_r<r>' for an extra redundancy (the case id's suffix)."""
        return self.case_id.rsplit(":", 1)[1]

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
    position_skipped: int = 0  # ... retrieved, but skipped unchecked: a fault position already over its share


@dataclass
class BuildResult:
    cases: list[BenchCase]
    eligible: int  # queries of categories 1-4 with evidence and options
    clean: int  # ... answered correctly on the clean context
    counts: dict[str, MechanismCount] = field(default_factory=dict)
    agent_calls: dict[str, int] = field(default_factory=dict)  # requests sent to the agent, by phase
    checked: int = 0  # eligible queries clean-checked (the rest were never needed: every quota was met)
    cache_hits: int = 0


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
    """Re-check a case's mechanism under `agent`, cheapest condition first: N must be wrong (one call), then N minus F
    right (one call), then the single removals (redundant, joint) in one batch; stops at the first failure."""
    masks = check_masks(case.mechanism, case.case.k, case.fault_positions)
    oracle = CaseOutcomes(agent, case.case)
    if bool(oracle.outcome(np.array(masks[:1]))[0]) or not bool(oracle.outcome(np.array(masks[1:2]))[0]):
        return False
    return passes(case.mechanism, oracle.outcome(np.array(masks)).tolist())


def prefetch_verify(agent: CachedAgent, cases: list[BenchCase]) -> None:
    """Ask, in one agent batch per stage, every request `verify` would send for `cases`, so that `verify` then answers
    each case from the cache with the same decisions: stage 1 the full contexts (N must be wrong), stage 2 N minus F
    for the cases still standing, stage 3 the single removals of those still standing. On a real LLM an engine call
    costs far more than its requests' tokens (scheduling, a partial batch), so one call per stage for a whole wave of
    candidates replaces up to three calls per candidate."""
    standing = [(bc, check_masks(bc.mechanism, bc.case.k, bc.fault_positions)) for bc in cases]
    for stage, (lo, hi) in enumerate(((0, 1), (1, 2), (0, None))):
        if not standing:
            return
        agent.answer_batch([bc.case.request(m) for bc, masks in standing for m in masks[lo:hi]])
        if stage < 2:  # cache hits: the outcome of the condition just asked, per case
            keep = [bool(CaseOutcomes(agent, bc.case).outcome(np.array(masks[lo:hi]))[0]) == (stage == 1)
                    for bc, masks in standing]
            standing = [x for x, k in zip(standing, keep) if k]


def prefetch_group(wave: list, start: int, hist: np.ndarray, slack: int | None,
                   room: Sequence[float]) -> list[int]:
    """Indices of the wave's candidates, from `start` on, whose causal checks to ask together now: a run of the wave
    in which every retrieved candidate that the position balance does not already skip is checkable whichever earlier
    members are kept; the run ends at the first candidate that a keep of earlier members could skip (its position
    over-full with every earlier member's faults on `hist`, or no room left in its variant's quota, `room[i]`: cases
    still wanted, inf without a cap). That candidate starts a later group if it is still needed.
    Why a contiguous run, not the whole wave (`prefetch="wave"`): a case kept early in a wave makes later candidates
    at its positions over-full, and their already-asked checks cost their tokens for nothing (conv-26, reader, 24
    queries: 100 verify requests where the decisions needed 16; SmolLM2 on 2 cores, first 8 queries: 40 requests
    instead of 24, 50% more uncached tokens, where the engine calls saved, 17 instead of 20, bought nothing visible).
    Skipping over such a candidate instead of ending the run still asked some needless checks (28 of 24 on SmolLM2),
    since the skipped one, decided in between, could be kept. The run is checked against the two extremes (no earlier
    member kept, all kept), not every subset, so a needless request is still possible, never a different decision.
    slack None: no position balancing."""
    hyp = hist.copy()
    taken: Counter[str] = Counter()  # group members per variant (as if each were kept)
    out = []
    for i in range(start, len(wave)):
        w = wave[i]
        if w is None or not set(w[1]) <= set(w[0].memory_ids):
            continue  # decided without the agent and without a keep
        if taken[w[2].variant] >= room[i]:
            break
        pos = w[2].fault_positions
        if slack is not None and w[0].k == hist.size:
            if not position_ok(hist, pos, slack):
                continue
            if not position_ok(hyp, pos, slack):
                break
            for p in pos:
                hyp[p] += 1
        taken[w[2].variant] += 1
        out.append(i)
    return out


def position_ok(hist: np.ndarray, positions: tuple[int, ...], slack: int = POSITION_SLACK) -> bool:
    """Whether adding fault records at `positions` keeps every position within `slack` records of the per-position
    mean (after adding): the greedy stratified selection that spreads faults over the context."""
    new = hist.copy()
    for p in positions:
        new[p] += 1
    limit = np.floor(new.sum() / new.size) + slack
    return bool(all(new[p] <= limit for p in positions))


def cap_cases(cases: list[BenchCase], cap: int) -> list[BenchCase]:
    """The first `cap` cases of each fault variant (mechanism), in the given order (cap 0: all)."""
    if not cap:
        return list(cases)
    seen: Counter[str] = Counter()
    out = []
    for c in cases:
        seen[c.variant] += 1
        if seen[c.variant] <= cap:
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


class _Progress:
    """Progress within a conversation: a tqdm bar on a TTY, plain log lines (every block) otherwise, or nothing."""

    def __init__(self, total: int, desc: str, enabled: bool):
        self.enabled, self.desc, self.total, self.bar = enabled, desc, total, None
        if enabled and sys.stderr.isatty():
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc=desc, unit="query", leave=False)

    def update(self, done: int, n: int, **info) -> None:
        if self.bar is not None:
            self.bar.set_postfix(**info)
            self.bar.update(n)
        elif self.enabled:
            print(f"{self.desc}: {done}/{self.total} clean-checked queries, " +
                  ", ".join(f"{k} {v}" for k, v in info.items()), file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def build_pool(
    agent: Agent, index: PoolIndex, pool: Pool, queries: list[Query], config: BuildConfig, progress: bool = False
) -> BuildResult:
    """Build the cases of one pool (conversation). Stops trying a mechanism once it has config.max_cases cases, and
    the conversation once every mechanism has; faults are position-balanced within the conversation."""
    eligible = eligible_queries([q for q in queries if q.pool_id == pool.pool_id])
    # An expensive agent spends most of the build on clean checks and causal checks: bounding the queries tried per
    # conversation bounds the build (SmolLM2 on 2 cores: about 15 s per clean-checked query with its fault checks).
    eligible = eligible[: config.max_queries] if config.max_queries else eligible
    cached = agent if isinstance(agent, CachedAgent) else CachedAgent(agent)
    idf = index.idf(pool.pool_id)
    variants = config.variants
    counts = {label: MechanismCount() for label, _, _ in variants}
    kept: list[BenchCase] = []
    cap = config.max_cases or None
    hist = np.zeros(config.top_k, dtype=np.int64)  # fault records kept per context position
    n_clean = checked_n = 0
    clean_order: dict[str, int] = {}

    def full(m: str) -> bool:
        return cap is not None and counts[m].verified >= cap

    step = BLOCK if cap is None else max(4, min(BLOCK, cap))  # a small cap should not try queries it never keeps
    bar = _Progress(len(eligible), f"building {pool.pool_id}", progress)
    for start in range(0, len(eligible), step):
        if all(full(label) for label, _, _ in variants):
            break  # every quota met: the rest of the conversation is never asked
        cached.phase = "clean"
        block = clean_queries(cached, index, eligible[start : start + step])
        checked_n = min(start + step, len(eligible))
        cached.phase = "verify"
        for q, _ in block:
            clean_order[q.query_id] = len(clean_order)
        n_clean += len(block)
        pending = []  # [query, q_emb, mechanism, candidates, index of the next candidate]
        for query, q_emb in block:
            words = content_words(query.question, idf)
            for m, mech, r in variants:  # m: the variant's label (the mechanism, or redundant_r<r>)
                if full(m):
                    continue
                counts[m].tried += 1
                rng = _rng(config.seed, query.query_id, m)
                case_id = f"{query.query_id}:{m}"
                specs = fault_specs(mech, query, pool, len(words), max(r, 2), rng, config.max_distractors)
                cands = [(sp, fault_memories(pool.pool_id, case_id, sp, query.question, words)) for sp in specs]
                pending.append([query, q_emb, m, cands, 0])
        # Waves: candidate j of every unresolved (query, mechanism) is embedded in one batch, so only the fault sets
        # actually tried are embedded (MiniLM on 2 cores is the builder's main cost).
        while pending:
            tries = [(e, *e[3][e[4]]) for e in pending]
            emb = index.embed([f.text for _, _, faults in tries for f in faults])
            offsets = np.cumsum([0] + [len(faults) for _, _, faults in tries])
            still = []
            # Frozen contexts of this wave first, so that their causal checks go to the agent in shared batches
            # (prefetch_verify, "wave" or "groups"); the decisions below are then taken one candidate at a time, in
            # order, as with per-candidate checks ("off"), from the cache.
            wave = []
            for j, (e, spec, faults) in enumerate(tries):
                query, q_emb, m = e[0], e[1], e[2]
                if full(m):
                    wave.append(None)
                    continue
                ctx = index.freeze(query, q_emb, faults, None if emb is None else emb[offsets[j] : offsets[j + 1]])
                ids = tuple(f.memory_id for f in faults)
                case_id = f"{query.query_id}:{m}"
                seed = case_seed(config.seed, query.pool_id, case_id)
                wave.append((ctx, ids, BenchCase(case_id, spec.mechanism, Case(query, ctx, seed), ids, spec)))
            slack = position_slack(config.top_k)
            if config.prefetch == "wave":
                prefetch_verify(cached, [w[2] for w in wave if w is not None and set(w[1]) <= set(w[0].memory_ids)
                                         and (not (config.balance_positions and w[0].k == hist.size)
                                              or position_ok(hist, w[2].fault_positions, slack))])
            asked: set[int] = set()  # wave indices whose checks are in the cache ("groups")
            for j, ((e, spec, faults), w) in enumerate(zip(tries, wave)):
                m = e[2]
                if full(m):
                    continue
                counts[m].candidates += 1
                ctx, ids, bc = w  # not None: a mechanism full now was full when the wave was frozen
                if not set(ids) <= set(ctx.memory_ids):
                    counts[m].not_retrieved += 1
                else:
                    if (not (config.balance_positions and ctx.k == hist.size)
                            or position_ok(hist, bc.fault_positions, slack)):
                        if config.prefetch == "groups" and j not in asked:
                            group = prefetch_group(wave, j, hist, slack if config.balance_positions else None,
                                                   [cap - counts[t[0][2]].verified if cap else np.inf
                                                    for t in tries])
                            prefetch_verify(cached, [wave[i][2] for i in group])
                            asked.update(group)
                        if verify(cached, bc):
                            counts[m].verified += 1
                            kept.append(bc)
                            for p in bc.fault_positions:
                                hist[p] += 1
                            continue
                        counts[m].check_failed += 1
                    else:
                        counts[m].position_skipped += 1
                e[4] += 1
                if e[4] < len(e[3]):
                    still.append(e)
            pending = still
        bar.update(min(start + step, len(eligible)), min(step, len(eligible) - start),
                   cases=len(kept), calls=sum(cached.calls.values()))
    bar.close()
    order = [label for label, _, _ in variants]
    kept.sort(key=lambda c: (clean_order[c.case.query.query_id], order.index(c.variant)))
    kept = cap_cases(kept, config.max_cases)
    log.info("%s: %d eligible, %d clean, kept %s", pool.pool_id, len(eligible), n_clean,
             {m: c.verified for m, c in counts.items()})
    return BuildResult(kept, len(eligible), n_clean, counts, dict(cached.calls), checked=checked_n,
                       cache_hits=cached.hits)
