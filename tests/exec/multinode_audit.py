"""A two-node Ray cluster on this machine, an audit with agent actors on both nodes, the worker node removed mid-run.

Run by tests/exec/test_ray_multinode.py in a process of its own (`python tests/exec/multinode_audit.py OUT REPORT`),
because it starts its own cluster (`ray.cluster_utils.Cluster`: a head with 2 CPUs and a worker node with 1), which
must not meet the test session's Ray. RAY_TMPDIR is set by the caller to a private folder, so the cluster's sockets,
logs and address file stay out of /tmp/ray, where other clusters on the machine live.

Actor 0 is placed on the head and actor 1 on the worker node, each by a soft node affinity: soft, so that when the
worker node is gone Ray restarts actor 1 (`max_restarts`, pipeline.exec.ray_pool) on the head, where one CPU is free,
and retries its unfinished tasks (`max_task_retries`). The worker node is removed (its raylet and workers killed) after
actor 1 has returned a task and while it still has tasks in flight. The facts the test checks are written to REPORT.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import ray
from ray.cluster_utils import Cluster
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from pipeline.agents import AgentSpec
from pipeline.audit.driver import run_audit
from pipeline.audit.run import AuditConfig, InputSpec
from pipeline.audit.worker import AgentWorker, agent_fingerprint
from pipeline.exec.ray_pool import RayPool, actor_options

# A lost node is declared dead after about 1 s of failed health checks (Ray's default waits about 30 s).
SYSTEM = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 200, "health_check_failure_threshold": 5}
CONFIG = AuditConfig(dense="off", batch_size=32, actors=2)  # 32 coalitions a task: one case each, many tasks


class NodeWorker(AgentWorker):
    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()


class TwoNodePool(RayPool):
    """Actor i on nodes[i] (soft affinity); removes `victim` from `cluster` once actor 1 returned a task and still has
    tasks in flight."""

    def __init__(self, spec: AgentSpec, nodes: list[str], cluster: Cluster, victim):
        self.ray = ray
        remote = ray.remote(**actor_options(1.0, 0.0))(NodeWorker)
        self.actors = [remote.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=True)).remote(spec)
                       for n in nodes]
        self.n_workers, self.max_inflight = len(nodes), 2
        self._refs: dict = {}
        self.cluster, self.victim = cluster, victim
        self.removed_with_inflight = 0  # actor 1's tasks in flight when its node was removed
        self.done_before_removal = [0, 0]

    def next_done(self):
        worker, done = super().next_done()
        if not self.removed_with_inflight:
            self.done_before_removal[worker] += 1
            inflight = sum(w == 1 for w in self._refs.values())
            if self.done_before_removal[1] and inflight:
                self.cluster.remove_node(self.victim, allow_graceful=False)
                self.removed_with_inflight = inflight
        return worker, done


def main(out: str, report: str) -> None:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False,
                                                            "_system_config": SYSTEM})
    worker_node = cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        head_id = next(n["NodeID"] for n in ray.nodes() if n["NodeManagerAddress"] and n["Alive"]
                       and n["NodeID"] != worker_node.node_id)
        pools, queries, files = InputSpec().load()
        pool = TwoNodePool(CONFIG.agent_spec, [head_id, worker_node.node_id], cluster, worker_node)
        try:
            fingerprint = agent_fingerprint(pool.call_all("fingerprint", timeout_s=120))
            nodes_at_start = pool.call_all("node_id", timeout_s=60)
            result = run_audit(pools, queries, CONFIG, Path(out), pool, fingerprint, files, progress=False)
            # The run can end before Ray has declared the removed node dead: its killed raylet's workers die a moment
            # later, and until then actor 1's old process may still answer (seen once in CI). Ask where the actors
            # live only once the node is dead, when Ray has moved actor 1.
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and any(n["NodeID"] == worker_node.node_id and n["Alive"]
                                                      for n in ray.nodes()):
                time.sleep(0.2)
            nodes_at_end = pool.call_all("node_id", timeout_s=60)
        finally:
            pool.close()
        facts = {"head": head_id, "worker": worker_node.node_id, "nodes_at_start": nodes_at_start,
                 "nodes_at_end": nodes_at_end, "removed_with_inflight": pool.removed_with_inflight,
                 "done_before_removal": pool.done_before_removal, "cases": result.cases, "failed": result.failed,
                 "evaluated": result.evaluated, "alive_nodes": sum(n["Alive"] for n in ray.nodes())}
        Path(report).write_text(json.dumps(facts))
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
