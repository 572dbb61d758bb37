"""Agent throughput: the Ray audit pipeline against a bare vLLM `LLM.generate` loop over the same batches of prompts.

(a) pipeline: the real driver (`run_audit`: scheduling, streamed Parquet, per-case reductions) over a Ray pool of
    agents (`pipeline.audit.actors.start_agent_pool`) whose actor runs `VLLMAgent`. Every agent call the workers make
    (a batch of coalitions) is recorded.
(b) bare: one in-process `vllm.LLM` built with the agent's own engine arguments (`engine_kwargs`) that runs `generate`
    over exactly the recorded batches with the agent's own SamplingParams (`engine_jobs`), as a user's own loop would:
    each batch's prompts rendered as text (`prompts.build_prompt`) and tokenised by `LLM.generate`, inside the clock.
    The headline ratio is (a)/(b). The same batches pre-tokenised before the clock start ("engine only") give a
    ceiling that no loop which must build its prompts can reach; its ratio is reported beside the headline.

What keeps the comparison honest: the same prompts in the same batches; engine start-up timed apart from the work; one
warm-up batch (the first case) run on each engine and excluded; the prefix cache emptied before every repetition, so
every repetition starts cold; several repetitions, median reported. (a) runs first and its engine is shut down before
(b) starts, since two engines on one small machine would contend for cores (or GPU memory).

It also reports what the prompt layout is worth: prompt tokens and uncached (computed) prompt tokens per case for the
canonical layout (question before memories, `prompts.build_prompt`) and for a memories-first layout
(`prompts.build_memories_first_prompt`), both measured on the bare engine from an empty cache.
"""

from __future__ import annotations

import logging
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

from pipeline.agents import prompts
from pipeline.agents.base import AgentRequest
from pipeline.audit.cases import Case
from pipeline.audit.driver import run_audit
from pipeline.audit.run import AuditConfig, InputSpec
from pipeline.audit.worker import CasesDone, WorkItem
from pipeline.core.errors import AgentError, ConfigError
from pipeline.core.provenance import versions
from pipeline.core.validation import check
from pipeline.exec.pools import WorkerPool
from pipeline.io.records import Pool, Query

log = logging.getLogger(__name__)

TINY_MODEL = "tiny"  # `model` value that builds the offline tiny random-weight Llama (pipeline.testing.tiny_llama)
TARGET_RATIO = 0.8  # pipeline coalitions/s over bare-engine coalitions/s that the pipeline must reach


@dataclass(frozen=True)
class AgentBenchConfig:
    """What to benchmark. `agent_options` are VLLMConfig keys (engine settings) shared by both sides."""

    model: str = TINY_MODEL
    agent_options: dict = field(default_factory=dict)
    locomo: str | None = None
    conversations: tuple[str, ...] = ()
    max_queries: int = 0  # 0: all
    top_k: int = AuditConfig.top_k
    permutations: int = AuditConfig.permutations
    batch_size: int = 256  # coalitions per actor task, as in `meclear audit --batch-size`
    repetitions: int = 3
    gpus_per_actor: float = 0.0
    seed: int = 0
    cache_dir: str = str(Path(tempfile.gettempdir()) / "meclear-test-cache")  # tiny model and compile caches

    def __post_init__(self) -> None:
        w = "agent benchmark"
        for name, low in (("repetitions", 1), ("max_queries", 0), ("batch_size", 1)):
            value = getattr(self, name)
            check(isinstance(value, int) and value >= low, w, f"{name}={value!r}; must be an integer >= {low}")
        check("model" not in self.agent_options, w, "give the model as `model`, not as an agent option")


def engine_options(config: AgentBenchConfig, model_path: str) -> dict:
    """VLLMConfig keys of both sides. The tiny model runs in float32 with its whole 2048-token context unless told
    otherwise (its small tokenizer spends many tokens on LoCoMo turns)."""
    defaults: dict[str, Any] = {"dtype": "float32", "max_model_len": 2048} if config.model == TINY_MODEL else {}
    return {**defaults, **config.agent_options, "model": model_path}


