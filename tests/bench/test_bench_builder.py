"""FI-LoCoMo builder economies and method-phase rules, on hand-made cases with a scripted agent (unit tests of the
callers: the agent is a stub whose answers are a stated function of the memories it is shown)."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.agents.base import AgentRequest, AgentResponse
from pipeline.agents.reader import ReaderAgent
from pipeline.audit.cases import Case
from pipeline.bench.baselines import CachedOracle
from pipeline.bench.builder import BenchCase, CachedAgent, position_ok, verify
from pipeline.bench.methods import MethodConfig, control, run_case
from pipeline.bench.outcomes import CaseOutcomes
from pipeline.io.records import Query
from pipeline.retrieval.frozen import FrozenContext

QUERY = Query("q1", "conv-x", "Where did Ana move?", "Bergen", ("Bergen", "Gdansk"), "1")
TEXTS = ("Ana: I moved to Bergen.", "Ana: FAULT Gdansk.", "Bob: hello.", "Ana: FAULT2 Gdansk.", "Bob: bye.")


def bench_case(faults=(1,), mechanism="direct") -> BenchCase:
    ids = tuple(f"m{i}" for i in range(5))
    ctx = FrozenContext("conv-x", "q1", ids, TEXTS, (1.0,) * 5, (1, 2, 3, 4, 5), (None,) * 5, "h")
    return BenchCase(f"q1:{mechanism}", mechanism, Case(QUERY, ctx, 123), tuple(ids[i] for i in faults), None)


class ScriptedAgent:
    """Answers Gdansk when any shown memory contains 'FAULT' (or always/never, by `rule`); records every request."""

    name = "scripted"

    def __init__(self, rule=lambda mems: any("FAULT" in m for m in mems)):
        self.rule, self.requests = rule, []

    def fingerprint(self) -> str:
        return "scripted"

    def answer_batch(self, requests):
        self.requests += list(requests)
        out = []
        for r in requests:
            wrong = self.rule(r.memories)
            out.append(AgentResponse((0.1, 0.9) if wrong else (0.9, 0.1), "Gdansk" if wrong else "Bergen"))
        return out

    def close(self) -> None:
        pass


def test_cached_agent_answers_each_request_once_and_counts_by_phase():
    inner = ScriptedAgent()
    agent = CachedAgent(inner, phase="clean")
    a = AgentRequest("k", QUERY.question, QUERY.options, TEXTS[:2])
    b = AgentRequest("other-case", QUERY.question, QUERY.options, TEXTS[:2])  # same prompt: the cache key ignores it
    c = AgentRequest("k", QUERY.question, QUERY.options, TEXTS[2:3])
    first = agent.answer_batch([a, b, c, a])
    assert [r.answer for r in first] == ["Gdansk", "Gdansk", "Bergen", "Gdansk"]
    assert len(inner.requests) == 2 and agent.calls == {"clean": 2} and agent.hits == 2
    agent.phase = "verify"
    agent.answer_batch([c])
    assert len(inner.requests) == 2 and agent.calls == {"clean": 2}  # answered from the cache
    counting = CachedAgent(inner, cache=False, phase="methods")
    counting.answer_batch([a, a])
    assert len(inner.requests) == 4 and counting.calls == {"methods": 2}
    assert not hasattr(CachedAgent(ReaderAgent()), "drop_memories")  # pass-through stays truthful


def test_verify_asks_the_cheapest_condition_first_and_stops():
    # The full context is already right: one request (N), no further coalition asked.
    right = ScriptedAgent(rule=lambda mems: False)
    assert not verify(right, bench_case())
    assert len(right.requests) == 1 and len(right.requests[0].memories) == 5
    # A real direct fault: N wrong, N minus F right -> two requests, passes.
    agent = ScriptedAgent(rule=lambda mems: "Ana: FAULT Gdansk." in mems)
    assert verify(agent, bench_case(faults=(1,)))
    assert len(agent.requests) == 2
    # Redundant check on a single fault-holder: N minus F (both records) right, single removals wrong -> passes,
    # three distinct coalitions after N (one batch).
    agent = ScriptedAgent()
    assert verify(agent, bench_case(faults=(1, 3), mechanism="redundant"))
    assert len(agent.requests) == 4


def test_position_balancing_rule():
    hist = np.array([3, 3, 1, 1, 1])
    assert not position_ok(hist, (0,))  # 4 > floor(10 / 5) + 1 = 3
    assert position_ok(hist, (2,))  # 2 <= 3
    assert position_ok(np.zeros(5, dtype=int), (0, 1))  # an empty histogram takes anything
    assert not position_ok(np.array([2, 0, 0, 0, 0]), (0,))  # 3 > floor(3 / 5) + 1


def test_case_answered_right_again_at_method_time_is_excluded():
    # The builder verified the case, but now the agent answers the full context correctly (as an LLM can under a
    # different batch): run_case returns None (excluded) after asking for N alone.
    agent = ScriptedAgent(rule=lambda mems: False)
    assert run_case(bench_case(), agent, ("loo", "position"), ("correct",), MethodConfig()) is None
    assert len(agent.requests) == 1
    out = run_case(bench_case(), ScriptedAgent(), ("loo", "position", "random", "oracle"), ("correct",),
                   MethodConfig())
    assert out is not None and {m for m, _, _ in out} == {"loo", "position", "random", "oracle"}


def test_controls_rank_all_memories_and_share_the_clearance():
    bc = bench_case(faults=(3,))
    oracle = CaseOutcomes(ScriptedAgent(rule=lambda mems: any("FAULT2" in m for m in mems)), bc.case)
    got = {}
    for name in ("position", "random", "oracle"):
        ev = CachedOracle(5, oracle.mode("correct"))
        got[name] = control(name, 5, ev, bc.case.seed, bc.fault_positions)
    assert got["position"].full_ranking == (0, 1, 2, 3, 4)
    # position clears the prefix up to the fault: 4 memories, recovered; K + 1 = 6 evaluations
    assert got["position"].cleared == (0, 1, 2, 3) and got["position"].recovered
    assert got["position"].evaluations == 6
    assert got["oracle"].full_ranking[0] == 3 and got["oracle"].cleared == (3,) and got["oracle"].recovered
    assert sorted(got["random"].full_ranking) == [0, 1, 2, 3, 4]
    again = control("random", 5, CachedOracle(5, oracle.mode("correct")), bc.case.seed, bc.fault_positions)
    assert again.full_ranking == got["random"].full_ranking  # seeded by the case


@pytest.mark.parametrize("faults", [(1,), (1, 3)])
def test_oracle_control_puts_every_fault_first(faults):
    bc = bench_case(faults=faults, mechanism="direct" if len(faults) == 1 else "redundant")
    rule = (lambda mems: "Ana: FAULT Gdansk." in mems) if len(faults) == 1 else (lambda m: any("FAULT" in x for x in m))
    oracle = CaseOutcomes(ScriptedAgent(rule), bc.case)
    out = control("oracle", 5, CachedOracle(5, oracle.mode("probability")), bc.case.seed, bc.fault_positions)
    assert set(out.full_ranking[: len(faults)]) == set(faults) and out.recovered


class FilteringAgent(ScriptedAgent):
    """A scripted agent with an LLM-filter interface: says to drop the memories containing 'FAULT'."""

    def drop_memories(self, question, options, memories):
        return [i for i, m in enumerate(memories) if "FAULT" in m]


def test_llm_filter_generation_counts_as_one_evaluation():
    agent = CachedAgent(FilteringAgent(), cache=False, phase="methods")
    out = run_case(bench_case(faults=(1, 3), mechanism="redundant"), agent, ("filter",), ("correct",), MethodConfig())
    [(_, _, o)] = out
    assert o.estimator == "llm_filter" and o.cleared == (1, 3) and o.recovered
    assert o.evaluations == 2  # the cleared context's check + the filter's own generation call
    assert agent.calls == {"methods": 2, "methods_filter": 1}  # N (exclusion check), N minus {1, 3}; one generation
    assert set(o.full_ranking[:2]) == {1, 3}


def test_prefetch_verify_batches_the_causal_checks_and_keeps_verify_decisions():
    """Stages go to the agent as one batch each across cases, and `verify` then decides every case from the cache
    exactly as it does alone (a case failing an early stage is not asked the later ones)."""
    cases = [bench_case((1,), "direct"), bench_case((1, 3), "redundant"), bench_case((2,), "direct")]
    alone = [verify(CachedAgent(ScriptedAgent()), bc) for bc in cases]
    # m1 alone leaves FAULT2 (m3) in N minus F, and m2 is no fault at all: both fail stage 2; m1+m3 is redundant
    assert alone == [False, True, False]

    class Calls(ScriptedAgent):
        def __init__(self):
            super().__init__()
            self.batches = []

        def answer_batch(self, requests):
            self.batches.append(len(requests))
            return super().answer_batch(requests)

    inner = Calls()
    cached = CachedAgent(inner)
    from pipeline.bench.builder import prefetch_verify

    prefetch_verify(cached, cases)
    assert len(inner.batches) == 3  # one per stage, not up to three per case
    # stage 1: the three full contexts are one request (same memories); stage 2: every N minus F; stage 3 only for
    # the redundant case, the one still standing: its two single removals, of which N minus m1 was asked in stage 2
    assert inner.batches == [1, 3, 1]
    asked = len(inner.requests)
    assert [verify(cached, bc) for bc in cases] == alone
    assert len(inner.requests) == asked  # all answered from the cache


def test_prefetch_group_holds_the_candidates_balanced_whether_or_not_earlier_ones_are_kept():
    from pipeline.bench.builder import prefetch_group

    cases = [bench_case((1,), "direct"), bench_case((1, 3), "redundant"), bench_case((2,), "direct")]
    wave = [(bc.case.context, bc.faults, bc) for bc in cases]
    hist = np.zeros(5, dtype=np.int64)
    # m1+m3 is balanced on the empty histogram, but not once m1 (position 1) is kept: the group ends before it
    free = [np.inf] * 3
    assert prefetch_group(wave, 0, hist, 1, free) == [0]
    assert prefetch_group(wave, 1, hist, 1, free) == [1, 2]
    assert prefetch_group(wave, 0, hist, None, free) == [0, 1, 2]  # no balancing: the whole wave
    assert prefetch_group([None, *wave[1:]], 0, hist, 1, free) == [1, 2]  # None: full when the wave was frozen
    # one direct case still wanted: the second direct candidate ends the group (the first may fill the quota)
    assert prefetch_group(wave, 0, hist, None, [1, np.inf, 1]) == [0, 1]
    assert prefetch_group(wave, 1, hist, None, [0, np.inf, 0]) == [1]
    # decided without the agent (not retrieved; over-full already): passed over, the group goes on
    not_retrieved = (wave[0][0], ("m9",), cases[0])
    assert prefetch_group([not_retrieved, *wave[1:]], 0, hist, 1, free) == [1, 2]
    assert prefetch_group(wave, 0, np.array([0, 3, 0, 0, 0]), 1, free) == [2]
