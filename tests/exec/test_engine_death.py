"""A dead engine is not a bad case (issue 20): evaluation raises EngineDeadError instead of sending every remaining
case to errors/; inside a Ray actor the actor exits, Ray restarts it and retries its task, and the run completes with
every row. Case-level errors stay case-level."""

from __future__ import annotations

import dataclasses

import pytest

from pipeline.agents import AgentSpec
from pipeline.audit.run import AuditConfig, InputSpec, run_audit
from pipeline.audit.worker import AgentWorker, engine_died
from pipeline.core.errors import EngineDeadError
from pipeline.exec.pools import LocalPool
from pipeline.testing.faults import DyingAgent
from pipeline.testing.faults import EngineDeadError as FakeEngineDead
from tests.audit.test_resume_and_out import _assert_same_outputs


class OutOfMemoryError(RuntimeError):
    """Named like torch.OutOfMemoryError (CUDA OOM)."""


def test_engine_death_is_recognised_by_name_message_and_cause():
    assert engine_died(FakeEngineDead("x"))
    assert engine_died(OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert engine_died(RuntimeError("CUDA error: an illegal memory access was encountered"))
    try:
        try:
            raise FakeEngineDead("inner")
        except FakeEngineDead as inner:
            raise ValueError("wrapped") from inner
    except ValueError as outer:
        assert engine_died(outer)
    assert not engine_died(ValueError("option text too long"))
    assert not engine_died(KeyError("gold"))


@pytest.mark.parametrize("error", [FakeEngineDead, OutOfMemoryError])
def test_a_dead_engine_raises_out_of_per_case_handling(tmp_path, error):
    pools, queries, files = InputSpec().load()
    cfg = AuditConfig(executor="local", dense="off")
    agent = DyingAgent(tmp_path / "marker", calls_before=0, error=error)
    with pytest.raises(EngineDeadError, match="the agent's engine died"):
        run_audit(pools, queries, cfg, tmp_path / "out", LocalPool(AgentWorker(cfg.agent_spec, agent)),
                  agent.fingerprint(), files, progress=False)


def test_a_case_level_error_stays_case_level(tmp_path):
    class BadCase(DyingAgent):
        def answer_batch(self, requests):
            if any("zzz-unanswerable" in r.question for r in requests):
                raise ValueError("this case's options are unusable")
            return self.inner.answer_batch(requests)

    pools, queries, files = InputSpec().load()
    q0 = queries[0]
    queries = [dataclasses.replace(q0, question=q0.question + " zzz-unanswerable"), *queries[1:]]
    cfg = AuditConfig(executor="local", dense="off")
    agent = BadCase(tmp_path / "marker")
    result = run_audit(pools, queries, cfg, tmp_path / "out", LocalPool(AgentWorker(cfg.agent_spec, agent)),
                       agent.fingerprint(), files, progress=False)
    assert result.failed == 1 and result.cases == len(queries)


@pytest.mark.ray
def test_an_actor_whose_engine_dies_is_restarted_and_the_run_completes(ray_session, tmp_path, sample_audit):
    from pipeline.audit.worker import agent_fingerprint
    from pipeline.exec.ray_pool import RayPool

    pools, queries, files = InputSpec().load()
    cfg = AuditConfig(dense="off", batch_size=32, actors=2)
    spec = AgentSpec("reader", {})
    # each actor's engine dies on its second call; Ray restarts the actor (same arguments: the marker now exists)
    pool = RayPool(AgentWorker, (spec, DyingAgent(tmp_path / "marker"), True), 2, max_inflight=2)
    try:
        pids = ray_session.get([a.pid.remote() for a in pool.actors])
        fp = agent_fingerprint(pool.call_all("fingerprint"))
        result = run_audit(pools, queries, cfg, tmp_path / "ray", pool, fp, files, progress=False)
        after = ray_session.get([a.pid.remote() for a in pool.actors])
    finally:
        pool.close()
    assert (tmp_path / "marker").exists(), "the engine never died: the test proved nothing"
    assert set(after) != set(pids)  # one actor is a new process
    assert result.failed == 0 and result.cases == 36
    _assert_same_outputs(tmp_path / "ray", sample_audit.run(batch_size=32))  # the undisturbed run
