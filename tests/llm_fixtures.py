"""Module-scoped fixtures for the real-LLM tests: one tiny model, one transformers agent, one vLLM engine.

vLLM starts its engine core with multiprocessing spawn, which needs an importable `__main__`; pytest's is not. The
engine therefore runs inside a Ray actor (`ray.remote(VLLMAgent)`): the actor's process owns the engine, the test
calls its methods remotely, and the actor is closed and killed at module teardown. This is also how the pipeline runs
the agent, so the test exercises the real path. A Ray session already started by the suite is reused; otherwise one
is started here with private temp folders and shut down afterwards.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from pipeline.testing.tiny_llama import build_tiny_llama

# The vLLM engine settings every test uses: float32 so the cross-check against transformers is tight, a small
# block size so the prefix cache can reuse most of a short prompt, torch.compile on (its cache persists, see below).
VLLM_TEST_OPTIONS = {"dtype": "float32", "max_model_len": 1024, "max_num_seqs": 64, "block_size": 32, "seed": 0,
                     "n_samples": 2, "max_tokens": 8}
# Both backends run the same float32 model on the same token ids, so they differ only in the order of floating-point
# sums (vLLM's CPU attention and fused kernels vs PyTorch's). Measured: a few 1e-6. A real mismatch (shifted positions
# under padding, a missing BOS, the wrong letter token) moves these sharp random-model probabilities by 1e-2 or more,
# so 1e-3 keeps a 100x margin over rounding noise and still catches every such bug.
CROSS_BACKEND_TOL = 1e-3
# Persistent across sessions: the tiny model lives at a stable path, because vLLM keys its compile cache by model
# path, and a warm compile cache turns a ~40 s first torch.compile into a few seconds.
_CACHE_ROOT = Path(os.environ.get("MECLEAR_TEST_CACHE_DIR") or Path(tempfile.gettempdir()) / "meclear-test-cache")


def engine_env_defaults() -> dict[str, str]:
    """Engine settings for the whole test session, set before Ray starts (its workers inherit them): a 1 GiB CPU KV
    cache (vLLM's CPU default reserves most of the machine's memory), no usage stats, persistent compile caches."""
    return {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "TORCHINDUCTOR_CACHE_DIR": str(_CACHE_ROOT / "inductor"),
        "VLLM_CACHE_ROOT": str(_CACHE_ROOT / "vllm"),
    }


def has_module(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def _vllm_env(private_tmp: Path) -> dict[str, str]:
    env = {
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),  # GiB of KV cache on CPU
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "TORCHINDUCTOR_CACHE_DIR": os.environ.get("TORCHINDUCTOR_CACHE_DIR", str(_CACHE_ROOT / "inductor")),
        "VLLM_CACHE_ROOT": os.environ.get("VLLM_CACHE_ROOT", str(_CACHE_ROOT / "vllm")),
        "TMPDIR": str(private_tmp),
        "VLLM_RPC_BASE_PATH": str(private_tmp),
    }
    Path(env["TORCHINDUCTOR_CACHE_DIR"]).mkdir(parents=True, exist_ok=True)
    return env


def start_vllm_server(model: str, log: Path) -> tuple[subprocess.Popen, str]:
    """A REAL `vllm serve` of `model` on loopback (benchmarks/served.py), eager (a faster start), with the engine
    settings of VLLM_TEST_OPTIONS; the process and its base URL (.../v1)."""
    from benchmarks.served import start_server

    return start_server(model, log, {k: VLLM_TEST_OPTIONS[k] for k in ("dtype", "max_model_len", "block_size", "seed")},
                        eager=True)


def tiny_model_path() -> str:
    return str(build_tiny_llama(_CACHE_ROOT / "tiny_llama-seed0", seed=0))


@pytest.fixture(scope="module")
def tiny_model() -> str:
    pytest.importorskip("transformers")
    return tiny_model_path()


@pytest.fixture(scope="module")
def hf_agent(tiny_model: str) -> Iterator[Any]:
    from pipeline.agents.hf_agent import TransformersAgent, TransformersConfig

    agent = TransformersAgent(TransformersConfig(model=tiny_model, dtype="float32", device="cpu", batch_size=8,
                                                 n_samples=2, max_tokens=8))
    yield agent
    agent.close()


@pytest.fixture(scope="module")
def ray_session() -> Iterator[None]:
    if not has_module("ray"):
        pytest.skip("ray is not installed")
    import ray

    if ray.is_initialized():  # the suite's shared session
        yield
        return
    temp_dir = tempfile.mkdtemp(prefix="meclear-ray-", dir="/tmp")  # short: Ray's socket paths have a length limit
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # address="local": always a private cluster, never one that another process on this machine started.
    ray.init(address="local", num_cpus=2, include_dashboard=False, _temp_dir=temp_dir, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


class VLLMHandle:
    """The test's view of the vLLM agent living in a Ray actor: same method names, called synchronously."""

    def __init__(self, actor: Any, start_s: float):
        self._actor = actor
        self.start_s = start_s  # engine start, measured from actor creation to its first answer

    def answer_batch(self, requests: Any) -> Any:
        import ray

        return ray.get(self._actor.answer_batch.remote(list(requests)))

    def drop_memories(self, question: str, options: Any, memories: Any) -> list[int]:
        import ray

        return ray.get(self._actor.drop_memories.remote(question, tuple(options), tuple(memories)))

    def fingerprint(self) -> str:
        import ray

        return ray.get(self._actor.fingerprint.remote())

    def engine_malloc(self) -> str:
        import ray

        return ray.get(self._actor.engine_malloc.remote())


@pytest.fixture(scope="module")
def vllm_agent(tiny_model: str, ray_session: None) -> Iterator[VLLMHandle]:
    if not has_module("vllm"):
        pytest.skip("vllm is not installed: pip install 'meclear[cpu]'")
    import ray

    from pipeline.agents.vllm_agent import VLLMAgent, VLLMConfig

    private_tmp = Path(tempfile.mkdtemp(prefix="meclear-vllm-", dir="/tmp"))
    config = VLLMConfig.from_mapping({"model": tiny_model, **VLLM_TEST_OPTIONS})
    started = time.perf_counter()
    # num_cpus=0: the engine's own processes do the work; the actor only relays calls (and 2 cores are all we have).
    actor = ray.remote(num_cpus=0, runtime_env={"env_vars": _vllm_env(private_tmp)})(VLLMAgent).remote(config)
    handle = VLLMHandle(actor, 0.0)
    handle.fingerprint()  # waits for the constructor, so start-up failures surface here with their traceback
    handle.start_s = time.perf_counter() - started
    try:
        yield handle
    finally:
        try:
            ray.get(actor.close.remote(), timeout=60)
        finally:
            ray.kill(actor)
            shutil.rmtree(private_tmp, ignore_errors=True)
