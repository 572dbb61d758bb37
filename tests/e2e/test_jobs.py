"""Ray job entry points: YAML configs are validated (unknown keys are errors) and the shipped configs load."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest

from pipeline.audit.run import load_job_config
from pipeline.core.errors import ConfigError

JOBS = Path(__file__).resolve().parents[2] / "jobs" / "configs"


def test_shipped_nightly_config_loads_and_expands_the_date():
    job = load_job_config(JOBS / "nightly_audit.yaml")
    assert job.inputs.is_sample and job.audit.executor == "ray" and job.audit.utility == "correct"
    assert job.out.endswith(datetime.date.today().isoformat())


@pytest.mark.parametrize(
    "text, words",
    [
        ("out: x\naudit: {top_k: 5, permutation: 16}\n", "unknown key(s) ['permutation']"),
        ("out: x\ninputs: {memory: a.jsonl}\n", "unknown key(s) ['memory']"),
        ("audit: {}\n", "'out' (the run folder) is required"),
        ("out: x\nextra: 1\n", "unknown key(s) ['extra']"),
        ("out: x\naudit: {tau: -1}\n", "tau=-1"),
        ("- a\n- b\n", "must be a mapping"),
    ],
)
def test_bad_job_configs_are_named_errors(tmp_path, text, words):
    path = tmp_path / "job.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_job_config(path)
    assert words in str(err.value) and str(path) in str(err.value)


def test_nightly_job_runs_locally_in_process(tmp_path, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("nightly_audit", JOBS.parent / "nightly_audit.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg = tmp_path / "job.yaml"
    cfg.write_text(f"out: {tmp_path / 'run'}\naudit: {{executor: local, dense: 'off', utility: correct}}\n")
    assert module.main(["--config", str(cfg), "--no-progress"]) == 0
    assert (tmp_path / "run" / "manifest.json").is_file()
    assert "clearances that recovered the answer" in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text("out: x\naudit: {agent: gpt}\n")
    assert module.main(["--config", str(bad)]) == 2


def test_runtime_env_and_cluster_definitions_parse():
    import yaml

    root = JOBS.parents[1]
    env = yaml.safe_load((root / "env.yaml").read_text())
    assert env["working_dir"] == "." and ".git" in env["excludes"]
    for path in (root / "cluster").glob("*.yaml"):
        spec = yaml.safe_load(path.read_text())
        assert spec["cluster_name"].startswith("meclear") and "provider" in spec, path