def set_engine_env(cache_dir: str | Path, private_tmp: str | Path) -> None:
    """Default the environment vLLM, Ray and torch.compile read, before Ray starts (its workers inherit it).

    Values already set win. VLLM_RPC_BASE_PATH is private so engines of other sessions on this machine never share
    IPC socket paths; the compile caches persist in `cache_dir` so a warm rerun skips torch.compile.
    """
    cache_dir = Path(cache_dir)
    defaults = {
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache on CPU (ignored on GPU)
        "VLLM_NO_USAGE_STATS": "1",
        "HF_HUB_OFFLINE": "1",
        "TORCHINDUCTOR_CACHE_DIR": str(cache_dir / "inductor"),
        "VLLM_CACHE_ROOT": str(cache_dir / "vllm"),
        "VLLM_RPC_BASE_PATH": str(private_tmp),
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_AUTH_MODE": "disabled",
    }
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]).mkdir(parents=True, exist_ok=True)


# -- measurements --------------------------------------------------------------------------------------------------


@dataclass
class SideResult:
    """One side's figures. Token counts are those of the first repetition (every repetition starts cold)."""

    name: str
    startup_s: float
    coalitions: int  # per repetition
    times_s: list[float]
    prompt_tokens: int
    cached_tokens: int
    cases: int

    @property
    def coalitions_per_s(self) -> float:
        return self.coalitions / statistics.median(self.times_s)

    @property
    def best_coalitions_per_s(self) -> float:
        """From the fastest repetition: on a shared machine, the least disturbed one (as `timeit` reports)."""
        return self.coalitions / min(self.times_s)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def summary(self) -> dict:
        return {**asdict(self), "median_s": statistics.median(self.times_s), "coalitions_per_s": self.coalitions_per_s,
                "best_coalitions_per_s": self.best_coalitions_per_s, "prefix_hit_rate": self.hit_rate,
                "prompt_tokens_per_case": self.prompt_tokens / self.cases,
                "uncached_tokens_per_case": (self.prompt_tokens - self.cached_tokens) / self.cases}


class RecordingPool:
    """Delegates to the driver's pool and keeps every agent call the workers make (`CasesDone.calls`: each task's
    first passes in one call, then its later passes), as batches of WorkItems the bare loop can replay."""

    def __init__(self, inner: WorkerPool):
        self.inner = inner
        self.n_workers, self.max_inflight = inner.n_workers, inner.max_inflight
        self.batches: list[list[WorkItem]] = []
        self._cases: dict[int, Case] = {}  # cases of the tasks in flight, by case index

    def submit(self, worker: int, method: str, *args: Any) -> None:
        if method == "run_cases":
            self._cases.update((t.case_index, t.case) for t in args[0])
        self.inner.submit(worker, method, *args)

    def next_done(self) -> tuple[int, Any]:
        worker, result = self.inner.next_done()
        if isinstance(result, CasesDone):
            for call in result.calls:
                self.batches.append([WorkItem(ci, self._cases[ci], masks, stage) for ci, masks, stage in call])
            for ci in (*result.finished, *result.failed):
                self._cases.pop(ci, None)
        return worker, result

    def call_all(self, method: str, *args: Any) -> list:
        return self.inner.call_all(method, *args)

    def map(self, method: str, items: Sequence[Any], pins: Sequence[int | None] | None = None):
        return self.inner.map(method, items, pins)

    def close(self) -> None:
        self.inner.close()


def batch_requests(batch: Sequence[WorkItem]) -> list[AgentRequest]:
    """The agent requests of one recorded batch, in the order `evaluate_items` sends them."""
    return [it.case.request(int(m)) for it in batch for m in it.masks]


@dataclass
class PipelineRun:
    side: SideResult
    warmup: list[WorkItem]
    batches: list[list[WorkItem]]
    evaluations_per_case: dict[str, float]
    total_s: list[float]  # run_audit's whole wall time per repetition (retrieval and final writes included)


def _reset_prefix_caches(pool: WorkerPool) -> None:
    if not all(pool.call_all("reset_prefix_cache")):
        raise AgentError("agent benchmark: an engine refused to reset its prefix cache (requests still running?)")


