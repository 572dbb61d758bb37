"""The compute floor of an LLM agent's work, and how far above it a run is.

floor_s = uncached prompt tokens x FLOPs per token / the machine's GEMM rate. FLOPs per token are 2 x the model's
matmul parameters, counted from its config (`flops_per_token`: attention projections, MLP, and the vocabulary head once;
the attention-score FLOPs, 4 x context x hidden per layer, are left out: a few percent at these prompt lengths). The
GEMM rate is measured here with torch at the model's own shapes, in the same run (`gemm_rate`), not assumed.

Nothing here imports vLLM or Ray at module level, so other benchmarks (the GPU one) import these functions freely;
`run_floor_case` needs vLLM and must run under `if __name__ == "__main__":` (vLLM spawns its engine).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence


def matmul_params(config: Mapping[str, Any]) -> int:
    """Parameters that take part in a matmul per token, from a Hugging Face Llama-style config.json: per layer the q, k,
    v, o projections and the gated MLP (3 matrices), plus the vocabulary head (tied or not, it is one matmul)."""
    h = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    kv = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or h // heads)
    inter = int(config["intermediate_size"])
    layers = int(config["num_hidden_layers"])
    attn = h * heads * head_dim + 2 * h * kv * head_dim + heads * head_dim * h
    return layers * (attn + 3 * h * inter) + int(config["vocab_size"]) * h


def flops_per_token(model_dir: str | Path) -> float:
    """2 x matmul parameters of the model in `model_dir` (its config.json). SmolLM2-135M: ~0.27 GFLOP."""
    return 2.0 * matmul_params(json.loads((Path(model_dir) / "config.json").read_text()))


def gemm_rate(shapes: Sequence[tuple[int, int, int]], dtype: str = "float32", device: str = "cpu",
              seconds: float = 1.0) -> dict[str, float]:
    """Measured FLOP/s of torch matmuls (m x k) @ (k x n) for each shape, best of repeated timings within ~`seconds`
    per shape, on the threads torch uses here. Returns {"m x k x n": FLOP/s, ..., "best": the highest}."""
    import torch

    out: dict[str, float] = {}
    for m, k, n in shapes:
        a = torch.randn(m, k, dtype=getattr(torch, dtype), device=device)
        b = torch.randn(k, n, dtype=getattr(torch, dtype), device=device)
        sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
        for _ in range(3):
            a @ b
        sync()
        best, spent = float("inf"), 0.0
        while spent < seconds:
            t = time.perf_counter()
            for _ in range(4):
                a @ b
            sync()
            dt = (time.perf_counter() - t) / 4
            best, spent = min(best, dt), spent + 4 * dt
        out[f"{m}x{k}x{n}"] = 2.0 * m * k * n / best
    out["best"] = max(out.values())
    return out


def engine_dtype(agent_config: Mapping[str, Any] | None = None) -> str:
    """The dtype the vLLM agent's engine computes in on this machine, for the GEMM rate of its floor.

    A float32 GEMM rate is the wrong yardstick for an engine that runs in bfloat16: on a CPU with native bfloat16
    (AVX512-BF16, AMX) vLLM's `auto` runs SmolLM2 in bfloat16, and a float32 floor put the build at 0.7x "its floor"
    (AMD EPYC, 2 cores, 2026-12-04). `auto` on CPU is bfloat16 in vLLM (it downcasts a float32 checkpoint); the agent
    turns it into float32 where the CPU lacks native bfloat16 (`resolved_dtype`)."""
    from pipeline.agents.vllm_agent import VLLMConfig, on_cpu_platform, resolved_dtype

    cpu = on_cpu_platform()
    dtype = resolved_dtype(VLLMConfig.from_mapping(dict(agent_config or {"model": "x"})), cpu)
    return {"auto": "bfloat16" if cpu else "float16", "half": "float16", "float": "float32"}.get(dtype, dtype)


def model_shapes(model_dir: str | Path, tokens: int = 256) -> list[tuple[int, int, int]]:
    """The model's own GEMMs for a chunk of `tokens` tokens: the MLP up-projection and the vocabulary head."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    h, inter, vocab = int(cfg["hidden_size"]), int(cfg["intermediate_size"]), int(cfg["vocab_size"])
    return [(tokens, h, inter), (tokens, inter, h), (tokens, h, vocab)]


def floor_seconds(uncached_tokens: int, per_token_flops: float, rate: float) -> float:
    """The compute floor: the FLOPs of the tokens the engine must compute, at the measured GEMM rate."""
    return uncached_tokens * per_token_flops / rate


@dataclass
class FloorRow:
    """One scoring method on one K=5 case: tokens, FLOPs, time (median of passes), ratio to the floor."""

    scoring: str
    method: str
    coalitions: int
    requests: int  # engine requests (cloze: per option; retries included)
    prompt_tokens: int
    uncached_tokens: int
    gflop: float
    floor_s: float
    seconds: float  # median over passes, prefix cache reset before each
    ratio: float  # seconds / floor_s
    answers_equal_to_first: float  # agreement of the chosen options with the first row of the same scoring
    max_prob_diff: float  # largest |option probability difference| against that row


