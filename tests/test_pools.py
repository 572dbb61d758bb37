"""Worker pools (pipeline.pools): `map` keeps every worker at its in-flight limit and honours pins; both utilities come
back from one evaluation; the throughput benchmark's recording pool sees exactly the batches the driver evaluates."""

from __future__ import annotations

from collections import deque

import numpy as np
import polars as pl
import pytest

from pipeline.agents import AgentSpec
from pipeline.agents.reader import ReaderAgent
from pipeline.audit import AuditConfig, InputSpec, run_audit
from pipeline.cases import make_cases
from pipeline.errors import AgentStartError
from pipeline.evaluate import AgentWorker, WorkItem, agent_fingerprint, evaluate_items
from pipeline.driver import Scheduler
from pipeline.perf.throughput import RecordingPool, batch_requests
from pipeline.pools import LocalPool, map_calls
from pipeline.retrieval import Retriever


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


def test_scheduler_pins_a_case_to_the_worker_that_ran_it():
    pool = TwoWorkers(max_inflight=1)
    sched = Scheduler(pool, batch_size=4)
    item = lambda ci, n: WorkItem(ci, None, np.arange(n, dtype=np.int64), "plan")  # noqa: E731
    sched.enqueue(item(0, 3))
    sched.enqueue(item(1, 3))
    sched.fill()  # case 0 -> worker 0, case 1 -> worker 1 (3 + 3 coalitions exceed batch_size 4)
    assert [(w, [it.case_index for it in b]) for w, b in pool.calls] == [(0, [0]), (1, [1])]
    while sched.busy:
        sched.wait()
    sched.enqueue(item(1, 2), pin=True)  # case 1's second pass: back to worker 1, although worker 0 is free
    sched.enqueue(item(2, 2))  # a new case: any free worker
    sched.fill()
    assert [(w, [it.case_index for it in b]) for w, b in pool.calls[2:]] == [(0, [2]), (1, [1])]
