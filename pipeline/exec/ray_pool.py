"""The one module that knows Ray: a generic actor pool (`RayPool`) and one context manager that starts or joins Ray.

It imports no audit code: what runs in the actors is the caller's. The audit's agents (`pipeline.audit.actors.
start_agent_pool`: `pipeline.audit.worker.AgentWorker` actors) and the benchmark's workers
(`pipeline.bench.run.BenchWorker`) are both `RayPool`s, with the `pipeline.exec.pools.WorkerPool` contract that
`pipeline.exec.pools.LocalPool` also has. Each actor builds its worker once (an LLM engine is started once per actor).
`cluster_session()` joins the cluster named by RAY_ADDRESS (set by `ray job submit`) and otherwise starts a local,
embedded Ray that it shuts down again.
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import contextmanager
from typing import Any, Iterator, Mapping, Sequence

from pipeline.core import signals
from pipeline.core.errors import ResourceError
from pipeline.exec.pools import map_calls

log = logging.getLogger(__name__)

# Engine settings that vLLM, Hugging Face and torch.compile read from the environment (VLLM_CPU_KVCACHE_SPACE sizes the
# CPU KV cache, HF_HUB_OFFLINE, TORCHINDUCTOR_CACHE_DIR, VLLM_RPC_BASE_PATH, ...). A local Ray worker inherits the
# environment Ray was started with, not the driver's current one, so variables set after `ray.init` (a test session,
# a CLI run inside a longer-lived process) would never reach the agents: the executor forwards them explicitly.
FORWARDED_ENV_PREFIXES = ("VLLM_", "HF_", "TORCHINDUCTOR_", "TRANSFORMERS_", "TOKENIZERS_")
# Never forwarded: a runtime env is visible in Ray's dashboard and state API. Credentials reach a cluster through its
# own secret handling, not through this convenience.
_SECRET_MARKERS = ("TOKEN", "SECRET", "PASSWORD", "KEY")


def agent_runtime_env(environ: Mapping[str, str] | None = None) -> dict | None:
    """The runtime_env of agent actors: the driver's engine variables (see FORWARDED_ENV_PREFIXES), or None.

    Ray merges actor env_vars into a job's runtime env (`ray job submit --runtime-env`), so this adds to env.yaml
    rather than replacing it.
    """
    environ = os.environ if environ is None else environ
    env = {k: v for k, v in environ.items()
           if k.startswith(FORWARDED_ENV_PREFIXES) and not any(m in k.upper() for m in _SECRET_MARKERS)}
    return {"env_vars": env} if env else None


# Fault tolerance for system failures (a node lost, an actor process killed): Ray restarts a dead agent actor (its
# __init__ rebuilds the agent) up to MAX_RESTARTS times and retries its unfinished tasks up to MAX_TASK_RETRIES times.
# Tasks are idempotent (a coalition's utility depends on its key only), so a retried task cannot change a result.
# Data failures (an agent error on one case, a NaN utility) are not retried: they go to errors/ (pipeline.audit.driver).
# An engine that dies (CUDA OOM, vLLM EngineDeadError) makes its actor exit (`pipeline.audit.worker.AgentWorker`), which
# Ray handles as the system failure it is.
MAX_RESTARTS = 3
MAX_TASK_RETRIES = 3


def actor_options(cpus_per_actor: float, gpus_per_actor: float, max_concurrency: int = 1) -> dict:
    """`ray.remote` options of a pool's actors: resources, concurrency, restarts, engine variables."""
    options: dict = {"num_cpus": cpus_per_actor, "num_gpus": gpus_per_actor, "max_concurrency": max_concurrency,
                     "max_restarts": MAX_RESTARTS, "max_task_retries": MAX_TASK_RETRIES}
    if (runtime_env := agent_runtime_env()) is not None:
        options["runtime_env"] = runtime_env
    return options


@contextmanager
def cluster_session(num_cpus: int | None = None, temp_dir: str | None = None) -> Iterator[None]:
    """Start or join Ray for the body; shut it down after only if this call started it (a test session's or a
    cluster's Ray stays up)."""
    import ray

    if ray.is_initialized():
        yield
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no usage reports unless asked for (no internet here)
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
    signals.reinstall()  # ray.init replaced the SIGTERM handler with a bare sys.exit
    try:
        yield
    finally:
        ray.shutdown()


def check_resources(n: int, cpus_per_actor: float, gpus_per_actor: float, reserve_cpus: float = 0.0) -> None:
    """Fail fast, with one line, when the cluster as a whole cannot hold the pool and `reserve_cpus` beside it (the
    embedding actors'): Ray would wait forever."""
    import ray

    total = ray.cluster_resources()
    for name, per, extra in (("CPU", cpus_per_actor, reserve_cpus), ("GPU", gpus_per_actor, 0.0)):
        need, have = n * per + extra, total.get(name, 0.0)
        if need > have + 1e-9:
            also = f" + {extra:g} for --embed-actors" if extra else ""
            raise ResourceError(f"ray executor: {n} actors x {per:g} {name}{also} = {need:g} {name} but the cluster "
                                f"has {have:g}; lower --actors, --embed-actors or the per-actor {name} request")


