"""The audit's actors: agent pools (`AgentWorker`s) sized for the cluster, with their GPU settings checked before any
actor starts, and the embedding pool of the retrieval stage. Built on the generic `pipeline.exec.ray_pool.RayPool`."""

from __future__ import annotations

import logging

from pipeline.agents import AgentSpec
from pipeline.audit.worker import AgentWorker, agent_fingerprint
from pipeline.core.errors import ConfigError, ResourceError
from pipeline.exec.gpu import GpuPlan, cuda_vllm_installed, plan_gpus
from pipeline.exec.ray_pool import (
    GPU_WAIT_S,
    RayPool,
    available_resources,
    check_resources,
    cluster_resources,
    wait_for_gpus,
)

log = logging.getLogger(__name__)

# Agents whose answer_batch is thread-safe and leaves the GIL free while their engine works in another process (vLLM):
# their actor runs up to `max_inflight` tasks at once, so it builds the next batch's prompts while the engine runs the
# current one (measured with jobs/bench_agents.py: tokenisation was ~20% of the pipeline's time on the tiny model).
# The other agents compute in the calling thread, where a second thread would only contend.
CONCURRENT_AGENTS = frozenset({"vllm", "openai"})  # openai: HTTP waits release the GIL


def pool_size(agent: str, actors: int, cpus_per_actor: float, gpus_per_actor: float, reserve_cpus: float = 0.0) -> int:
    """How many agent actors to start. `actors=0` sizes the pool: one per free GPU (gpus_per_actor > 0), one LLM
    engine on a CPU-only pool (it already uses every core; a second would only contend), one reader per free CPU
    (less `reserve_cpus`: the embedding actors')."""
    if actors:
        return actors
    res = available_resources()
    if gpus_per_actor > 0:
        n = int(res.get("GPU", 0) // gpus_per_actor)
        if n == 0:
            raise ConfigError(f"ray executor: gpus_per_actor={gpus_per_actor} but the cluster has no free GPU")
        return n
    if agent != "reader":
        return 1
    return max(1, int((res.get("CPU", 1) - reserve_cpus) // max(cpus_per_actor, 1e-9)))


def plan_pool_gpus(spec: AgentSpec, actors: int, cpus_per_actor: float, gpus_per_actor: float,
                   gpu_wait_s: float = GPU_WAIT_S) -> GpuPlan:
    """The pool's GPU settings (`pipeline.exec.gpu.plan_gpus`) against this cluster, in the driver before any actor
    starts; a GPU request on a cluster with no GPU yet waits for its autoscaler (`wait_for_gpus`)."""
    have = cluster_resources().get("GPU", 0.0)
    plan = plan_gpus(spec.name, spec.options, gpus_per_actor, have,
                     expect_gpus=spec.name == "vllm" and cuda_vllm_installed())
    if plan.note:
        log.warning(plan.note)
    if plan.gpus_per_actor > 0 and have < plan.gpus_per_actor * max(actors, 1) - 1e-9:
        bundle = {"GPU": plan.gpus_per_actor, "CPU": cpus_per_actor}
        wait_for_gpus([bundle] * max(actors, 1), gpu_wait_s)
    return plan


def start_agent_pool(spec: AgentSpec, actors: int = 0, cpus_per_actor: float = 1.0, gpus_per_actor: float = 0.0,
                     max_inflight: int = 2, startup_timeout_s: float = 1800.0,
                     pool_cls: type[RayPool] = RayPool, reserve_cpus: float = 0.0,
                     gpu_wait_s: float = GPU_WAIT_S) -> tuple[RayPool, str]:
    """A pool of agent actors (`AgentWorker`s), sized by `pool_size`, started and checked: returns (pool, the agents'
    fingerprint). GPU settings are checked and defaulted first (`plan_pool_gpus`). The driver keeps `max_inflight`
    tasks in flight per actor so engines stay busy. `reserve_cpus`: CPUs left free for the embedding actors
    (`start_embed_pool`)."""
    plan = plan_pool_gpus(spec, actors, cpus_per_actor, gpus_per_actor, gpu_wait_s)
    spec, gpus_per_actor = AgentSpec(spec.name, plan.agent_options), plan.gpus_per_actor
    actors = pool_size(spec.name, actors, cpus_per_actor, gpus_per_actor, reserve_cpus)
    check_resources(actors, cpus_per_actor, gpus_per_actor, reserve_cpus)
    free = available_resources().get("CPU", 0.0)
    if actors * cpus_per_actor > free + 1e-9:
        log.warning("waiting for %g free CPUs for %d agent actors (%g free now; timeout %.0f s)",
                    actors * cpus_per_actor, actors, free, startup_timeout_s)
    # True: exit on engine death
    pool = pool_cls(AgentWorker, (spec, None, True), actors, cpus_per_actor=cpus_per_actor,
                    gpus_per_actor=gpus_per_actor, max_inflight=max_inflight,
                    concurrent=spec.name in CONCURRENT_AGENTS)
    try:  # also waits for every agent to be built
        fingerprint = agent_fingerprint(pool.call_all("fingerprint", timeout_s=startup_timeout_s))
    except TimeoutError:
        pool.close()
        raise ResourceError(f"ray executor: {actors} agent actors not started within {startup_timeout_s:.0f} s "
                            "(resources busy or engines slow to build)") from None
    except BaseException:
        pool.close()
        raise
    log.info("actor pool: %d x %s", pool.n_workers, fingerprint)
    return pool, fingerprint


# CPUs per embedding actor: MiniLM's torch loop on one core (Ray sets the actor's OMP_NUM_THREADS to match).
EMBED_CPUS = 1.0


def start_embed_pool(n: int):
    """`n` embedding actors (`pipeline.retrieval.embeddings.EmbedWorker`, EMBED_CPUS each) behind a `PoolEncoder`.
    Started by the retrieval stage the first time the embedding cache lacks a text, so a warm night starts none."""
    from pipeline.retrieval.embeddings import EmbedWorker, PoolEncoder

    pool = RayPool(EmbedWorker, (), n, cpus_per_actor=EMBED_CPUS, max_inflight=2)
    try:
        model_ids = set(pool.call_all("model_id"))
    except BaseException:
        pool.close()
        raise
    log.info("embedding pool: %d actors x %s", n, model_ids)
    return PoolEncoder(pool, model_ids.pop())
