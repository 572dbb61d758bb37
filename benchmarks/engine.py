"""vLLM engine settings on CPU, measured: start-up time and coalitions per second per variant of the engine defaults.

Each variant runs in a fresh process (a cold start, as a user's run gets) with its own agent options and environment:
the agent is built as the audit builds it (`build_agent`), then the first `cases` cases of the sample pool (K=5, all
2^K coalitions each, one `answer_batch` per case, the way the driver sends them) are answered twice; the first pass
fills the prefix cache, the second is timed warm. Reported per variant: engine start (s), first-pass and warm
coalitions/s, prompt tokens and the share read from the prefix cache, and the answers' agreement with the first
variant (a dtype change can flip near-ties).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the repository (benchmarks/ is not installed with the package)

# name -> (agent options, environment). `default` is what `--agent vllm` runs with no options on a CPU machine.
VARIANTS: dict[str, tuple[dict, dict]] = {
    "default": ({}, {}),
    "eager": ({"enforce_eager": True}, {}),
    "eager-float32": ({"enforce_eager": True, "dtype": "float32"}, {}),
    "float32": ({"dtype": "float32"}, {}),
    "float32-bind-all": ({"dtype": "float32"}, {"VLLM_CPU_OMP_THREADS_BIND": "ALL"}),
    "eager-float32-bind-all": ({"enforce_eager": True, "dtype": "float32"}, {"VLLM_CPU_OMP_THREADS_BIND": "ALL"}),
    "eager-float32-block-128": ({"enforce_eager": True, "dtype": "float32", "block_size": 128}, {}),
}


@dataclass
class VariantResult:
    name: str
    options: dict
    env: dict
    start_s: float
    first_cps: float  # coalitions/s, prefix cache cold
    warm_cps: float  # coalitions/s, second pass over the same cases
    coalitions: int
    prompt_tokens: int
    cached_share: float  # of the first pass's prompt tokens
    answers: list[str] = field(default_factory=list)


def _all_cpus() -> str:
    return f"0-{(os.cpu_count() or 1) - 1}"


def run_variant(name: str, model: str, cases: int, top_k: int) -> VariantResult:
    """In this process: build the agent with the variant's options, answer `cases` cases twice."""
    from pipeline.agents import AgentSpec, build_agent
    from pipeline.audit.cases import make_cases
    from pipeline.audit.run import InputSpec
    from pipeline.retrieval.frozen import Retriever

    options, env = VARIANTS[name]
    pools, queries, _ = InputSpec().load()
    queries = [q for q in queries if q.options][:cases]
    contexts = Retriever(pools, top_k, "off").freeze_all(queries)
    batches = [[case.request(mask) for mask in range(1 << case.k)]
               for case in make_cases(queries, contexts, seed=0)]
    t = time.perf_counter()
    agent = build_agent(AgentSpec("vllm", {"model": model, **options}))
    start = time.perf_counter() - t
    try:
        passes = []
        for _ in range(2):
            t = time.perf_counter()
            responses = [r for batch in batches for r in agent.answer_batch(batch)]
            passes.append((time.perf_counter() - t, responses))
    finally:
        agent.close()
    n = sum(len(b) for b in batches)
    first = passes[0][1]
    prompt = sum(r.prompt_tokens or 0 for r in first)
    cached = sum(r.cached_tokens or 0 for r in first)
    return VariantResult(name, options, env, start, n / passes[0][0], n / passes[1][0], n, prompt,
                         cached / prompt if prompt else 0.0, [r.answer for r in first])


def run_all(names: list[str], model: str, cases: int, top_k: int, timeout_s: float = 1800) -> list[VariantResult]:
    """Each variant in a fresh interpreter (vLLM spawns its engine; a cold start per variant)."""
    results = []
    for name in names:
        _, env = VARIANTS[name]
        env = {k: (_all_cpus() if v == "ALL" else v) for k, v in env.items()}
        # the child imports this module from the same checkout: the repository root first on its path
        code = (f"import json, sys; sys.path.insert(0, {str(ROOT)!r}); from dataclasses import asdict; "
                "from benchmarks.engine import run_variant; "
                f"print('RESULT ' + json.dumps(asdict(run_variant({name!r}, {model!r}, {cases}, {top_k}))))")
        done = subprocess.run([sys.executable, "-c", code], env=os.environ | env, capture_output=True, text=True,
                              timeout=timeout_s)
        line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if done.returncode != 0 or line is None:
            raise RuntimeError(f"variant {name!r} failed (rc {done.returncode}):\n{done.stderr[-3000:]}")
        res = VariantResult(**json.loads(line[len("RESULT "):]))
        res.env = env
        results.append(res)
        print(f"  {name}: start {res.start_s:.0f} s, warm {res.warm_cps:.2f} coalitions/s", file=sys.stderr, flush=True)
    return results


def format_table(results: list[VariantResult]) -> str:
    ref = results[0]
    rows = ["| variant | options / env | engine start s | coalitions/s (cold cache) | coalitions/s (warm) | "
            "warm vs first | prompt tokens | from prefix cache | answers equal to first |",
            "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        agree = sum(a == b for a, b in zip(r.answers, ref.answers)) / max(len(ref.answers), 1)
        what = ", ".join([f"{k}={v}" for k, v in r.options.items()] + [f"{k}={v}" for k, v in r.env.items()]) or "—"
        rows.append(f"| {r.name} | {what} | {r.start_s:.0f} | {r.first_cps:.2f} | {r.warm_cps:.2f} | "
                    f"{r.warm_cps / ref.warm_cps:.2f} | {r.prompt_tokens:,} | {r.cached_share:.1%} | {agree:.1%} |")
    return "\n".join(rows)


def report(results: list[VariantResult]) -> dict:
    return {"variants": [asdict(r) for r in results]}
