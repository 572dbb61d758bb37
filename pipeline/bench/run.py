"""FI-LoCoMo orchestration: validate, build cases per conversation, run the methods on every case, write the outputs.

The work runs on `BenchWorker`s, each of which builds its agent and retrieval index once. With executor "local" one
worker runs in this process; with "ray" a pool of Ray actors does, fed with whole conversations (case building: a
conversation's pool is indexed and embedded once) and then with chunks of cases (methods). Results do not depend on
the executor or the sharding: every case is seeded by its own ids.

max_cases caps the kept cases per mechanism over the whole run, taken in file order (conversation, then query):
each conversation stops trying a mechanism once it has max_cases of them, and the driver keeps the first max_cases.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

from pipeline.agents import build_agent, checked_spec
from pipeline.bench.builder import (
    BenchCase,
    BuildResult,
    CachedAgent,
    MechanismCount,
    build_pool,
    cap_cases,
)
from pipeline.bench.config import EvalConfig
from pipeline.bench.methods import run_case
from pipeline.core.errors import ConfigError
from pipeline.core.provenance import sha256_file
from pipeline.core.validation import fingerprint
from pipeline.exec.pools import LocalPool, WorkerPool

log = logging.getLogger(__name__)

CHUNK = 16  # cases per Ray task in the methods phase


class BenchWorker:
    """Builds its agent once and its retrieval index lazily; builds cases of conversations and runs methods on cases."""

    def __init__(self, config: EvalConfig, progress: bool = False):
        self.config = config
        self.progress = progress  # progress lines within a conversation's build
        self.agent = build_agent(config.agent_spec)
        self._data = None
        self._index = None

    def fingerprint(self) -> str:
        return self.agent.fingerprint()

    def _load(self):
        if self._data is None:
            from pipeline.bench.reretrieval import PoolIndex
            from pipeline.io.locomo import load_locomo

            pools, queries = load_locomo(self.config.locomo, conversations=list(self.config.conversations) or None,
                                         seed=self.config.seed)
            self._data = (pools, queries)
            self._index = PoolIndex(pools, self.config.top_k, self.config.dense)
        return self._data, self._index

    def retrieval_mode(self) -> str:
        if self._index is not None:
            return self._index.mode
        from pipeline.retrieval.frozen import retrieval_mode, use_dense

        return retrieval_mode(use_dense(self.config.dense))

    def build(self, conversation: str) -> tuple[str, BuildResult, float]:
        (pools, queries), index = self._load()
        t = time.perf_counter()
        res = build_pool(CachedAgent(self.agent), index, pools[conversation], queries, self.config.build_config,
                         progress=self.progress)
        return conversation, res, time.perf_counter() - t

    def run(self, cases: list[BenchCase]) -> tuple[list[tuple[BenchCase, list | None]], dict[str, int]]:
        """Every method on each case ([(case, outcomes)], outcomes None for an excluded case) and the agent requests
        this chunk sent, by phase ('methods', 'methods_filter'). No cache: the methods phase re-asks the agent."""
        c = self.config
        counted = CachedAgent(self.agent, cache=False, phase="methods")
        out = [(bc, run_case(bc, counted, c.methods, c.utility, c.method_config)) for bc in cases]
        return out, dict(counted.calls)

    def close(self) -> None:
        self.agent.close()


@dataclass
class EvalResult:
    config: EvalConfig
    cases: list[BenchCase]
    outcomes: list[tuple[BenchCase, list]]
    counts: dict[str, MechanismCount]
    queries: dict[str, int]  # eligible, checked, clean
    agent_fingerprint: str
    retrieval: str
    timings: dict[str, float]
    excluded: dict[str, int] = field(default_factory=dict)  # per mechanism: full context answered right at method time
    agent_calls: dict[str, int] = field(default_factory=dict)  # agent requests by phase
    cache_hits: int = 0  # build requests answered from the build cache
    conversations_run: int = 0


@contextmanager
def _threads_held(threads: int | None) -> Iterator[None]:
    """Torch and the BLAS/OpenMP pools of this process held to `threads` threads (None: left as they are, for LLM
    agents whose inference wants every core); undone on exit.

    Why: on the 2-vCPU machines this was measured on, MiniLM with 2 torch threads was no faster than with 1, and its
    OpenMP workers spin between calls, slowing the Python work in between (BM25, checks, sklearn) more than twofold:
    building conv-30 took 36 s with the default pools and 15.5 s with one thread.
    """
    limits = torch_threads = None
    if threads is not None:
        try:  # threadpoolctl comes with scikit-learn (the `eval` extra)
            from threadpoolctl import threadpool_limits

            limits = threadpool_limits(threads)
        except ImportError:
            pass
        try:
            import torch

            torch_threads = torch.get_num_threads()
            torch.set_num_threads(threads)
        except ImportError:
            pass
    try:
        yield
    finally:
        if limits is not None:
            limits.restore_original_limits()
        if torch_threads is not None:
            import torch

            torch.set_num_threads(torch_threads)


@contextmanager
def _workers(config: EvalConfig, progress: bool) -> Iterator[WorkerPool]:
    """The benchmark's BenchWorkers: one in this process (executor 'local', its threads held, see `_threads_held`),
    or a pool of Ray actors (starting or joining Ray); closed, and Ray stopped if this started it, on exit."""
    if config.executor == "local":
        with _threads_held(1 if config.agent == "reader" else None):  # LLMs keep their threads
            pool = LocalPool(BenchWorker(config, progress))
            try:
                yield pool
            finally:
                pool.close()
        return
    import dataclasses

    from pipeline.audit.actors import plan_pool_gpus, pool_size
    from pipeline.exec.ray_pool import RayPool, cluster_session

    with cluster_session():
        plan = plan_pool_gpus(config.agent_spec, config.actors, 1.0, config.gpus_per_actor)  # issue 20
        config = dataclasses.replace(config, agent_options=plan.agent_options, gpus_per_actor=plan.gpus_per_actor)
        pool = RayPool(BenchWorker, (config, progress),
                       pool_size(config.agent, config.actors, 1.0, config.gpus_per_actor),
                       gpus_per_actor=config.gpus_per_actor)
        try:
            yield pool
        finally:
            pool.close()


def _agreed(pool: WorkerPool, method: str):
    """`method()` of the workers, which must all give the same value."""
    values = pool.call_all(method)
    if len(set(values)) != 1:
        raise ConfigError(f"ray executor: actors disagree on {method}: {sorted(set(values))}")
    return values[0]


def run_benchmark(config: EvalConfig, conversations: list[str], progress: bool = True) -> EvalResult:
    """Build the cases of `conversations` and run every method on them (no output written here)."""
    from pipeline.core.progress import progress_bar

    t0 = time.perf_counter()
    timings: dict[str, float] = {}
    checked_spec(config.agent, config.agent_options)  # one line in the driver, not a traceback from a worker
    with _workers(config, progress) as pool:
        fp = _agreed(pool, "fingerprint")
        timings["startup_s"] = time.perf_counter() - t0

        t = time.perf_counter()
        built: dict[str, BuildResult] = {}
        bar = progress_bar(len(conversations), "building cases", "conv", enabled=progress)
        for conv, res, _secs in pool.map("build", conversations):
            built[conv] = res
            bar.update(1)
        bar.close()
        cases = cap_cases([c for conv in conversations for c in built[conv].cases], config.max_cases)
        timings["build_s"] = time.perf_counter() - t

        t = time.perf_counter()
        chunks = [cases[i : i + CHUNK] for i in range(0, len(cases), CHUNK)]
        outcomes: list[tuple[BenchCase, list]] = []
        labels = [label for label, _, _ in config.build_config.variants]
        excluded = dict.fromkeys(labels, 0)
        calls: dict[str, int] = {}
        bar = progress_bar(len(cases), "running methods", "case", enabled=progress)
        for part, part_calls in pool.map("run", chunks):
            for bc, outs in part:
                if outs is None:
                    excluded[bc.variant] += 1
                else:
                    outcomes.append((bc, outs))
            for k, v in part_calls.items():
                calls[k] = calls.get(k, 0) + v
            bar.update(len(part))
        bar.close()
        timings["methods_s"] = time.perf_counter() - t
        retrieval = _agreed(pool, "retrieval_mode")
    counts = {m: MechanismCount() for m in labels}
    for r in built.values():
        for m, c in r.counts.items():
            for f in ("tried", "verified", "candidates", "not_retrieved", "check_failed", "position_skipped"):
                setattr(counts[m], f, getattr(counts[m], f) + getattr(c, f))
    build_calls: dict[str, int] = {}
    for r in built.values():
        for k, v in r.agent_calls.items():
            build_calls[f"build_{k}"] = build_calls.get(f"build_{k}", 0) + v
    order = {c.case_id: i for i, c in enumerate(cases)}
    outcomes.sort(key=lambda o: order[o[0].case_id])
    queries = {"eligible": sum(r.eligible for r in built.values()), "checked": sum(r.checked for r in built.values()),
               "clean": sum(r.clean for r in built.values())}
    timings["benchmark_s"] = time.perf_counter() - t0
    return EvalResult(config, cases, outcomes, counts, queries, fp, retrieval, timings, excluded,
                      {**build_calls, **calls}, sum(r.cache_hits for r in built.values()), len(conversations))


def run_id(config: EvalConfig, source_sha256: str, agent_fp: str) -> str:
    return fingerprint({"config": asdict(config), "source": source_sha256, "agent": agent_fp})


def evaluate(config: EvalConfig, out: str | Path, progress: bool = True) -> dict:
    """Validate inputs, run the benchmark, write cases.parquet, summary.json, summary.md and figure.png to `out`.

    Nothing is written until the inputs have been read and checked; every file is written atomically.
    Returns the summary (as written to summary.json).
    """
    from pipeline.bench import report
    from pipeline.core.extras import require_eval
    from pipeline.io.locomo import load_locomo
    from pipeline.store.outdir import check_eval_out

    require_eval(config.methods)  # before any work: a missing extra must not surface after the whole benchmark
    t0 = time.perf_counter()
    out = Path(out)
    check_eval_out(out, [config.locomo])  # the output-safety rule shared by every command (pipeline.store.outdir)
    source_sha = sha256_file(config.locomo) if Path(config.locomo).is_file() else ""
    pools, _ = load_locomo(config.locomo, conversations=list(config.conversations) or None)  # raises InputError
    conversations = list(pools)
    result = run_benchmark(config, conversations, progress)
    rid = run_id(config, source_sha, result.agent_fingerprint)
    t = time.perf_counter()
    rows = report.case_rows(result, rid)
    summary = report.summarize(result, rows, rid, source_sha)
    result.timings["report_s"] = time.perf_counter() - t
    result.timings["total_s"] = time.perf_counter() - t0
    summary["timings"] = dict(result.timings)
    report.write_outputs(out, rows, summary)
    if sha256_file(config.locomo) != source_sha:  # the benchmark must never touch its source
        raise RuntimeError(f"{config.locomo} changed during the run")
    return summary
