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


# Tests that take more than a few seconds on 2 cores (durations measured with `pytest --durations`): marked `slow`, so a
# plain `pytest` (pyproject's addopts) runs the fast unit tests only; `pytest -m ''` (README, CI) runs them all. A file
# name marks the whole file; a node id prefix marks those tests.
SLOW = (
    "test_bench_eval.py",  # builds FI-LoCoMo cases from LoCoMo (module fixture)
    "test_golden.py",  # the sample audit and a reduced eval, compared row by row
    "test_retrieval_scale.py",  # fresh processes and the whole LoCoMo index
    "test_retrieval_stage.py::test_pool_encoder_gives_the_in_process_vectors",
    "test_bench_metrics.py::test_bootstrap_coverage_is_near_nominal",
    "test_audit_local.py::test_sample_pool_planted_faults_fail_and_are_recovered",
    "test_report.py::test_eval_folder_renders_through_the_same_page",
    "test_settings.py::test_eval_max_queries_bounds_the_queries_tried_per_conversation",
    "test_llm_agents.py::test_any_memory_text_stays_inside_its_block",
    "test_resume_and_out.py::test_driver_killed_mid_evaluation_resumes_to_the_undisturbed_outputs",
    "test_flat_driver.py::test_a_killed_driver_keeps_every_case_it_finished",
    "test_bench_budgets.py::test_eval_cli_budgets_writes_curves",
    "test_gpu_check.py::test_without_a_gpu_the_check_stops_at_the_first_cuda_call_in_one_line",
    "test_run_folder_safety.py::test_the_readme_flow_works_in_one_folder_tree",
    "test_lock.py::test_a_stale_lock_is_taken_over_by_one_racer_at_a_time",
    "test_signals.py",  # real subprocesses signalled mid-run, one under Ray
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        node = item.nodeid.split("/")[-1]
        if any(node == s or node.startswith(s + "::") or node.startswith(s + "[") for s in SLOW):
            item.add_marker(pytest.mark.slow)
