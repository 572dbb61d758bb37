"""Worker pools (pipeline.exec.pools): `map` keeps every worker at its in-flight limit and honours pins; both utilities
come back from one evaluation; the throughput benchmark's recording pool sees exactly the agent calls the workers make;
the scheduler sends whole cases; a worker runs a batch of cases to their rows."""

from __future__ import annotations

from collections import deque

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute  # noqa: F401 - pa.compute
import pytest

from benchmarks.throughput import RecordingPool, batch_requests
from pipeline.agents import AgentSpec
from pipeline.agents.reader import ReaderAgent
from pipeline.audit.cases import make_cases
from pipeline.audit.driver import Scheduler
from pipeline.audit.run import AuditConfig, InputSpec, run_audit
from pipeline.audit.worker import (
    AgentWorker,
    CaseSettings,
    CaseTask,
    WorkItem,
    agent_fingerprint,
    evaluate_items,
    run_cases,
)
from pipeline.core.errors import AgentStartError
from pipeline.exec.pools import LocalPool, map_calls
from pipeline.game import GamePlan, make_plan
from pipeline.retrieval.frozen import Retriever


class Squares:
    def square(self, x: int) -> int:
        return x * x

    def close(self) -> None:
        self.closed = True


class TwoWorkers:
    """A two-worker pool whose calls finish in submission order; records (worker, item) of every call."""

    def __init__(self, max_inflight: int):
        self.n_workers, self.max_inflight = 2, max_inflight
        self.queue: deque = deque()
        self.calls: list[tuple[int, int]] = []
        self.peak = [0, 0]
        self.inflight = [0, 0]

    def submit(self, worker, method, *args):
        self.queue.append((worker, args[0]))
        self.calls.append((worker, args[0]))
        self.inflight[worker] += 1
        self.peak[worker] = max(self.peak[worker], self.inflight[worker])

    def next_done(self):
        worker, item = self.queue.popleft()
        self.inflight[worker] -= 1
        return worker, item * item if isinstance(item, int) else []  # a scheduler's batch: no results needed


@pytest.mark.parametrize("max_inflight", [1, 3])
def test_map_honours_pins_and_the_inflight_limit(max_inflight):
    pool = TwoWorkers(max_inflight)
    items = list(range(10))
    pins = [1, None, 1, 0, None, 1, 1, None, 0, 1]
    assert sorted(map_calls(pool, "square", items, pins)) == sorted(i * i for i in items)
    assert sorted(item for _, item in pool.calls) == items  # each item once
    assert all(w == pins[item] for w, item in pool.calls if pins[item] is not None)
    assert max(pool.peak) == max_inflight and pool.inflight == [0, 0]


def test_local_pool_maps_and_calls_its_one_worker():
    worker = Squares()
    pool = LocalPool(worker)
    assert list(pool.map("square", [1, 2, 3])) == [1, 4, 9]
    assert pool.call_all("square", 5) == [25]
    pool.close()
    assert worker.closed


def test_one_evaluation_gives_both_utilities():
    pools, queries, _ = InputSpec().load()
    contexts = Retriever(pools, 5, "off").freeze_all(queries[:3])
    cases = make_cases(queries[:3], contexts, 0)
    items = [WorkItem(i, c, np.arange(1 << c.k, dtype=np.int64), "plan") for i, c in enumerate(cases)]
    for res in evaluate_items(ReaderAgent(), items):
        assert res.error is None and len(res.probability) == len(res.masks)
        assert np.array_equal(res.utility("probability"), res.probability)
        assert np.array_equal(res.utility("correct"), res.correct.astype(float))
        assert ((res.probability > 0) & (res.probability < 1)).any()


def test_agent_build_failure_is_one_line_with_its_exit_code():
    worker = AgentWorker(AgentSpec("reader", {"nope": 1}))
    with pytest.raises(AgentStartError, match=r"^agent 'reader': unknown key\(s\) \['nope'\]") as info:
        agent_fingerprint(LocalPool(worker).call_all("fingerprint"))
    assert info.value.exit_code == 2


def test_recording_pool_sees_every_evaluated_coalition(tmp_path):
    pools, queries, files = InputSpec().load()
    cfg = AuditConfig(executor="local", dense="off", utility="correct", batch_size=64)
    agent = ReaderAgent()
    recorder = RecordingPool(LocalPool(AgentWorker(cfg.agent_spec, agent)))
    result = run_audit(pools, queries, cfg, tmp_path / "o", recorder, agent.fingerprint(), files, progress=False)
    sizes = [len(batch_requests(b)) for b in recorder.batches]
    assert sum(sizes) == result.evaluated == pl.read_parquet(tmp_path / "o" / "utilities").height
    assert max(sizes) <= 64  # batch_size; no case of the sample pool has more than 32 coalitions a pass


