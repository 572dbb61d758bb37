"""What FI-LoCoMo case building costs on an agent, before and after the wave-batched causal checks (issue 18).

The same cases of one conversation are built three times from one agent, one after the other, one per
`BuildConfig.prefetch`:
- "off" (before): each candidate's causal check asked by `verify` alone (N, then N minus F, then the single
  removals: up to three agent batches per candidate);
- "wave": `prefetch_verify` asking every checkable candidate of a wave in one agent batch per stage (fewest engine
  calls, but it also asks candidates that a case kept earlier in the wave then makes over-full);
- "groups" (after, the default): the same for the candidates the decisions are likely to need (`prefetch_group`).
Each starts from an empty answer cache and, where the agent has one (vLLM), an empty prefix cache. The clean checks
(one batch per block of queries) are the same every way. The cases built must be identical (`identical`); the
decisions are taken candidate by candidate in the same order every way, so a difference is a defect.

Per variant: clean-checked queries, cases, agent requests by phase (build_clean, build_verify: distinct requests the
build cache forwarded), engine calls (the agent's `answer_batch` calls) by phase, prompt and uncached tokens where the
agent reports them, the seconds spent embedding fault records and questions (MiniLM; the same texts both ways), wall
seconds, seconds per clean-checked query, and, given the model's FLOPs per token and a measured GEMM rate
(`benchmarks.floor`), the compute floor of the uncached tokens and the ratio to it.

The pool's own index (BM25, MiniLM embeddings of the conversation) is built once before either variant is timed: it
is the same work both ways and a night's audit has it cached. An untimed warm-up request (the first query with no
memories, a request the build never sends) starts the engine's lazy work before the first timed build.

Module-level imports are the standard library only, so other benchmarks import this freely; `run_builder_bench`
needs vLLM and must run under `if __name__ == "__main__":` (vLLM spawns its engine).
"""

from __future__ import annotations

import os
import time
from collections import Counter
from dataclasses import asdict, dataclass, replace
from typing import Any, Mapping, Sequence

VARIANTS = ("off", "wave", "groups")  # BuildConfig.prefetch, in the order built; the first is "before"


def check_ways(ways: Sequence[str]) -> tuple[str, ...]:
    """The ways to build, "off" (the reference) first; a ValueError names what is allowed."""
    ways = tuple(ways)
    if not ways or ways[0] != "off" or len(set(ways)) != len(ways) or not set(ways) <= set(VARIANTS):
        raise ValueError(f"ways={ways!r}: 'off' first, then distinct ways among {VARIANTS[1:]}")
    return ways


class EngineCounter:
    """Stands between the build cache and the agent: counts `answer_batch` calls (engine calls) by the build phase
    of `owner` (the `CachedAgent` in front of it) and sums the prompt and cached tokens the agent reports."""

    def __init__(self, agent: Any):
        self.agent, self.owner = agent, None
        self.calls: Counter[str] = Counter()
        self.prompt_tokens = self.cached_tokens = 0
        self.uncached: Counter[str] = Counter()  # uncached prompt tokens by phase: where the build's compute goes
        self.tokens_known = True  # False once a response lacks token accounting (the reader has none)

    def fingerprint(self) -> str:
        return self.agent.fingerprint()

    def answer_batch(self, requests: Sequence[Any]) -> list[Any]:
        out = self.agent.answer_batch(requests)
        phase = "build_" + (self.owner.phase if self.owner is not None else "build")
        self.calls[phase] += 1
        for r in out:
            if r.prompt_tokens is None:
                self.tokens_known = False
            else:
                self.prompt_tokens += r.prompt_tokens
                self.cached_tokens += r.cached_tokens or 0
                self.uncached[phase] += r.prompt_tokens - (r.cached_tokens or 0)
        return out

    def close(self) -> None:
        self.agent.close()


class _TimedIndex:
    """A `PoolIndex` whose `embed` (the fault records and questions MiniLM embeds during a build) is timed."""

    def __init__(self, index: Any):
        self.index, self.embed_s = index, 0.0

    def embed(self, texts: Sequence[str]) -> Any:
        t = time.perf_counter()
        try:
            return self.index.embed(texts)
        finally:
            self.embed_s += time.perf_counter() - t

    def __getattr__(self, name: str) -> Any:
        return getattr(self.index, name)


