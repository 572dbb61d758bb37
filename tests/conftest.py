"""Shared fixtures. Ray is started for real, once per test session, only by tests that ask for it."""

from __future__ import annotations

import os
import tempfile

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # Ray 2.60 otherwise writes an auth token under $HOME
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def ray_session():
    import ray

    from pipeline.ray_exec import init_ray

    temp = tempfile.mkdtemp(prefix="meclear-ray-")
    started = init_ray(num_cpus=2, temp_dir=temp)
    yield ray
    if started:
        ray.shutdown()