def run_pipeline(pools: dict[str, Pool], queries: list[Query], audit_config: AuditConfig, repetitions: int,
                 workdir: Path) -> PipelineRun:
    """(a): warm-up on the first query, then `repetitions` cold audits of every query through the real driver."""
    import polars as pl

    from pipeline.audit.actors import start_agent_pool

    t = time.perf_counter()
    agents, fingerprint = start_agent_pool(audit_config.agent_spec, audit_config.actors, audit_config.cpus_per_actor,
                                           audit_config.gpus_per_actor)
    startup = time.perf_counter() - t
    recorder = RecordingPool(agents)
    try:
        run_audit(pools, queries[:1], audit_config, workdir / "warmup", recorder, fingerprint, progress=False)
        warmup = recorder.batches[0]
        times, totals, evaluated = [], [], 0
        for rep in range(repetitions):
            _reset_prefix_caches(agents)
            recorder.batches = []
            res = run_audit(pools, queries, audit_config, workdir / f"rep{rep}", recorder, fingerprint, progress=False)
            times.append(res.timings["evaluate_s"])
            totals.append(res.timings["total_s"])
            if rep == 0:
                batches, evaluated = recorder.batches, res.evaluated
            elif res.evaluated != evaluated:
                raise AgentError(f"agent benchmark: repetition {rep} evaluated {res.evaluated} coalitions, "
                                 f"repetition 0 {evaluated}")
    finally:
        recorder.close()
    util = pl.read_parquet(workdir / "rep0" / "utilities" / "*.parquet")
    clear = pl.read_parquet(workdir / "rep0" / "clearances" / "*.parquet")
    side = SideResult("pipeline", startup, evaluated, times, int(util["prompt_tokens"].sum()),
                      int(util["cached_tokens"].sum()), clear.height)
    evals = {"mean": float(clear["evaluations"].mean()), "max": float(clear["evaluations"].max())}
    return PipelineRun(side, warmup, batches, evals, totals)


@dataclass
class BareRun:
    side: SideResult  # the plain user loop: render each batch's prompts as text, LLM.generate tokenises them
    shuffled: SideResult  # memories-first layout, same engine, same batches
    engine_only: SideResult  # prompts rendered and tokenised before the clock starts: the engine alone


def _layout_ids(builder: prompts.PromptBuilder, requests: Sequence[AgentRequest]) -> list[list[int]]:
    return [builder.encode(prompts.build_memories_first_prompt(builder.format, builder.tokenizer, r.question,
                                                               r.options, r.memories)) for r in requests]


def run_bare(engine_config: Any, warmup: Sequence[WorkItem], batches: Sequence[Sequence[WorkItem]],
             repetitions: int) -> BareRun:
    """(b): one in-process engine; the recorded batches through `LLM.generate`, canonical then memories-first."""
    import vllm

    from pipeline.agents.llm_config import resolved_scoring
    from pipeline.agents.models import model_identity
    from pipeline.agents.vllm_agent import (
        cpu_engine_env,
        engine_block_size,
        engine_jobs,
        engine_kwargs,
        on_cpu_platform,
    )

    t = time.perf_counter()
    on_cpu = on_cpu_platform()
    kwargs = engine_kwargs(engine_config, on_cpu=on_cpu)
    if on_cpu:  # the agent's own engine environment (thread binding), so both sides run the same engine
        os.environ.update(cpu_engine_env())
    llm = vllm.LLM(**kwargs)
    startup = time.perf_counter() - t
    try:
        # the agent's own scoring: cloze sends several step requests per coalition (see pipeline.agents.vllm_agent)
        cloze = resolved_scoring(engine_config.scoring, model_identity(kwargs["model"])) == "cloze"
        builder = prompts.PromptBuilder(llm.get_tokenizer(), engine_config.max_options, cloze=cloze)
        block = engine_block_size(llm, engine_config)  # for the agent's cloze prefix requests
        cases = len({it.case_index for b in batches for it in b})

        def prepare(batch: Sequence[WorkItem], shuffled: bool) -> tuple[list[Any], list[Any]]:
            requests = batch_requests(batch)
            jobs = engine_jobs(builder, engine_config, vllm.SamplingParams, requests, call_index=1, block=block)
            if not all(r.options for r in requests):
                raise ConfigError("agent benchmark: open-answer queries are not supported (use multiple choice)")
            # Under cloze the memories-first variant is not built (its step requests would need their own layout):
            # it repeats the canonical one.
            ids = _layout_ids(builder, requests) if shuffled and not cloze else [row for _, row, _ in jobs]
            return [vllm.TokensPrompt(prompt_token_ids=row) for row in ids], [p for _, _, p in jobs]

        def run(prepared: list[tuple[Any, list[Any]]], render: bool = False) -> tuple[float, int, int]:
            """Time the batches through LLM.generate. With `render`, each batch's prompts are rendered as text inside
            the timed loop and tokenised by LLM.generate itself, as a user's own loop over the batches would."""
            if not llm.reset_prefix_cache():  # noqa: F821 (bound above; flagged only for the `del llm` below)
                raise AgentError("agent benchmark: the bare engine refused to reset its prefix cache")
            prompt = cached = 0
            t0 = time.perf_counter()
            for rows, params in prepared:
                if render:
                    rows = [prompts.build_prompt(builder.format, builder.tokenizer, r.question, r.options, r.memories)
                            for r in rows]
                for out in llm.generate(rows, params, use_tqdm=False):  # noqa: F821 (as above: the `del llm`)
                    prompt += len(out.prompt_token_ids)
                    cached += int(out.num_cached_tokens or 0)
            return time.perf_counter() - t0, prompt, cached

        run([prepare(warmup, shuffled=False)])
        canonical = [prepare(b, shuffled=False) for b in batches]
        shuffled = [prepare(b, shuffled=True) for b in batches]
        # Under cloze the bare loop sends token ids (the step requests extend the prompt's ids, not its text).
        text = canonical if cloze else [(batch_requests(b), params) for b, (_, params) in zip(batches, canonical)]
        n = sum(len(batch_requests(b)) for b in batches)  # coalitions, not engine requests
        times: dict[str, list[float]] = {"text": [], "canonical": [], "shuffled": []}
        tokens: dict[str, tuple[int, int]] = {}
        for _ in range(repetitions):  # interleaved, so drift in machine load hits every variant alike
            for name, prepared in (("text", text), ("canonical", canonical), ("shuffled", shuffled)):
                secs, prompt, cached = run(prepared, render=name == "text" and not cloze)  # cloze: token ids, see above
                times[name].append(secs)
                tokens.setdefault(name, (prompt, cached))
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
    side = SideResult("bare", startup, n, times["text"], *tokens["text"], cases)
    other = SideResult("bare_memories_first", 0.0, n, times["shuffled"], *tokens["shuffled"], cases)
    engine_only = SideResult("bare_engine_only", 0.0, n, times["canonical"], *tokens["canonical"], cases)
    return BareRun(side, other, engine_only)


