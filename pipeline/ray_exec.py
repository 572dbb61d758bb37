"""The one module that knows Ray: an actor pool of agents behind the `Executor` contract.

Each actor builds its agent once (an LLM engine is started once per actor) and answers tasks: lists of whole cases'
coalitions. The driver keeps a few tasks in flight per actor so engines stay busy, and pins a case's second pass to the
actor that ran its first (that actor's prefix cache holds the case's prompt prefix). `ray.init()` joins the cluster
named by RAY_ADDRESS (set by `ray job submit`) and otherwise starts a local, embedded Ray.
"""

from __future__ import annotations

import logging
import os
from typing import Mapping

from pipeline.agents import AgentSpec, build_agent
from pipeline.errors import ConfigError
from pipeline.stage import ItemResult, WorkItem, evaluate_items

log = logging.getLogger(__name__)

# Engine settings that vLLM, Hugging Face and torch.compile read from the environment (VLLM_CPU_KVCACHE_SPACE sizes the
# CPU KV cache, HF_HUB_OFFLINE, TORCHINDUCTOR_CACHE_DIR, VLLM_RPC_BASE_PATH, ...). A local Ray worker inherits the
# environment Ray was started with, not the driver's current one, so variables set after `ray.init` (a test session,
# a CLI run inside a longer-lived process) would never reach the agents: the executor forwards them explicitly.
FORWARDED_ENV_PREFIXES = ("VLLM_", "HF_", "TORCHINDUCTOR_", "TRANSFORMERS_", "TOKENIZERS_")
# Never forwarded: a runtime env is visible in Ray's dashboard and state API. Credentials reach a cluster through its
# own secret handling, not through this convenience.
_SECRET_MARKERS = ("TOKEN", "SECRET", "PASSWORD", "KEY")
# Agents whose answer_batch is thread-safe and leaves the GIL free while their engine works in another process (vLLM):
# their actor runs up to `max_inflight` tasks at once, so it builds the next batch's prompts while the engine runs the
# current one (measured with jobs/bench_agents.py: tokenisation was ~20% of the pipeline's time on the tiny model).
# The other agents compute in the calling thread, where a second thread would only contend.
CONCURRENT_AGENTS = frozenset({"vllm"})


def agent_runtime_env(environ: Mapping[str, str] | None = None) -> dict | None:
    """The runtime_env of agent actors: the driver's engine variables (see FORWARDED_ENV_PREFIXES), or None.

    Ray merges actor env_vars into a job's runtime env (`ray job submit --runtime-env`), so this adds to env.yaml
    rather than replacing it.
    """
    environ = os.environ if environ is None else environ
    env = {k: v for k, v in environ.items()
           if k.startswith(FORWARDED_ENV_PREFIXES) and not any(m in k.upper() for m in _SECRET_MARKERS)}
    return {"env_vars": env} if env else None


def pool_size(agent: str, actors: int, cpus_per_actor: float, gpus_per_actor: float) -> int:
    """How many agent actors to start. `actors=0` sizes the pool: one per free GPU (gpus_per_actor > 0), one LLM
    engine on a CPU-only pool (it already uses every core; a second would only contend), one reader per free CPU."""
    import ray

    if actors:
        return actors
    res = ray.available_resources()
    if gpus_per_actor > 0:
        n = int(res.get("GPU", 0) // gpus_per_actor)
        if n == 0:
            raise ConfigError(f"ray executor: gpus_per_actor={gpus_per_actor} but the cluster has no free GPU")
        return n
    if agent != "reader":
        return 1
    return max(1, int(res.get("CPU", 1) // max(cpus_per_actor, 1e-9)))


def actor_options(agent: str, cpus_per_actor: float, gpus_per_actor: float, max_inflight: int = 1) -> dict:
    """`ray.remote` options of an actor that builds `agent`: resources, concurrency, forwarded engine variables."""
    options: dict = {"num_cpus": cpus_per_actor, "num_gpus": gpus_per_actor,
                     "max_concurrency": max_inflight if agent in CONCURRENT_AGENTS else 1}
    if (runtime_env := agent_runtime_env()) is not None:
        options["runtime_env"] = runtime_env
    return options


def close_actors(actors: list) -> None:
    """Ask each actor to release its agent (engines shut down cleanly), then kill it whatever happened."""
    import ray

    try:
        ray.get([a.close.remote() for a in actors], timeout=120)
    finally:
        for a in actors:
            ray.kill(a)


def init_ray(num_cpus: int | None = None, temp_dir: str | None = None) -> bool:
    """Start or join Ray. Returns True when this call started it (the caller then shuts it down)."""
    import ray

    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        ray.init(log_to_driver=True)
        log.info("joined Ray cluster at %s", os.environ["RAY_ADDRESS"])
    else:
        # An embedded, single-user Ray needs no token auth (Ray 2.60 would otherwise write a token under $HOME).
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        # address="local": a plain ray.init() would join whatever cluster `ray start` last left on this machine
        kwargs = {"address": "local", "include_dashboard": False, "num_cpus": num_cpus, "log_to_driver": True}
        if temp_dir:
            kwargs["_temp_dir"] = temp_dir
        ray.init(**kwargs)
        log.info("started local Ray with %s CPUs", ray.cluster_resources().get("CPU"))
    return True


class AgentActor:
    """Builds its agent once; evaluates tasks of WorkItems."""

    def __init__(self, spec: AgentSpec, utility_mode: str):
        self.agent = build_agent(spec)
        self.utility_mode = utility_mode

    def fingerprint(self) -> str:
        return self.agent.fingerprint()

    def evaluate(self, items: list[WorkItem]) -> list[ItemResult]:
        return evaluate_items(self.agent, items, self.utility_mode)

    def close(self) -> None:
        self.agent.close()


class RayExecutor:
    """An actor pool of agents. `actors=0` sizes the pool: one per free GPU (gpus_per_actor > 0), one LLM engine on a
    CPU-only cluster, or one reader per free CPU."""

    def __init__(
        self,
        spec: AgentSpec,
        utility_mode: str,
        actors: int = 0,
        cpus_per_actor: float = 1.0,
        gpus_per_actor: float = 0.0,
        max_inflight: int = 2,
    ):
        import ray

        self.ray = ray
        actors = pool_size(spec.name, actors, cpus_per_actor, gpus_per_actor)
        options = actor_options(spec.name, cpus_per_actor, gpus_per_actor, max_inflight)
        remote = ray.remote(**options)(AgentActor)
        self.actors = [remote.remote(spec, utility_mode) for _ in range(actors)]
        self.n_workers, self.max_inflight = len(self.actors), max_inflight
        fps = set(ray.get([a.fingerprint.remote() for a in self.actors]))  # also waits for every agent to be built
        if len(fps) != 1:
            raise ConfigError(f"ray executor: actors built different agents {sorted(fps)}; check the agent settings")
        self.fingerprint = fps.pop()
        self._refs: dict = {}
        log.info("actor pool: %d x %s", self.n_workers, self.fingerprint)

    def submit(self, worker: int, items: list[WorkItem]) -> None:
        self._refs[self.actors[worker].evaluate.remote(items)] = worker

    def next_done(self) -> tuple[int, list[ItemResult]]:
        ready, _ = self.ray.wait(list(self._refs), num_returns=1)
        worker = self._refs.pop(ready[0])
        return worker, self.ray.get(ready[0])

    def close(self) -> None:
        close_actors(self.actors)
        self.actors = []
