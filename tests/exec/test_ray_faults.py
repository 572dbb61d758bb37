"""Faults under real Ray: an agent actor killed with SIGKILL mid-run is restarted and its tasks retried, so the run
completes by itself with the undisturbed outputs; requests the cluster cannot hold and agents that cannot start fail
at once with one line and exit code 2."""

from __future__ import annotations

import os
import signal

import pytest

from pipeline.agents import AgentSpec
from pipeline.audit.actors import start_agent_pool
from pipeline.audit.run import AuditConfig, InputSpec, run_audit
from pipeline.cli.main import main
from pipeline.core.errors import AgentStartError
from pipeline.exec.ray_pool import RayPool
from tests.audit.test_resume_and_out import _assert_same_outputs
from tests.data_paths import LOCOMO

pytestmark = pytest.mark.ray


class KillingPool(RayPool):
    """After the first finished task, SIGKILLs the process of actor 0 while it still has tasks in flight."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.victim = self.ray.get(self.actors[0].pid.remote())
        self.killed = False

    def next_done(self):
        done = super().next_done()
        if not self.killed and 0 in self._refs.values():
            os.kill(self.victim, signal.SIGKILL)
            self.killed = True
        return done


def test_agent_actor_killed_mid_run_restarts_and_outputs_match(ray_session, tmp_path, sample_audit):
    pools, queries, files = InputSpec().load()
    cfg = AuditConfig(utility="correct", dense="off", batch_size=32, actors=2)
    ex, fingerprint = start_agent_pool(AgentSpec("reader", {}), actors=2, pool_cls=KillingPool)
    try:
        result = run_audit(pools, queries, cfg, tmp_path / "ray", ex, fingerprint, files, progress=False)
        assert ex.killed
        assert ray_session.get(ex.actors[0].pid.remote()) != ex.victim  # a restarted actor, a new process
    finally:
        ex.close()
    assert result.failed == 0 and result.cases == 36
    _assert_same_outputs(tmp_path / "ray", sample_audit.run(utility="correct", batch_size=32))  # undisturbed


def test_more_actors_than_the_cluster_holds_fail_fast_with_one_line(ray_session, tmp_path, capsys):
    rc = main(["audit", "--out", str(tmp_path / "o"), "--actors", "5", "--dense", "off", "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "5 actors x 1 CPU = 5 CPU but the cluster has 2" in err, err
    assert not (tmp_path / "o").exists()


def test_agent_that_cannot_start_inside_an_actor_is_one_line(ray_session):
    with pytest.raises(AgentStartError, match=r"^agent 'reader': unknown key\(s\) \['nope'\]") as info:
        start_agent_pool(AgentSpec("reader", {"nope": 1}), actors=1)
    assert info.value.exit_code == 2 and "\n" not in str(info.value)


def test_bad_agent_option_under_ray_is_one_line_from_the_driver(ray_session, tmp_path, capsys):
    """The driver validates agent options against the agent's config class when it makes the spec: exit 2, one line
    naming the flag (only the driver's check names it; an actor would not) and nothing written."""
    rc = main(["audit", "--executor", "ray", "--out", str(tmp_path / "o"), "--agent-option", "nope=1",
               "--dense", "off", "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert "agent 'reader' (--agent-option): unknown key(s) ['nope']" in err, err
    assert not (tmp_path / "o").exists()


@pytest.mark.skipif(not LOCOMO.exists(), reason="LoCoMo is not beside the checkout")
def test_bad_agent_option_under_ray_eval_is_one_line(ray_session, tmp_path, capsys):
    rc = main(["eval", "--locomo", str(LOCOMO), "--conversations", "conv-26", "--executor", "ray",
               "--agent-option", "nope=1", "--dense", "off", "--out", str(tmp_path / "e"), "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert "agent 'reader' (--agent-option): unknown key(s) ['nope']" in err, err
    assert not (tmp_path / "e").exists()