def _wait_for_gpu_release(fraction: float, timeout_s: float = 120.0) -> None:
    """After the pipeline's actor is killed, wait until its GPU memory is back before the bare engine claims it."""
    try:
        import torch
    except ImportError:
        return
    if not torch.cuda.is_available():
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        free, total = torch.cuda.mem_get_info()
        if free / total >= fraction:
            return
        time.sleep(2.0)
    log.warning("GPU memory not released after %.0fs; the bare engine may fail to start", timeout_s)


# -- the whole benchmark -------------------------------------------------------------------------------------------


def run_benchmark(config: AgentBenchConfig, progress: bool = True) -> dict:
    """Run (a) then (b) and return the report (plain data, written as JSON by the job)."""
    from pipeline.agents.vllm_agent import VLLMConfig
    from pipeline.exec.ray_pool import cluster_session

    private_tmp = Path(tempfile.mkdtemp(prefix="meclear-bench-", dir="/tmp"))  # short: socket paths have a length limit
    set_engine_env(config.cache_dir, private_tmp)
    try:
        from pipeline.agents.models import resolve_model

        model_path = resolve_model(config.model)  # smollm2-135m-instruct / PATH.gguf: converted once, here
        if config.model == TINY_MODEL:
            from pipeline.testing.tiny_llama import build_tiny_llama

            model_path = str(build_tiny_llama(Path(config.cache_dir) / "tiny_llama-seed0", seed=0))
        options = engine_options(config, model_path)
        engine_config = VLLMConfig.from_mapping(options)  # validates the options before anything starts
        inputs = InputSpec(locomo=config.locomo, conversations=config.conversations, max_queries=config.max_queries)
        pools, queries, _files = inputs.load()
        audit_config = AuditConfig(top_k=config.top_k, permutations=config.permutations, seed=config.seed,
                                   dense="off", agent="vllm", agent_options=options, executor="ray", actors=1,
                                   gpus_per_actor=config.gpus_per_actor, batch_size=config.batch_size)
        log.info("agent benchmark: %d queries, model %s", len(queries), model_path)

        with cluster_session(temp_dir=str(private_tmp / "ray")):
            pipe = run_pipeline(pools, queries, audit_config, config.repetitions, private_tmp / "audit")
        _wait_for_gpu_release(engine_config.gpu_memory_utilization)
        bare = run_bare(engine_config, pipe.warmup, pipe.batches, config.repetitions)
    finally:
        shutil.rmtree(private_tmp, ignore_errors=True)
    return build_report(config, options, len(queries), pipe, bare)