def run_floor_case(model: str, locomo: str, conversation: str, top_k: int = 5, passes: int = 3,
                   case_index: int = 0) -> dict[str, Any]:
    """Build one vLLM agent (the audit's defaults), answer all 2^K coalitions of one LoCoMo case as one batch under
    cloze (the step method before, the prompt-log-probability method now) and letter scoring, each `passes` times from
    an empty prefix cache; measure the GEMM rate in the same process, before and after."""
    from statistics import median

    from pipeline.agents import AgentSpec, build_agent, prompts
    from pipeline.agents.models import resolve_model
    from pipeline.agents.vllm_agent import CLOZE_PROMPT, CLOZE_STEPS, engine_jobs
    from pipeline.audit.cases import make_cases
    from pipeline.audit.run import InputSpec
    from pipeline.retrieval.frozen import Retriever

    model_dir = resolve_model(model)
    pools, queries, _ = InputSpec(locomo=locomo, conversations=(conversation,)).load()
    queries = [q for q in queries if q.options]
    contexts = Retriever(pools, top_k, "off").freeze_all(queries[: case_index + 1])
    case = make_cases(queries[: case_index + 1], contexts, seed=0)[case_index]
    batch = [case.request(mask) for mask in range(1 << case.k)]
    per_token = flops_per_token(model_dir)
    spec = {"model": model, "scoring": "cloze"}
    dtype = engine_dtype(spec)
    rates = [gemm_rate(model_shapes(model_dir), dtype=dtype)]
    t = time.perf_counter()
    agent = build_agent(AgentSpec("vllm", spec))
    start_s = time.perf_counter() - t
    rows: list[FloorRow] = []
    try:
        tokenizer = agent.builder.tokenizer
        variants = [("cloze", CLOZE_STEPS), ("cloze", CLOZE_PROMPT), ("letter", "one token")]
        firsts: dict[str, list] = {}
        for scoring, method in variants:
            # the same engine, its prompt builder switched: letter scoring lists the options, cloze does not
            agent.builder = prompts.PromptBuilder(tokenizer, agent.config.max_options, cloze=scoring == "cloze")
            agent.cloze_method = method if scoring == "cloze" else CLOZE_PROMPT
            times, responses, retries = [], [], agent.cloze_retries
            n_requests = len(engine_jobs(agent.builder, agent.config, agent._vllm.SamplingParams, batch, 1,
                                         agent.cloze_method))
            for _ in range(passes):
                agent.reset_prefix_cache()
                t = time.perf_counter()
                responses = agent.answer_batch(batch)
                times.append(time.perf_counter() - t)
            n_requests += (agent.cloze_retries - retries) // passes
            prompt = sum(r.prompt_tokens or 0 for r in responses)
            uncached = prompt - sum(r.cached_tokens or 0 for r in responses)
            floor = floor_seconds(uncached, per_token, rates[0]["best"])
            ref = firsts.setdefault(scoring, responses)
            agree = sum(a.answer == b.answer for a, b in zip(responses, ref)) / len(batch)
            diff = max(abs(x - y) for a, b in zip(responses, ref) for x, y in zip(a.option_probs, b.option_probs))
            secs = median(times)
            rows.append(FloorRow(scoring, method, len(batch), n_requests, prompt, uncached,
                                 uncached * per_token / 1e9, floor, secs, secs / floor, agree, diff))
    finally:
        agent.close()
    rates.append(gemm_rate(model_shapes(model_dir), dtype=dtype))
    return {"model": model, "conversation": conversation, "query": case.query.query_id, "top_k": top_k,
            "options": list(case.query.options), "passes": passes, "engine_start_s": start_s,
            "flops_per_token": per_token, "gemm_dtype": dtype, "gemm_rate_before": rates[0],
            "gemm_rate_after": rates[1],
            "rows": [asdict(r) for r in rows]}


def format_floor(report: Mapping[str, Any]) -> str:
    rate = report["gemm_rate_before"]["best"]
    lines = [f"model {report['model']}, {report['conversation']} {report['query']}, K={report['top_k']}: "
             f"{report['flops_per_token'] / 1e9:.3f} GFLOP/token, GEMM rate ({report.get('gemm_dtype', 'float32')}) "
             f"{rate / 1e9:.1f} GFLOP/s before, "
             f"{report['gemm_rate_after']['best'] / 1e9:.1f} after; engine start {report['engine_start_s']:.0f} s",
             "",
             "| scoring | method | coalitions | requests | prompt tokens | uncached tokens | GFLOP | floor s | "
             "time s | time / floor | answers equal | max prob diff |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        lines.append(f"| {r['scoring']} | {r['method']} | {r['coalitions']} | {r['requests']} | "
                     f"{r['prompt_tokens']:,} | "
                     f"{r['uncached_tokens']:,} | {r['gflop']:.1f} | {r['floor_s']:.2f} | {r['seconds']:.2f} | "
                     f"{r['ratio']:.1f}x | {r['answers_equal_to_first']:.0%} | {r['max_prob_diff']:.1e} |")
    return "\n".join(lines)
