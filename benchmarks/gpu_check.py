"""The GPU check of a bare CUDA node (issue 20, item 5): what can be measured with PyTorch and transformers alone.

Runs on an air-gapped CUDA machine with Python 3.12, torch and transformers and nothing else but this checkout's source
(no Ray, no vLLM, no pyarrow/polars, no network): only `pipeline.agents` is imported, never the driver or Ray. It
measures, on the model given (`smollm2-135m-instruct`, `tiny` for the random test Llama, or a model folder):

- precision: letter and cloze option probabilities of the production setting (transformers in bfloat16 on CUDA; the
  vLLM agent in bfloat16 with its float32 head where vLLM is installed) against the transformers agent in float32 on
  the same prompts; the largest difference must stay within PRECISION_TOLERANCE;
- coalitions/s of the transformers agent on CUDA over a synthetic pool (all 2^K coalitions of `cases` K=5 cases);
- the floor ratio: that time over the compute floor (prompt tokens x FLOPs per token / the GEMM rate measured here,
  with torch, in the same run); the transformers agent has no prefix cache, so every prompt token is computed.

Where vLLM is installed it also compares the vLLM agent (bfloat16, float32 head) with the float32 reference and measures
its coalitions/s; the pipeline/bare-loop ratio (jobs/bench_agents.py, which needs Ray) is run by jobs/gpu_bench.sh.
Everything up to the first CUDA call runs on any machine, and without a GPU the check stops there with one line
(`NoGpuError`, exit 2): the CPU test suite runs it that far.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from itertools import combinations
from pathlib import Path
from typing import Any, Sequence

from pipeline.agents.base import AgentRequest
from pipeline.core.errors import MeClearError

# Largest |P(option) difference| allowed between the production setting and the float32 reference. bfloat16 keeps 8
# bits of mantissa: hidden states and logits carry ~0.4% relative error per layer, which moves the probability of a
# 4-way choice by a few hundredths at most on these short prompts; a larger gap means a wrong dtype or head, not noise.
PRECISION_TOLERANCE = 0.05
K = 5  # memories per synthetic case: 2^5 = 32 coalitions, the audit's exact enumeration at K=5
TINY = "tiny"


class NoGpuError(MeClearError):
    """No CUDA device is visible to torch here: nothing on the GPU can be measured."""

    exit_code = 2


@dataclass(frozen=True)
class CheckSettings:
    model: str = "smollm2-135m-instruct"
    cases: int = 64  # synthetic K=5 cases: 64 x 32 = 2,048 coalitions
    batch_size: int = 32
    precision_cases: int = 4
    device: str = "cuda"
    vllm: bool = True  # also the vLLM agent, where vLLM is installed


def synthetic_requests(cases: int, seed: int = 0) -> list[AgentRequest]:
    """`cases` K=5 multiple-choice cases, every coalition of each (2^K requests per case), in case order."""
    import numpy as np

    rng = np.random.default_rng(seed)
    people = ["Ana", "Ben", "Carla", "Dev", "Emil", "Farah", "Gus", "Hana"]
    cities = ["Lisbon", "Porto", "Madrid", "Leeds", "Oslo", "Turin", "Lyon", "Graz"]
    out = []
    for c in range(cases):
        p = people[c % len(people)]
        opts = tuple(str(x) for x in rng.choice(cities, size=4, replace=False))
        facts = [f"{p} moved to {opts[0]} last spring.", f"{p} once visited {opts[1]} for a week.",
                 f"{p}'s sister lives in {opts[2]}.", f"{p} does not like the weather in {opts[3]}.",
                 f"{p} works from home on Fridays."]
        order = rng.permutation(K)
        mems = [facts[i] for i in order]
        for size in range(K + 1):
            for subset in combinations(range(K), size):
                out.append(AgentRequest(f"synthetic-{c}", f"Which city does {p} live in now?", opts,
                                        tuple(mems[i] for i in subset)))
    return out


def resolve_check_model(model: str, work: Path) -> str:
    """A loadable folder for `model`: the test model built offline (`tiny`), the packaged SmolLM2 (converted once), or
    the folder itself."""
    if model == TINY:
        from pipeline.testing.tiny_llama import build_tiny_llama

        return str(build_tiny_llama(work / "tiny-llama"))
    from pipeline.agents.models import resolve_model

    return resolve_model(model)


def cuda_device() -> dict[str, Any]:
    """The first CUDA call: the device's name and memory, or NoGpuError saying what torch sees instead."""
    import torch

    if not torch.cuda.is_available():
        raise NoGpuError(f"gpu_check: no CUDA GPU on this machine (torch {torch.__version__}, CUDA build "
                         f"{torch.version.cuda or 'none'}, {torch.cuda.device_count()} devices): nothing measured")
    props = torch.cuda.get_device_properties(0)
    return {"name": props.name, "memory_gib": round(props.total_memory / 2**30, 1), "torch": torch.__version__,
            "cuda": torch.version.cuda}


def _agent(model: str, dtype: str, device: str, scoring: str):
    from pipeline.agents.hf_agent import TransformersAgent, TransformersConfig

    return TransformersAgent(TransformersConfig(model=model, dtype=dtype, device=device, scoring=scoring))


