"""Shared fixtures. Ray is started for real, once per test session, only by tests that ask for it."""

from __future__ import annotations

import os
import tempfile

import pytest
from llm_fixtures import engine_env_defaults

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # Ray 2.60 otherwise writes an auth token under $HOME
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Embeddings are cached on disk (pipeline.retrieval.embeddings); tests share one private cache per session, never
# ~/.cache.
os.environ.setdefault("MECLEAR_CACHE", tempfile.mkdtemp(prefix="meclear-test-cache-"))
# Set at collection, before any test starts Ray: Ray workers inherit the environment Ray starts with, and engines built
# by actors that do not forward the driver's engine variables (see pipeline.exec.ray_pool.agent_runtime_env) still need
# them.
for _key, _value in engine_env_defaults().items():
    os.environ.setdefault(_key, _value)


@pytest.fixture(scope="session")
def ray_session():
    import ray

    from pipeline.exec.ray_pool import cluster_session

    with cluster_session(num_cpus=2, temp_dir=tempfile.mkdtemp(prefix="meclear-ray-")):
        yield ray