@dataclass
class BuildRow:
    """One build of the conversation: what it asked the agent and what it cost."""

    variant: str  # BuildConfig.prefetch: off (per-candidate checks, "before") | wave | groups ("after")
    checked: int  # clean-checked queries
    clean: int
    cases: int
    requests: dict[str, int]  # distinct requests sent to the agent, by phase (build_clean, build_verify)
    engine_calls: dict[str, int]  # agent.answer_batch calls, by phase
    cache_hits: int
    prompt_tokens: int | None  # None: the agent reports no token accounting
    uncached_tokens: int | None
    uncached_by_phase: dict[str, int] | None  # build_clean, build_verify
    embed_s: float
    seconds: float
    s_per_query: float  # seconds / clean-checked query
    floor_s: float | None  # uncached tokens x FLOPs per token / GEMM rate (None without a model or tokens)
    ratio: float | None  # seconds / floor_s


def case_keys(cases: Sequence[Any]) -> list[tuple]:
    """What identifies a built case: its id, fault ids, frozen context and seed."""
    return [(c.case_id, c.faults, c.case.context.memory_ids, c.case.seed) for c in cases]


def build_once(agent: Any, index: Any, pool: Any, queries: Sequence[Any], config: Any, variant: str,
               per_token_flops: float | None = None,
               rate: float | None = None) -> tuple[BuildRow, list[Any]]:
    """Build `pool`'s cases once with `prefetch=variant`, from an empty answer cache and prefix cache."""
    from pipeline.bench.builder import CachedAgent, build_pool

    if hasattr(agent, "reset_prefix_cache"):
        agent.reset_prefix_cache()
    counter = EngineCounter(agent)
    cached = CachedAgent(counter)
    counter.owner = cached
    timed = _TimedIndex(index)
    t = time.perf_counter()
    res = build_pool(cached, timed, pool, list(queries), replace(config, prefetch=variant))
    seconds = time.perf_counter() - t
    uncached = counter.prompt_tokens - counter.cached_tokens if counter.tokens_known else None
    floor = (uncached * per_token_flops / rate if uncached is not None and per_token_flops and rate else None)
    row = BuildRow(variant, res.checked, res.clean, len(res.cases),
                   {f"build_{k}": v for k, v in sorted(res.agent_calls.items())}, dict(sorted(counter.calls.items())),
                   res.cache_hits, counter.prompt_tokens if counter.tokens_known else None, uncached,
                   dict(sorted(counter.uncached.items())) if counter.tokens_known else None, timed.embed_s, seconds,
                   seconds / max(res.checked, 1), floor, seconds / floor if floor else None)
    return row, res.cases


def compare_builds(agent: Any, index: Any, pool: Any, queries: Sequence[Any], config: Any,
                   per_token_flops: float | None = None, rate: float | None = None,
                   ways: Sequence[str] = VARIANTS) -> dict[str, Any]:
    """Build `pool`'s cases once per way (`ways`: "off" first, then some of "wave", "groups") with one agent; the
    rows, whether the cases are identical every way, and per way the ratios of "off" (before) to it: wall time and
    engine calls."""
    ways = check_ways(ways)
    index.stats(pool.pool_id)  # the pool's BM25 and embeddings: the same work both ways, not timed
    rows, built = [], []
    for variant in ways:
        row, cases = build_once(agent, index, pool, queries, config, variant, per_token_flops, rate)
        rows.append(row)
        built.append(case_keys(cases))
    before = rows[0]
    return {
        "conversation": pool.pool_id, "max_queries": config.max_queries, "top_k": config.top_k,
        "identical": all(b == built[0] for b in built), "case_ids": [k[0] for k in built[0]],
        "ratio_seconds": {r.variant: before.seconds / r.seconds if r.seconds else None for r in rows[1:]},
        "ratio_engine_calls": {r.variant: sum(before.engine_calls.values()) / max(sum(r.engine_calls.values()), 1)
                               for r in rows[1:]},
        "rows": [asdict(r) for r in rows],
    }