def precision(model: str, requests: Sequence[AgentRequest], device: str, candidates: dict) -> list[dict]:
    """For letter and cloze scoring: the largest |P difference| of each candidate (name -> factory(scoring) of an
    agent) against the transformers agent in float32 on `device`, over the same requests."""
    rows = []
    for scoring in ("letter", "cloze"):
        ref_agent = _agent(model, "float32", device, scoring)
        ref = [r.option_probs for r in ref_agent.answer_batch(requests)]
        ref_agent.close()
        for name, make in candidates.items():
            agent = make(scoring)
            got = [r.option_probs for r in agent.answer_batch(requests)]
            agent.close()
            diff = max(abs(a - b) for ra, rb in zip(ref, got) for a, b in zip(ra, rb))
            rows.append({"scoring": scoring, "candidate": name, "reference": "transformers float32",
                         "max_abs_prob_diff": diff, "tolerance": PRECISION_TOLERANCE,
                         "ok": bool(diff <= PRECISION_TOLERANCE)})
    return rows


def _sync(device: str) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously); nothing to wait for on CPU."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def throughput(agent, requests: Sequence[AgentRequest], batch_size: int, device: str = "cuda") -> dict[str, float]:
    """Coalitions/s and prompt tokens of `agent` over `requests`, in batches of `batch_size` (after one warm batch)."""
    agent.answer_batch(requests[:batch_size])
    _sync(device)
    t, tokens = time.perf_counter(), 0
    for i in range(0, len(requests), batch_size):
        tokens += sum(r.prompt_tokens or 0 for r in agent.answer_batch(requests[i:i + batch_size]))
    _sync(device)
    elapsed = time.perf_counter() - t
    return {"coalitions": len(requests), "seconds": elapsed, "coalitions_per_s": len(requests) / elapsed,
            "prompt_tokens": tokens}


def floor_ratio(model_dir: str, seconds: float, tokens: int, dtype: str, device: str) -> dict[str, float]:
    """`seconds` over the compute floor of `tokens` prompt tokens (`benchmarks.floor`: FLOPs per token = 2 x the
    model's matmul parameters, GEMM rate = the best of torch matmuls at the model's shapes, measured now)."""
    from benchmarks.floor import floor_seconds, flops_per_token, gemm_rate, model_shapes

    per_token = flops_per_token(model_dir)
    rate = gemm_rate(model_shapes(model_dir), dtype=dtype, device=device)["best"]
    floor = floor_seconds(tokens, per_token, rate)
    source = "benchmarks.floor"
    return {"flops_per_token": per_token, "gemm_flops_per_s": rate, "floor_s": floor, "seconds": seconds,
            "ratio_to_floor": seconds / floor, "floor_from": source}


def run_check(settings: CheckSettings, work: Path) -> dict[str, Any]:
    """The whole check: model resolved, then the first CUDA call (NoGpuError without a GPU), then the measurements."""
    model = resolve_check_model(settings.model, work)
    requests = synthetic_requests(settings.cases)
    report: dict[str, Any] = {"model": settings.model, "model_path": model, "cases": settings.cases,
                              "coalitions": len(requests)}
    report["device"] = cuda_device()
    probe = synthetic_requests(settings.precision_cases, seed=1)
    candidates = {"transformers bfloat16": lambda scoring: _agent(model, "bfloat16", settings.device, scoring)}
    if settings.vllm and _vllm_installed():
        candidates["vllm bfloat16, float32 head"] = lambda scoring: _vllm_agent(model, scoring)
    report["precision"] = precision(model, probe, settings.device, candidates)
    agent = _agent(model, "bfloat16", settings.device, "auto")
    report["transformers_bf16"] = throughput(agent, requests, settings.batch_size, settings.device) | {
        "scoring": agent.scoring}
    agent.close()
    t = report["transformers_bf16"]
    report["floor"] = floor_ratio(model, t["seconds"], t["prompt_tokens"], "bfloat16", settings.device)
    if settings.vllm and _vllm_installed():
        agent = _vllm_agent(model, "auto")
        report["vllm_bf16"] = throughput(agent, requests, 256, settings.device) | {"scoring": agent.scoring}
        agent.close()
    return report


def _vllm_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def _vllm_agent(model: str, scoring: str):
    """The production vLLM agent (bfloat16; on CUDA its head runs in float32, `vllm_agent.head_overrides`), sharing
    the GPU with nothing else by then; max_model_len from the model (`models.default_max_len`)."""
    from pipeline.agents.vllm_agent import VLLMAgent, VLLMConfig

    return VLLMAgent(VLLMConfig(model=model, dtype="bfloat16", scoring=scoring, gpu_memory_utilization=0.5))


def table(report: dict[str, Any]) -> str:
    lines = [f"GPU check: {report['model']} on {report['device']['name']} ({report['device']['memory_gib']} GiB, "
             f"torch {report['device']['torch']}, CUDA {report['device']['cuda']})",
             f"{'check':<44} {'value':>12}  {'limit':>8}  ok"]
    for r in report["precision"]:
        lines.append(f"{'max |dP| ' + r['scoring'] + ', ' + r['candidate']:<44} {r['max_abs_prob_diff']:>12.4f}  "
                     f"{r['tolerance']:>8.3f}  {'yes' if r['ok'] else 'NO'}")
    t, f = report["transformers_bf16"], report["floor"]
    lines.append(f"{'coalitions/s, transformers bf16 (' + t['scoring'] + ')':<44} {t['coalitions_per_s']:>12.1f}")
    lines.append(f"{'time / compute floor':<44} {f['ratio_to_floor']:>12.2f}")
    if "vllm_bf16" in report:
        v = report["vllm_bf16"]
        lines.append(f"{'coalitions/s, vLLM bf16 (' + v['scoring'] + ')':<44} {v['coalitions_per_s']:>12.1f}")
    return "\n".join(lines)


def write_report(report: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    tmp.replace(out)