def test_scheduler_sends_whole_cases_up_to_batch_size_and_keeps_the_inflight_limit():
    pool = TwoWorkers(max_inflight=1)
    settings = CaseSettings("run", "agent", "correct", 0.05, 0.02, 1.96)
    sched = Scheduler(pool, batch_size=4, settings=settings)
    plan = lambda n: GamePlan(2, "exact", 1, False, 0, np.zeros((0, 2), dtype=np.int64),  # noqa: E731
                              np.arange(n, dtype=np.int64))
    for ci, n in enumerate([3, 3, 2, 5, 1]):
        sched.enqueue(CaseTask(ci, None, plan(n)))
    sched.fill()  # one task per worker: 3 + 3 exceed batch_size 4, so cases 0 and 1 go alone
    assert [(w, [t.case_index for t in b]) for w, b in pool.calls] == [(0, [0]), (1, [1])]
    assert pool.peak == [1, 1]
    while sched.busy:
        sched.wait()
        sched.fill()
    # case 3, larger than batch_size, goes alone and whole; every case is sent once
    assert [[t.case_index for t in b] for _, b in pool.calls] == [[0], [1], [2], [3], [4]]
    assert pool.peak == [1, 1] and pool.inflight == [0, 0]
    reused = CaseTask(5, None, plan(4), (np.arange(3, dtype=np.int64), np.zeros(3), np.zeros(3, bool), ["a"] * 3))
    assert reused.first_pass == 1  # only the coalitions no earlier run wrote


class CallsAgent(ReaderAgent):
    """The reader, recording the size of every agent call; fails on `fail_key`'s requests after the first call."""

    def __init__(self, fail_key: str | None = None):
        super().__init__()
        self.sizes: list[int] = []
        self.fail_key = fail_key

    def answer_batch(self, requests):
        self.sizes.append(len(requests))
        if len(self.sizes) > 1 and any(r.case_key == self.fail_key for r in requests):
            raise ValueError("cannot answer")
        return super().answer_batch(requests)


def test_run_cases_batches_each_pass_keeps_failures_to_their_case_and_reduces_reused_cases_without_calls():
    pools, queries, _ = InputSpec().load()
    cases = make_cases(queries[:8], Retriever(pools, 5, "off").freeze_all(queries[:8]), 0)
    tasks = [CaseTask(i, c, make_plan(c.k, 4, "permutation", seed=c.seed)) for i, c in enumerate(cases)]
    settings = CaseSettings("run", "agent", "correct", 0.05, 0.02, 1.96)

    clean_agent = CallsAgent()
    clean = run_cases(clean_agent, tasks, settings)
    # every first pass in one agent call, every clearance pass in a second: LLM batching is kept
    assert len(clean.calls) == 2 and clean_agent.sizes == [sum(t.plan.n_coalitions for t in tasks),
                                                           sum(len(m) for _, m, _ in clean.calls[1])]
    assert {stage for _, _, stage in clean.calls[1]} == {"clearance"}
    assert clean.finished == list(range(8)) and not clean.failed and len(clean.clearances) == 8
    assert clean.utilities.num_rows == sum(clean_agent.sizes) == sum(c.evaluations for c in clean.clearances)
    assert clean.attributions.num_rows == 8 * 5 and clean.interactions.num_rows == 8 * 10
    assert clean.contexts.num_rows == 8 * 5 and clean.clearances_table.to_pylist() == [c.as_row() for c in
                                                                                     clean.clearances]

    target = clean.calls[1][0][0]  # a case with a clearance pass
    failing = run_cases(CallsAgent(cases[target].key), tasks, settings)
    assert failing.failed == [target] and target not in failing.finished and len(failing.clearances) == 7
    assert [(e["kind"], e["stage"], e["reason"]) for e in failing.errors] == [("agent_error", "clearance",
                                                                               "ValueError: cannot answer")]
    assert failing.contexts.num_rows == 8 * 5 and failing.clearances_table.num_rows == 7  # its context is written
    kept = failing.utilities.filter(pa.compute.equal(failing.utilities["query_id"], cases[target].query.query_id))
    assert kept.num_rows == tasks[target].plan.n_coalitions  # its first pass is kept, the run went on
    assert [c.as_row() for c in failing.clearances] == [c.as_row() for c in clean.clearances if c.query_id !=
                                                        cases[target].query.query_id]

    util = clean.utilities.to_pydict()
    reused_tasks = []
    for t in tasks:
        rows = [i for i, q in enumerate(util["query_id"]) if q == t.case.query.query_id]
        prev = (np.array([util["coalition"][i] for i in rows]), np.array([util["utility"][i] for i in rows]),
                np.array([util["correct"][i] for i in rows]), [util["answer"][i] for i in rows])
        reused_tasks.append(CaseTask(t.case_index, t.case, t.plan, prev))
    assert all(t.first_pass == 0 for t in reused_tasks)
    again_agent = CallsAgent()
    again = run_cases(again_agent, reused_tasks, settings)
    assert again_agent.sizes == [] and again.calls == [] and again.utilities is None  # nothing asked of the agent
    assert [c.as_row() for c in again.clearances] == [c.as_row() for c in clean.clearances]
    for name in ("attributions", "interactions"):  # polars: NaN (an interaction not estimable) equals NaN
        assert pl.from_arrow(getattr(again, name)).equals(pl.from_arrow(getattr(clean, name))), name
