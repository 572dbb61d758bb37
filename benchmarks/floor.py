"""The compute floor of an LLM agent's work, and how far above it a run is.

floor_s = uncached prompt tokens x FLOPs per token / the machine's GEMM rate. FLOPs per token are 2 x the model's
matmul parameters, counted from its config (`flops_per_token`: attention projections, MLP, and the vocabulary head once;
the attention-score FLOPs, 4 x context x hidden per layer, are left out: a few percent at these prompt lengths). The
GEMM rate is measured here at the model's own shapes, in the same run (`gemm_rate`: torch's matmul and, on a CPU,
vLLM's own oneDNN GEMM, whichever is faster), not assumed.

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


def _onednn_matmul(a: Any, k: int, n: int, dtype: Any) -> Any:
    """A zero-argument call of vLLM's own CPU GEMM (oneDNN, the path its linear layers take on x86) on `a` and a
    random (k x n) weight, or None where vLLM or its oneDNN kernels are absent."""
    try:
        import torch
        import vllm._custom_ops as ops
    except ImportError:
        return None
    if not getattr(ops, "_supports_onednn", False):
        return None
    weight = torch.randn(n, k, dtype=dtype)  # [N, K], as nn.Linear stores it
    try:
        handler = ops.create_onednn_mm(weight.t(), 32)
    except RuntimeError:
        return None
    return lambda: ops.onednn_mm(handler, a, None)


def gemm_rate(shapes: Sequence[tuple[int, int, int]], dtype: str = "float32", device: str = "cpu",
              seconds: float = 1.0) -> dict[str, float]:
    """Measured FLOP/s of (m x k) @ (k x n) matmuls for each shape, best of repeated timings within ~`seconds` per
    shape and kernel, on the threads torch uses here. On a CPU both torch's matmul and vLLM's own oneDNN GEMM are timed
    and the faster counts: on an AMD EPYC with AVX512-BF16 the oneDNN kernel did 481 GFLOP/s in float32 where
    torch's matmul did 194, and 980 against 913 in bfloat16 (2026-12-04), so a floor from torch alone put a float32
    engine at "0.6x its floor". Returns {"m x k x n": FLOP/s, "m x k x n torch": ..., "m x k x n onednn": ...,
    "best": the highest}."""
    import torch

    def timed(fn: Any) -> float:
        sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
        for _ in range(3):
            fn()
        sync()
        best, spent = float("inf"), 0.0
        while spent < seconds:
            t = time.perf_counter()
            for _ in range(4):
                fn()
            sync()
            dt = (time.perf_counter() - t) / 4
            best, spent = min(best, dt), spent + 4 * dt
        return best

    out: dict[str, float] = {}
    for m, k, n in shapes:
        kind = getattr(torch, dtype)
        a = torch.randn(m, k, dtype=kind, device=device)
        b = torch.randn(k, n, dtype=kind, device=device)
        flops = 2.0 * m * k * n
        name = f"{m}x{k}x{n}"
        out[f"{name} torch"] = flops / timed(lambda: a @ b)
        onednn = _onednn_matmul(a, k, n, kind) if device == "cpu" else None
        if onednn is not None:
            out[f"{name} onednn"] = flops / timed(onednn)
        out[name] = max(out[f"{name} torch"], out.get(f"{name} onednn", 0.0))
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
    """One scoring method on one K=5 case: tokens, FLOPs, time (median of passes), ratio to the floor (at the higher of
    the GEMM rates measured before and after the passes)."""

    scoring: str
    method: str
    malloc: str  # the engine's allocator: tcmalloc preloaded, or glibc
    coalitions: int
    requests: int  # engine requests (cloze: per option; retries included)
    prompt_tokens: int
    uncached_tokens: int
    gflop: float
    floor_s: float
    seconds: float  # median over the timed passes, prefix cache reset before each, after one untimed pass
    ratio: float  # seconds / floor_s
    answers_equal_to_first: float  # agreement of the chosen options with the first row of the same scoring
    max_prob_diff: float  # largest |option probability difference| against that row
    pass_seconds: tuple[float, ...] = ()  # every timed pass, in order


def _engine_env(malloc: str) -> dict[str, str | None]:
    """Set MECLEAR_CPU_MALLOC for the next engine and drop a tcmalloc an earlier engine of this run preloaded; returns
    what to restore."""
    import os

    saved = {k: os.environ.get(k) for k in ("MECLEAR_CPU_MALLOC", "LD_PRELOAD")}
    os.environ["MECLEAR_CPU_MALLOC"] = malloc
    kept = [lib for lib in os.environ.get("LD_PRELOAD", "").split(":") if lib and "tcmalloc" not in lib]
    if kept:
        os.environ["LD_PRELOAD"] = ":".join(kept)
    else:
        os.environ.pop("LD_PRELOAD", None)
    return saved


def _restore_env(saved: Mapping[str, str | None]) -> None:
    import os

    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def run_floor_case(model: str, locomo: str, conversation: str, top_k: int = 5, passes: int = 3,
                   case_index: int = 0, mallocs: Sequence[str] = ("glibc", "auto"),
                   dtype: str = "auto") -> dict[str, Any]:
    """Answer all 2^K coalitions of one LoCoMo case as one batch, each `passes` times from an empty prefix cache, on one
    vLLM agent (the audit's defaults) per allocator in `mallocs` (MECLEAR_CPU_MALLOC; see
    `pipeline.agents.vllm_agent.cpu_engine_env`): on the first, cloze by the step method (the first method), by
    option requests alone (`prompt`, the method before), with a prefix request per coalition (`prefix`, the audit's
    default) and letter scoring; on the others the last three. Measures the GEMM rate in the same
    process, before and after, in the engine's dtype (`dtype`: the agent's setting)."""
    from statistics import median

    from pipeline.agents import AgentSpec, build_agent, prompts
    from pipeline.agents.models import resolve_model
    from pipeline.agents.vllm_agent import CLOZE_PREFIX, CLOZE_PROMPT, CLOZE_STEPS, engine_jobs
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
    spec = {"model": model, "scoring": "cloze", "dtype": dtype}
    dtype = engine_dtype(spec)
    from pipeline.agents.vllm_agent import on_cpu_platform

    device = "cpu" if on_cpu_platform() else "cuda"  # the engine's own device sets the floor's GEMM rate
    rates = [gemm_rate(model_shapes(model_dir), dtype=dtype, device=device)]
    rows: list[FloorRow] = []
    starts: dict[str, float] = {}
    preloads: dict[str, str] = {}
    firsts: dict[str, list] = {}
    if device != "cpu":
        mallocs = tuple(mallocs)[:1]  # the allocator choice applies to CPU engines only: one engine is enough
    for n, malloc in enumerate(mallocs):
        saved = _engine_env(malloc)
        t = time.perf_counter()
        try:
            agent = build_agent(AgentSpec("vllm", spec))
        finally:
            import os

            preloads[malloc] = os.environ.get("LD_PRELOAD", "")  # what the engine's processes were started with
            _restore_env(saved)
        starts[malloc] = time.perf_counter() - t
        try:
            tokenizer = agent.builder.tokenizer
            variants = [("cloze", CLOZE_STEPS)] if n == 0 else []
            variants += [("cloze", CLOZE_PROMPT), ("cloze", CLOZE_PREFIX), ("letter", "one token")]
            for scoring, method in variants:
                # the same engine, its prompt builder switched: letter scoring lists the options, cloze does not
                agent.builder = prompts.PromptBuilder(tokenizer, agent.config.max_options, cloze=scoring == "cloze")
                agent.cloze_method = method if scoring == "cloze" else CLOZE_PREFIX
                n_requests = len(engine_jobs(agent.builder, agent.config, agent._vllm.SamplingParams, batch, 1,
                                             agent.cloze_method, agent.block_size))
                # one untimed pass first: a methods phase answers case after case on a warm engine, and the first
                # batch of a new shape mix pays one-off costs (oneDNN builds a kernel per new matrix shape)
                agent.reset_prefix_cache()
                agent.answer_batch(batch)
                times, responses, retries = [], [], agent.cloze_retries
                for _ in range(passes):
                    agent.reset_prefix_cache()
                    t = time.perf_counter()
                    responses = agent.answer_batch(batch)
                    times.append(time.perf_counter() - t)
                n_requests += (agent.cloze_retries - retries) // passes
                prompt = sum(r.prompt_tokens or 0 for r in responses)
                uncached = prompt - sum(r.cached_tokens or 0 for r in responses)
                ref = firsts.setdefault(scoring, responses)
                agree = sum(a.answer == b.answer for a, b in zip(responses, ref)) / len(batch)
                diff = max(abs(x - y) for a, b in zip(responses, ref) for x, y in zip(a.option_probs, b.option_probs))
                secs = median(times)
                label = "tcmalloc" if "tcmalloc" in preloads[malloc] else "glibc"
                rows.append(FloorRow(scoring, method, label, len(batch), n_requests, prompt, uncached,
                                     uncached * per_token / 1e9, 0.0, secs, 0.0, agree, diff,
                                     tuple(times)))
        finally:
            agent.close()
    rates.append(gemm_rate(model_shapes(model_dir), dtype=dtype, device=device))
    # The floor at the best rate the machine showed in this run: a rate measured while something else briefly ran
    # (an engine of an earlier run still exiting measured 487 GFLOP/s against 980 after) would lower the bar.
    rate = max(rates[0]["best"], rates[1]["best"])
    for r in rows:
        r.floor_s = floor_seconds(r.uncached_tokens, per_token, rate)
        r.ratio = r.seconds / r.floor_s
    return {"model": model, "conversation": conversation, "query": case.query.query_id, "top_k": top_k,
            "options": list(case.query.options), "passes": passes, "engine_start_s": starts,
            "ld_preload": preloads, "flops_per_token": per_token, "gemm_dtype": dtype, "gemm_device": device,
            "gemm_rate_before": rates[0], "gemm_rate_after": rates[1],
            "rows": [asdict(r) for r in rows]}


def format_floor(report: Mapping[str, Any]) -> str:
    rate = report["gemm_rate_before"]["best"]
    lines = [f"model {report['model']}, {report['conversation']} {report['query']}, K={report['top_k']}: "
             f"{report['flops_per_token'] / 1e9:.3f} GFLOP/token, GEMM rate ({report.get('gemm_dtype', 'float32')}) "
             f"{rate / 1e9:.1f} GFLOP/s before, "
             f"{report['gemm_rate_after']['best'] / 1e9:.1f} after (the floor at the higher); engine start "
             + ", ".join(f"{s:.0f} s ({m})" for m, s in _starts(report).items()),
             "",
             "| scoring | method | malloc | coalitions | requests | prompt tokens | uncached tokens | GFLOP | "
             "floor s | time s | time / floor | answers equal | max prob diff |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        lines.append(f"| {r['scoring']} | {r['method']} | {r.get('malloc', 'glibc')} | {r['coalitions']} | "
                     f"{r['requests']} | {r['prompt_tokens']:,} | "
                     f"{r['uncached_tokens']:,} | {r['gflop']:.1f} | {r['floor_s']:.2f} | {r['seconds']:.2f} | "
                     f"{r['ratio']:.1f}x | {r['answers_equal_to_first']:.0%} | {r['max_prob_diff']:.1e} |")
    return "\n".join(lines)


def _starts(report: Mapping[str, Any]) -> dict[str, float]:
    """Engine start seconds by allocator choice (reports before 2026-12-04 held one number)."""
    s = report["engine_start_s"]
    return dict(s) if isinstance(s, Mapping) else {"glibc": float(s)}
