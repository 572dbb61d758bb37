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
from pipeline.errors import AgentStartError, ConfigError, MeClearError, ResourceError
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


# Fault tolerance for system failures (a node lost, an actor process killed): Ray restarts a dead agent actor (its
# __init__ rebuilds the agent) up to MAX_RESTARTS times and retries its unfinished tasks up to MAX_TASK_RETRIES times.
# Tasks are idempotent (a coalition's utility depends on its key only), so a retried task cannot change a result.
# Data failures (an agent error on one case, a NaN utility) are not retried: they go to errors/ (pipeline.audit).
MAX_RESTARTS = 3
MAX_TASK_RETRIES = 3


def actor_options(agent: str, cpus_per_actor: float, gpus_per_actor: float, max_inflight: int = 1) -> dict:
    """`ray.remote` options of an actor that builds `agent`: resources, concurrency, restarts, engine variables."""
    options: dict = {"num_cpus": cpus_per_actor, "num_gpus": gpus_per_actor,
                     "max_concurrency": max_inflight if agent in CONCURRENT_AGENTS else 1,
                     "max_restarts": MAX_RESTARTS, "max_task_retries": MAX_TASK_RETRIES}
    if (runtime_env := agent_runtime_env()) is not None:
        options["runtime_env"] = runtime_env
    return options


def close_actors(actors: list) -> None:
    """Ask each actor to release its agent (engines shut down cleanly), then kill it whatever happened."""
    import ray

    try:
        ray.get([a.close.remote() for a in actors], timeout=120)
    except Exception as exc:  # noqa: BLE001 - a dead or stuck actor: it is killed below either way
        log.warning("agent actors did not close cleanly (%s); killing them", type(exc).__name__)
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


def check_resources(n: int, cpus_per_actor: float, gpus_per_actor: float) -> None:
    """Fail fast, with one line, when the cluster as a whole cannot hold the pool (Ray would wait forever)."""
    import ray

    total = ray.cluster_resources()
    for name, per in (("CPU", cpus_per_actor), ("GPU", gpus_per_actor)):
        need, have = n * per, total.get(name, 0.0)
        if need > have + 1e-9:
            raise ResourceError(f"ray executor: {n} actors x {per:g} {name} = {need:g} {name} but the cluster has "
                                f"{have:g}; lower --actors or the per-actor {name} request")


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"[:500]


class AgentActor:
    """Builds its agent once; evaluates tasks of WorkItems. A build failure is kept as one line (and its exit code)
    and returned by `fingerprint`, so the driver reports it as such instead of an actor traceback."""

    def __init__(self, spec: AgentSpec, utility_mode: str):
        self.agent, self.error = None, None
        try:
            self.agent = build_agent(spec)
        except MeClearError as exc:
            self.error = (str(exc), exc.exit_code)
        except Exception as exc:  # noqa: BLE001 - an engine that cannot start
            self.error = (f"agent {spec.name!r} could not start: {_one_line(exc)}", 2)
        self.utility_mode = utility_mode

    def fingerprint(self) -> str | tuple[str, int]:
        return self.error if self.agent is None else self.agent.fingerprint()

    def pid(self) -> int:
        return os.getpid()

    def evaluate(self, items: list[WorkItem]) -> list[ItemResult]:
        return evaluate_items(self.agent, items, self.utility_mode)

    def close(self) -> None:
        if self.agent is not None:
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
        startup_timeout_s: float = 1800.0,
    ):
        import ray

        self.ray = ray
        actors = pool_size(spec.name, actors, cpus_per_actor, gpus_per_actor)
        check_resources(actors, cpus_per_actor, gpus_per_actor)
        free = ray.available_resources().get("CPU", 0.0)
        if actors * cpus_per_actor > free + 1e-9:
            log.warning("waiting for %g free CPUs for %d agent actors (%g free now; timeout %.0f s)",
                        actors * cpus_per_actor, actors, free, startup_timeout_s)
        options = actor_options(spec.name, cpus_per_actor, gpus_per_actor, max_inflight)
        remote = ray.remote(**options)(AgentActor)
        self.actors = [remote.remote(spec, utility_mode) for _ in range(actors)]
        self.n_workers, self.max_inflight = len(self.actors), max_inflight
        try:  # also waits for every agent to be built
            built = ray.get([a.fingerprint.remote() for a in self.actors], timeout=startup_timeout_s)
        except ray.exceptions.GetTimeoutError:
            self.close()
            raise ResourceError(f"ray executor: {actors} agent actors not started within {startup_timeout_s:.0f} s "
                                "(resources busy or engines slow to build)") from None
        except BaseException:
            self.close()
            raise
        failures = [b for b in built if isinstance(b, (tuple, list))]
        if failures:
            self.close()
            message, code = failures[0]
            err = AgentStartError(message)
            err.exit_code = code
            raise err
        fps = set(built)
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
        actors, self.actors = self.actors, []
        close_actors(actors)