def run_builder_bench(model: str, locomo: str, conversation: str, max_queries: int, top_k: int = 5,
                      dense: str = "auto", seed: int = 0, ways: Sequence[str] = VARIANTS,
                      dtype: str = "auto") -> dict[str, Any]:
    """`compare_builds` on one LoCoMo conversation with the vLLM agent (cloze scoring, the audit's defaults), the GEMM
    rate measured with torch before and after in the same process, the floor at the rate measured before. `dtype`: the
    agent's setting (`auto`, or e.g. float32 to see on a bfloat16 CPU what a CPU without it gets)."""
    from benchmarks.floor import engine_dtype, flops_per_token, gemm_rate, model_shapes
    from pipeline.agents import AgentSpec, build_agent
    from pipeline.agents.base import AgentRequest
    from pipeline.agents.models import resolve_model
    from pipeline.bench.builder import eligible_queries
    from pipeline.bench.config import EvalConfig
    from pipeline.bench.reretrieval import PoolIndex
    from pipeline.io.locomo import load_locomo

    ways = check_ways(ways)

    config = EvalConfig(locomo=locomo, conversations=(conversation,), max_queries=max_queries, top_k=top_k,
                        dense=dense, seed=seed, executor="local").build_config
    pools, queries = load_locomo(locomo, conversations=[conversation], seed=seed)
    index = PoolIndex(pools, top_k, dense)
    model_dir = resolve_model(model)
    per_token = flops_per_token(model_dir)
    spec = {"model": model, "scoring": "cloze", "dtype": dtype}
    dtype = engine_dtype(spec)  # the floor in the engine's own dtype (bfloat16 where the CPU has it natively)
    rates = [gemm_rate(model_shapes(model_dir), dtype=dtype)]
    t = time.perf_counter()
    agent = build_agent(AgentSpec("vllm", spec))
    start_s = time.perf_counter() - t
    # the allocator the engine's processes started with (see pipeline.agents.vllm_agent.cpu_engine_env)
    malloc = "tcmalloc" if "tcmalloc" in os.environ.get("LD_PRELOAD", "") else "glibc"
    try:
        first = eligible_queries([q for q in queries if q.pool_id == conversation])[0]
        agent.answer_batch([AgentRequest(first.query_id, first.question, first.options, ())])  # warm-up, untimed
        rep = compare_builds(agent, index, pools[conversation], queries, config, per_token, rates[0]["best"], ways)
    finally:
        agent.close()
    rates.append(gemm_rate(model_shapes(model_dir), dtype=dtype))
    return {"model": model, "scoring": "cloze", "retrieval": index.mode, "engine_start_s": start_s, "malloc": malloc,
            "flops_per_token": per_token, "gemm_dtype": dtype, "gemm_rate_before": rates[0],
            "gemm_rate_after": rates[1], **rep}


LABELS = {"off": " (before: per-candidate checks)", "wave": " (whole wave)", "groups": " (after: groups)"}


def _opt(x: float | None, fmt: str) -> str:
    return "–" if x is None else format(x, fmt)


def _uncached(row: Mapping[str, Any]) -> str:
    """Uncached tokens, with the clean / verify split where the row has it (reports before the split lack it)."""
    split = row.get("uncached_by_phase")
    if not split:
        return _opt(row["uncached_tokens"], ",")
    return f"{row['uncached_tokens']:,} ({split.get('build_clean', 0):,} / {split.get('build_verify', 0):,})"


def format_builder(report: Mapping[str, Any]) -> str:
    """The report as a Markdown table, one row per variant, with a header line and the before/after ratios."""
    head = f"{report.get('model', 'agent')}, {report['conversation']}, first {report['max_queries']} eligible " \
           f"queries, K={report['top_k']}"
    if "gemm_rate_before" in report:
        head += (f": {report['flops_per_token'] / 1e9:.3f} GFLOP/token, GEMM rate "
                 f"({report.get('gemm_dtype', 'float32')}) "
                 f"{report['gemm_rate_before']['best'] / 1e9:.1f} GFLOP/s before, "
                 f"{report['gemm_rate_after']['best'] / 1e9:.1f} after; engine start {report['engine_start_s']:.0f} s, "
                 f"{report.get('malloc', 'glibc')} malloc")
    lines = [head, "",
             "| variant | clean-checked queries | cases | requests clean / verify | engine calls clean / verify | "
             "prompt tokens | uncached tokens (clean / verify) | embed s | wall s | s per clean-checked query | "
             "floor s | wall / floor |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        req, calls = r["requests"], r["engine_calls"]
        lines.append(
            f"| {r['variant']}{LABELS.get(r['variant'], '')} | {r['checked']} | "
            f"{r['cases']} | {req.get('build_clean', 0)} / {req.get('build_verify', 0)} | "
            f"{calls.get('build_clean', 0)} / {calls.get('build_verify', 0)} | {_opt(r['prompt_tokens'], ',')} | "
            f"{_uncached(r)} | {r['embed_s']:.1f} | {r['seconds']:.1f} | "
            f"**{r['s_per_query']:.2f}** | {_opt(r['floor_s'], '.1f')} | "
            f"{'–' if r['ratio'] is None else format(r['ratio'], '.1f') + 'x'} |")
    ratios = ", ".join(f"{v}: wall {_opt(x, '.2f')}x, engine calls {report['ratio_engine_calls'][v]:.2f}x"
                       for v, x in report["ratio_seconds"].items())
    lines += ["", f"off (before) / each: {ratios}; cases identical every way: "
                  f"{'yes' if report['identical'] else 'NO'} ({len(report['case_ids'])} cases)"]
    return "\n".join(lines)
