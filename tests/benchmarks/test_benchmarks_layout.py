"""The benchmark harnesses live in benchmarks/ at the repository root, outside the wheel (issue 19): the package
discovery leaves them out, the library never imports them, the module map lists them, and the jobs that drive them
find them when run from a clone with nothing on PYTHONPATH."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from setuptools import find_packages

ROOT = Path(__file__).resolve().parents[2]
HARNESSES = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py") if p.name != "__init__.py")


def test_the_wheel_packages_hold_the_library_only():
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    packages = find_packages(str(ROOT), include=find["include"])
    assert "pipeline" in packages and "pipeline.audit" in packages
    assert not [p for p in packages if not p.startswith("pipeline")], packages


def test_no_library_module_imports_the_benchmarks():
    offenders = []
    for path in sorted((ROOT / "pipeline").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            offenders += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] == "benchmarks"]
    assert not offenders, f"pipeline/ must not import benchmarks/ (not in the wheel): {offenders}"


def test_every_harness_is_in_the_module_map():
    text = (ROOT / "docs" / "architecture.md").read_text()
    assert HARNESSES == ["build_cost", "engine", "floor", "gpu_check", "served", "throughput"]
    assert all(f"- `benchmarks/{h}.py`: " in text for h in HARNESSES), "list each benchmarks/ module in architecture.md"


@pytest.mark.parametrize("job", ["bench_engine.py", "bench_agents.py", "bench_openai.py", "gpu_check.py"])
def test_a_job_finds_its_harness_from_a_clone_without_pythonpath(tmp_path, job):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, str(ROOT / "jobs" / job), "--help"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "usage:" in proc.stdout, proc.stderr[-2000:]