class RayPool:
    """`size` Ray actors, each running one `worker_cls(*args)`, with the `pipeline.exec.pools.WorkerPool` contract.

    `concurrent`: the worker's methods are thread-safe and leave the GIL free (see CONCURRENT_AGENTS), so an actor runs
    up to `max_inflight` calls at once; otherwise its calls queue and run one by one.
    """

    def __init__(self, worker_cls: type, args: tuple = (), size: int = 1, *, cpus_per_actor: float = 1.0,
                 gpus_per_actor: float = 0.0, max_inflight: int = 1, concurrent: bool = False):
        import ray

        self.ray = ray
        options = actor_options(cpus_per_actor, gpus_per_actor, max_inflight if concurrent else 1)
        remote = ray.remote(**options)(worker_cls)
        self.actors = [remote.remote(*args) for _ in range(size)]
        self.n_workers, self.max_inflight = size, max_inflight
        self._refs: dict = {}  # object ref of a call in flight -> its worker

    def submit(self, worker: int, method: str, *args: Any) -> None:
        self._refs[getattr(self.actors[worker], method).remote(*args)] = worker

    def next_done(self) -> tuple[int, Any]:
        ready: list = []
        while not ready:  # waits of 1 s, so Ctrl-C is handled within a second even while a task runs for minutes
            ready, _ = self.ray.wait(list(self._refs), num_returns=1, timeout=1.0)
        worker = self._refs.pop(ready[0])
        return worker, self.ray.get(ready[0])

    def call_all(self, method: str, *args: Any, timeout_s: float | None = None) -> list:
        """`method(*args)` on every actor; raises TimeoutError when they have not all answered within `timeout_s`."""
        try:
            return self.ray.get([getattr(a, method).remote(*args) for a in self.actors], timeout=timeout_s)
        except self.ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"{method} not answered by {len(self.actors)} actors within {timeout_s} s") from None

    def map(self, method: str, items: Sequence[Any], pins: Sequence[int | None] | None = None) -> Iterator[Any]:
        return map_calls(self, method, items, pins)

    def close(self) -> None:
        """Ask each actor to close its worker (engines shut down cleanly), then kill it whatever happened."""
        actors, self.actors = self.actors, []
        try:
            self.ray.get([a.close.remote() for a in actors], timeout=120)
        except Exception as exc:  # noqa: BLE001 - a dead or stuck actor: it is killed below either way
            log.warning("actors did not close cleanly (%s); killing them", type(exc).__name__)
        finally:
            for a in actors:
                self.ray.kill(a)


# How long the driver waits for an autoscaling cluster (cluster/gpu-vllm.yaml: min_workers 0) to add the GPU nodes
# that `request_resources` asked for: a cloud GPU node typically takes 3-10 minutes to boot and pull the image.
GPU_WAIT_S = 1200.0
GPU_POLL_S = 5.0


def wait_for_gpus(bundles: list[dict], timeout_s: float = GPU_WAIT_S, *, cluster_resources=None, request=None,
                  sleep=time.sleep, clock=time.monotonic) -> float:
    """Ask the autoscaler for `bundles` (`ray.autoscaler.sdk.request_resources`) and wait until the cluster has the
    GPUs they hold; returns the cluster's GPUs. ResourceError (one line) after `timeout_s`. The request is withdrawn
    either way (it is persistent otherwise): once the agents hold the nodes, the autoscaler keeps them while in use.
    `cluster_resources`, `request`, `sleep`, `clock`: Ray's and time's by default (replaced in unit tests)."""
    import ray

    cluster_resources = cluster_resources or ray.cluster_resources
    if request is None:
        from ray.autoscaler.sdk import request_resources as request
    need = sum(b.get("GPU", 0.0) for b in bundles)
    log.warning("the cluster has no GPU for the agents yet: asked the autoscaler for %d x %s; waiting up to %.0f s",
                len(bundles), bundles[0], timeout_s)
    request(bundles=bundles)
    deadline = clock() + timeout_s
    try:
        while (have := cluster_resources().get("GPU", 0.0)) < need - 1e-9:
            if clock() >= deadline:
                raise ResourceError(f"ray executor: the agents need {need:g} GPUs but the cluster still has {have:g} "
                                    f"after waiting {timeout_s:.0f} s for the autoscaler (request_resources); check "
                                    "the cluster's GPU node type and max_workers, or run with gpus_per_actor 0 on CPUs")
            sleep(GPU_POLL_S)
    finally:
        request(bundles=[])
    log.info("the cluster now has %g GPUs", have)
    return have


def available_resources() -> dict[str, float]:
    """The cluster's free resources now (callers above this module never import Ray themselves)."""
    import ray

    return ray.available_resources()


def cluster_resources() -> dict[str, float]:
    """The cluster's total resources."""
    import ray

    return ray.cluster_resources()