def build_report(config: AgentBenchConfig, options: dict, queries: int, pipe: PipelineRun, bare: BareRun) -> dict:
    a, b, s = pipe.side, bare.side, bare.shuffled
    batch_sizes = [sum(len(it.masks) for it in batch) for batch in pipe.batches]
    return {
        "config": {**asdict(config), "engine": options},
        "versions": versions(),
        "queries": queries,
        "batches": {"count": len(batch_sizes), "sizes": sorted(set(batch_sizes))},
        "throughput_ratio": a.coalitions_per_s / b.coalitions_per_s,  # of the medians
        "throughput_ratio_best": a.best_coalitions_per_s / b.best_coalitions_per_s,
        # against the engine fed pre-tokenised prompts (prompt building excluded from its clock): a ceiling, not a loop
        "throughput_ratio_engine_only": a.coalitions_per_s / bare.engine_only.coalitions_per_s,
        "target_ratio": TARGET_RATIO,
        "pipeline": {**a.summary(), "audit_total_s": pipe.total_s},
        "bare": b.summary(),
        "bare_memories_first": s.summary(),
        "bare_engine_only": bare.engine_only.summary(),
        "evaluations_per_case": pipe.evaluations_per_case,
        "layouts": {
            "canonical": {"prompt_tokens_per_case": b.prompt_tokens / b.cases,
                          "uncached_tokens_per_case": (b.prompt_tokens - b.cached_tokens) / b.cases,
                          "prefix_hit_rate": b.hit_rate},
            "memories_first": {"prompt_tokens_per_case": s.prompt_tokens / s.cases,
                               "uncached_tokens_per_case": (s.prompt_tokens - s.cached_tokens) / s.cases,
                               "prefix_hit_rate": s.hit_rate},
        },
    }


def format_report(report: dict) -> str:
    """A plain-text table of the headline figures."""
    p, b, s = report["pipeline"], report["bare"], report["bare_memories_first"]
    sides = (p, b, s)  # the layout figures of the bare sides are the same numbers as their side summaries

    def row(label: str, key: str, fmt: str) -> tuple[str, ...]:
        return (label, *(format(side[key], fmt) for side in sides))

    rows = [
        ("", "pipeline (Ray)", "bare LLM.generate loop", "bare, memories first"),
        ("engine start-up s", f"{p['startup_s']:.1f}", f"{b['startup_s']:.1f}", "(same engine)"),
        row("coalitions / repetition", "coalitions", "d"),
        row("median s / repetition", "median_s", ".2f"),
        row("coalitions / s (median)", "coalitions_per_s", ".1f"),
        row("coalitions / s (best)", "best_coalitions_per_s", ".1f"),
        row("prefix-cache hit rate", "prefix_hit_rate", ".1%"),
        row("prompt tokens / case", "prompt_tokens_per_case", ".0f"),
        row("uncached tokens / case", "uncached_tokens_per_case", ".0f"),
    ]
    widths = [max(len(str(r[i])) for r in rows) for i in range(4)]
    lines = ["  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in rows]
    ev = report["evaluations_per_case"]
    ratio = report["throughput_ratio"]
    verdict = "meets" if ratio >= report["target_ratio"] else "BELOW"
    lines += [
        "",
        f"throughput ratio pipeline / bare: {ratio:.2f} of medians ({verdict} the {report['target_ratio']} target), "
        f"{report['throughput_ratio_best']:.2f} of best repetitions; "
        f"{report['throughput_ratio_engine_only']:.2f} against the engine alone on pre-tokenised prompts "
        f"({report['bare_engine_only']['coalitions_per_s']:.1f} coalitions/s)",
        f"agent evaluations per case: mean {ev['mean']:.1f}, max {ev['max']:.0f}; "
        f"{report['queries']} queries, {report['batches']['count']} batches of {report['batches']['sizes']} coalitions",
    ]
    return "\n".join(lines)
