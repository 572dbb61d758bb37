"""The audit's driver: frozen contexts -> coalition evaluations (streamed) -> attributions, interactions, clearances.

`run_audit` plans cases lazily, a bounded window of them in flight (`case_window`), and routes whole cases to a pool
of agents (`pipeline.exec.pools`: in process or Ray actors) through the `Scheduler`. Each worker runs its cases to the
end (`pipeline.audit.worker.run_cases`: first passes batched, then the later passes, then the reduction) and returns
their rows as Arrow tables; the driver streams them (contexts, utilities, attributions, interactions, clearances) to
part files named by the run attempt: driver memory is the window, not the pool.
When the run finishes, every other run's (and crashed attempt's) reduction parts are dropped, so each reduction
folder holds exactly this run's rows; after a crash it holds every case that finished. Rows are keyed by (pool, query,
context hash, coalition, agent, utility mode), so a rerun into the same folder (or one given `reuse=PREVIOUS_OUT`,
`pipeline.store.reuse`) skips every coalition already written. Part files are content-addressed and compacted at the end
of each run, so resuming after any crash converges: `utilities/` ends with every key exactly once. A case whose agent
fails or returns a non-finite or out-of-range utility goes to `errors/`; the other cases finish.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from pipeline.audit.cases import Case, case_seed
from pipeline.audit.reduce import ClearanceRow, ClearanceSummary
from pipeline.audit.settings import AuditConfig
from pipeline.audit.worker import CasesDone, CaseSettings, CaseTask
from pipeline.core.provenance import input_record, versions
from pipeline.core.validation import fingerprint
from pipeline.exec.pools import WorkerPool
from pipeline.exec.prefetch import Prefetch
from pipeline.game import make_plan
from pipeline.game.clearance import RANKINGS, SINGLES
from pipeline.io.records import Pool, Query
from pipeline.retrieval.frozen import FrozenContext, Retriever
from pipeline.store import manifest as manifests
from pipeline.store import parts, writer
from pipeline.store.lock import OutLock
from pipeline.store.manifest import Manifest
from pipeline.store.outdir import DATASET_NAMES, check_out
from pipeline.store.reuse import PoolReuse, ReuseImport
from pipeline.store.schemas import DATASETS, UTILITIES, UTILITY_KEY

log = logging.getLogger(__name__)


@dataclass
class AuditResult:
    """What an audit did, in counts (the rows are in the output folder); `cli.print_summary` prints it."""

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
    # Example rows only, not one per query (all rows are in clearances/): `summary` holds the counts the CLI prints
    # and at most `ClearanceSummary.limit` rows of each kind; `clearances` is its rows.
    clearances: list[ClearanceRow] = field(repr=False, default_factory=list)
    imported: int = 0  # of `reused`, rows copied from --reuse folders
    failed: int = 0  # cases that went to errors/ (the exit code is then non-zero)
    errors: list[dict] = field(repr=False, default_factory=list)  # the first few error rows; all are in errors/
    total_evaluations: int = 0  # the clearances' `evaluations` summed: what every query spent, reused included
    summary: ClearanceSummary | None = field(repr=False, default=None)
    peak_cases_in_flight: int = 0  # most cases in flight at once (bounded by the window)
    window: int = 0
    without_loo: int = 0  # cases planned without the LOO screen (`auto` at small budgets; their `loo` is null)

    def __post_init__(self) -> None:
        if self.summary is None:  # built by hand (tests, callers): summarise the rows given
            self.summary = ClearanceSummary.of(self.clearances)


class Scheduler:
    """Feeds workers whole cases: at most `max_inflight` tasks each, a task holding cases whose first passes add up to
    `batch_size` coalitions at most (a case is never split; one larger than `batch_size` goes alone). A case's later
    passes run in the same task, so they reach the worker whose prefix cache holds its prompt prefix."""

    def __init__(self, agents: WorkerPool, batch_size: int, settings: CaseSettings):
        self.agents, self.batch_size, self.settings = agents, batch_size, settings
        self._queue: deque[tuple[CaseTask, int]] = deque()
        self._inflight = [0] * agents.n_workers

    def enqueue(self, task: CaseTask) -> None:
        self._queue.append((task, task.first_pass))

    def fill(self) -> None:
        """Submit queued cases until every worker has `max_inflight` tasks or the queue is empty."""
        q = self._queue
        for w in range(self.agents.n_workers):
            while self._inflight[w] < self.agents.max_inflight and q:
                batch, n = [], 0
                while q and (not batch or n + q[0][1] <= self.batch_size):
                    task, size = q.popleft()
                    batch.append(task)
                    n += size
                self.agents.submit(w, "run_cases", batch, self.settings)
                self._inflight[w] += 1

    @property
    def busy(self) -> bool:
        return any(self._inflight)

    def wait(self) -> CasesDone:
        """The result of the next task to finish."""
        w, done = self.agents.next_done()
        self._inflight[w] -= 1
        return done


# Cases in flight per task slot (workers x tasks each). A slot's task holds up to `batch_size` coalitions, i.e. whole
# cases; four cases a slot's worth keeps every worker fed while the driver writes finished cases and plans new ones.
WINDOW_BATCHES = 4


def case_window(agents: WorkerPool, batch_size: int, coalitions_per_case: int) -> int:
    """How many cases may be in flight at once: enough to fill every worker's task slots `WINDOW_BATCHES` times over,
    so the agents never wait for the driver to plan, and no more, so driver memory does not grow with the pool."""
    per_task = max(1, batch_size // max(coalitions_per_case, 1))
    return max(8, WINDOW_BATCHES * agents.n_workers * agents.max_inflight * per_task)


class ReductionWriters:
    """The per-case datasets, streamed as each case finishes: one part writer each, parts named by this run attempt
    (`writer.run_prefix`), so a crash keeps every finished case and the end of the run drops other runs' parts."""

    NAMES = ("contexts", "attributions", "interactions", "clearances", "errors")

    def __init__(self, out: Path, attempt: str, flush_rows: int):
        self.out, self.prefix = out, writer.run_prefix(attempt)
        self.parts = {n: writer.PartWriter(out / n, DATASETS[n], flush_rows=flush_rows,
                                           prefix=self.prefix) for n in self.NAMES}

    def task_done(self, done: CasesDone) -> None:
        for name, table in (("contexts", done.contexts), ("attributions", done.attributions),
                            ("interactions", done.interactions), ("clearances", done.clearances_table)):
            if table is not None:
                self.parts[name].add_table(table)
        if done.errors:
            self.parts["errors"].add_rows(done.errors)

    def close(self) -> None:
        """Flush every writer, then drop the parts of other runs: the folders now hold exactly this run's rows."""
        for w in self.parts.values():
            w.close(empty_part=True)
        for n in self.NAMES:
            writer.drop_other_parts(self.out / n, self.prefix)


class _Evaluation:
    """The evaluation phase: cases admitted lazily into a bounded window and routed whole to the workers, which run
    each to the end and return its rows; the driver writes them (`utilities/` and the reductions) and counts. Driver
    memory is the window, not the pool."""

    def __init__(self, feed: Prefetch, total: int, config: AuditConfig, run_id: str, agents: WorkerPool,
                 agent_fp: str, utilities: writer.PartWriter, reductions: ReductionWriters, progress: bool,
                 previous: PoolReuse, imports: ReuseImport | None = None, window: int | None = None):
        from pipeline.core.progress import progress_bar

        self.feed, self.config, self.run_id, self.agent_fp, self.utilities = feed, config, run_id, agent_fp, utilities
        self.reductions, self.previous, self.imports = reductions, previous, imports
        settings = CaseSettings(run_id, agent_fp, config.utility, config.tau, config.kappa, config.adaptive_z)
        self.sched = Scheduler(agents, config.batch_size, settings)
        self.window = window or case_window(agents, config.batch_size, _plan_size(config))
        self.inflight: set[int] = set()  # indices of the cases admitted and not yet returned by a worker
        self.peak_states = 0  # most cases in flight at once (flatness: never above `window`)
        self.summary = ClearanceSummary()
        self.errors: list[dict] = []  # the first few error rows, for the CLI summary; all are in errors/
        self.admitted = self.finished = self.failed = self.harmful = self.cases_with_harm = self.failing = 0
        self.max_evaluations = 0
        self.total_evaluations = 0  # distinct coalitions per query, summed (what the queries spent, reused included)
        self.reused = 0
        self.without_loo = 0
        self.first_case_s: float | None = None  # seconds from the start of the loop to the first case admitted
        self._pending: deque[tuple[Query, FrozenContext]] = deque()  # the current pool's cases not yet admitted
        self._exhausted = False
        self.bar = progress_bar(total=total, desc="cases", unit="case", enabled=progress)

    def run(self) -> None:
        """Admit cases as retrieval freezes them (pool by pool), keep the window full, evaluate until every case is
        finished or failed. The driver blocks on retrieval only when no task is in flight."""
        try:
            self._run()
        except BaseException:
            # The run stops (an agent's server gone, its engine dead, Ctrl-C, a bug): the coalitions already evaluated
            # are written, so a rerun resumes from them. Each row is one finished evaluation, valid on its own.
            try:
                self.utilities.flush()
            except Exception:  # noqa: BLE001 - a full disk, say: the original error is the one to report
                log.info("could not write the evaluated coalitions on the way out", exc_info=True)
            raise
        self.utilities.close()
        self.reductions.close()
        self.bar.close()

    def _run(self) -> None:
        t0 = time.perf_counter()
        while True:
            self._admit(block=not self.sched.busy)
            if self.first_case_s is None and self.admitted:
                self.first_case_s = time.perf_counter() - t0
            self.sched.fill()
            if not self.sched.busy:
                if self._exhausted and not self._pending:
                    break
                if len(self.inflight) >= self.window:  # a driver bug: cases were sent and never came back
                    raise RuntimeError(f"{len(self.inflight)} cases neither finished nor failed")
                continue
            self._receive(self.sched.wait())
        if self.inflight:  # a driver bug: a case was sent and never came back
            raise RuntimeError(f"{len(self.inflight)} cases neither finished nor failed")

    def _next_pair(self, block: bool) -> tuple[Query, FrozenContext] | None:
        """The next frozen (query, context) from retrieval, or None (none ready without blocking, or none left). A new
        pool's rows from --reuse folders are imported before its first case is admitted."""
        while not self._pending:
            if self._exhausted:
                return None
            item = self.feed.get(block=block)
            if item is Prefetch.EMPTY:
                return None
            if item is Prefetch.DONE:
                self._exhausted = True
                return None
            pool_id, pairs = item
            if self.imports is not None:
                self.imports.pool(pool_id, [(q.pool_id, q.query_id, c.context_hash) for q, c in pairs])
            self._pending.extend(pairs)
        return self._pending.popleft()

    def _admit(self, block: bool) -> None:
        """Plan cases until the window is full or retrieval has none ready; waits for retrieval only if `block`
        (and then only for the first case)."""
        c = self.config
        while len(self.inflight) < self.window:
            pair = self._next_pair(block)
            if pair is None:
                return
            block = False
            query, context = pair
            case = Case(query, context, case_seed(c.seed, query.pool_id, query.query_id))
            ci, self.admitted = self.admitted, self.admitted + 1
            plan = make_plan(case.k, c.permutations, c.estimator, c.antithetic, case.seed, c.adaptive_round, c.budget,
                             c.adaptive_prior, c.utility, c.adaptive_rule)
            self.without_loo += not plan.loo
            prev = self.previous.get((query.pool_id, query.query_id, context.context_hash))
            if prev is not None:
                self.reused += len(prev[0])
            # A case whose values were all reused goes to a worker too (it makes no agent call there): one path for
            # every case, and the reductions of a resumed run spread over the workers as a fresh run's do, instead of
            # coming back to the driver (`finalize` was the largest part of the driver's time, issue 9).
            self.sched.enqueue(CaseTask(ci, case, plan, prev))
            self.inflight.add(ci)
            self.peak_states = max(self.peak_states, len(self.inflight))

    def _receive(self, done: CasesDone) -> None:
        """Write a task's rows and count its cases. A failed case's usable utilities are written with the rest; its
        error rows go to errors/ (the run goes on)."""
        if done.utilities is not None:
            self.utilities.add_table(done.utilities)
        self.reductions.task_done(done)
        for c in done.clearances:
            self._done(c)
        if done.errors:
            self.errors.extend(done.errors[: max(0, 12 - len(self.errors))])
        self.failed += len(done.failed)
        for ci in (*done.finished, *done.failed):
            self.inflight.remove(ci)
        self.bar.update(len(done.finished) + len(done.failed))

    def _done(self, c: ClearanceRow) -> None:
        self.summary.add(c)
        self.finished += 1
        self.harmful += c.harmful
        self.cases_with_harm += c.harmful > 0
        self.failing += not c.baseline_correct
        self.max_evaluations = max(self.max_evaluations, c.evaluations)
        self.total_evaluations += c.evaluations


def _plan_size(c: AuditConfig) -> int:
    """First-pass coalitions of a case with K = top_k (what sizes the window; a pool smaller than K gives less)."""
    plan = make_plan(c.top_k, c.permutations, c.estimator, c.antithetic, 0, c.adaptive_round, c.budget,
                     c.adaptive_prior, c.utility, c.adaptive_rule)
    # a plan without the LOO screen asks only the empty set and N first, then its draws: size it as the anchored
    # plan (K+2), so dropping the screen does not multiply the cases in flight and the coalitions per task
    return plan.n_coalitions if plan.loo else max(plan.n_coalitions, c.top_k + 2)


def _open_run(out: Path, config: AuditConfig, agent_fp: str,
              input_files: list[str]) -> tuple[str, str, list[dict], list[str], str | None]:
    """(run_id, attempt, input files with their hashes, input folders, the run whose reductions `out` holds). Marks
    `out` as running.
    `attempt` names this attempt's reduction parts: a rerun of the same run_id after a crash is a new attempt, and
    its end drops the crashed attempt's parts with every other run's."""
    inputs = [input_record(p) for p in input_files if not Path(p).is_dir()]
    folders = sorted({str(Path(p).resolve()) for p in input_files if Path(p).is_dir()})
    run_id = fingerprint({"config": asdict(config), "inputs": [i["sha256"] for i in inputs], "agent": agent_fp})
    out.mkdir(parents=True, exist_ok=True)
    writer.recover_swaps(out, DATASET_NAMES)
    previous_run = manifests.run_id(out)
    # Before any evaluation: damaged parts (a kill or power loss mid-write) go to quarantine/ and are evaluated again;
    # a part of another schema version stops the run here, with one line.
    parts.sweep(out, DATASETS)
    if previous_run and previous_run != run_id:  # utilities are kept by key; the reductions are replaced
        log.warning("%s: replacing the reductions of run %s (other settings or inputs) with run %s; its utilities "
                    "stay and are reused where their key matches", out, previous_run, run_id)
    # Until this run finishes, the manifest says so: a reader never mistakes a crashed run's folder for a complete one.
    attempt = uuid.uuid4().hex[:12]
    Manifest(run_id=run_id, status="running", attempt=attempt, datasets=sorted(DATASETS), config=asdict(config),
             agent=agent_fp, inputs=inputs, input_folders=folders).write(out)
    return run_id, attempt, inputs, folders, previous_run


def run_audit(
    pools: dict[str, Pool],
    queries: list[Query],
    config: AuditConfig,
    out: str | Path,
    agents: WorkerPool,
    agent_fingerprint: str,
    input_files: list[str] | None = None,
    progress: bool = True,
    reuse: list[str | Path] | None = None,
    lock: OutLock | None = None,
    flush_rows: int = 50_000,
    window: int | None = None,
    encoder: Callable[[], object] | None = None,
) -> AuditResult:
    """Run an audit on an already-started pool of `pipeline.audit.worker.AgentWorker`s. Inputs must be validated (the
    loaders do that).

    `lock`: the output folder's lock when the caller already holds it (`pipeline.audit.run.audit` takes it before
    starting agents); otherwise the folder is checked and locked here. `reuse`: earlier run folders whose utilities
    are reused by key. `window`: most cases in flight at once (default `case_window`: enough to keep every worker
    busy). `encoder`: starts what embeds texts the embedding cache lacks, called only when one is missing
    (`pipeline.retrieval.frozen.Retriever`); default MiniLM in this process.
    """
    out = Path(out)
    if lock is None:
        check_out(out, input_files or [])
        with OutLock(out) as own:
            return run_audit(pools, queries, config, out, agents, agent_fingerprint, input_files, progress,
                             reuse, own, flush_rows, window, encoder)
    t_start = time.perf_counter()
    timings: dict[str, float] = {}
    run_id, attempt, inputs, folders, previous_run = _open_run(out, config, agent_fingerprint, input_files or [])

    # Retrieval is a stage running ahead in a background thread (`Prefetch`): pool by pool it embeds (cached in
    # $MECLEAR_CACHE, by `encoder` when given) and freezes contexts, and evaluation admits the first pool's cases as
    # soon as they are frozen. `ahead`: frozen pools waiting for the window (a pool's contexts are one item).
    # With agents in this process (`--executor local`) the stage runs lazily in the driver's thread instead: a
    # second Python thread only fights the in-process agent for the GIL. Measured on full LoCoMo, warm cache, reader,
    # idle 2 cores: threaded retrieval took 13-15 s of thread time for 1.4 s of work and the whole run went from 18.6
    # to 25-26 s; under Ray (agents in actors) the thread costs nothing and the run took 14.4-16.6 s.
    retriever = Retriever(pools, config.top_k, config.dense, progress=progress, encoder=encoder)
    feed = Prefetch(retriever.stream(queries), ahead=2, name="retrieval",
                    thread=not getattr(agents, "in_process", False))
    reuse_dirs = [Path(r) for r in (reuse or [])]
    imports = ReuseImport(reuse_dirs, out, agent_fingerprint, config.utility) if reuse_dirs else None
    # one pool's earlier rows in memory at a time; the --reuse folders are read directly (their rows are imported
    # into `out` as each pool is reached, after this file list was taken)
    previous = PoolReuse([out, *reuse_dirs], agent_fingerprint, config.utility)
    utilities = writer.PartWriter(out / "utilities", UTILITIES, flush_rows=flush_rows)
    reductions = ReductionWriters(out, attempt, flush_rows)
    ev = _Evaluation(feed, len(queries), config, run_id, agents, agent_fingerprint, utilities, reductions, progress,
                     previous, imports, window)
    t, cpu = time.perf_counter(), time.process_time()
    try:
        ev.run()  # reductions streamed as cases finish; this run's rows alone remain when it returns
    finally:
        feed.close()
        retriever.close()
    timings["evaluate_s"] = time.perf_counter() - t
    # CPU seconds of this process during evaluation: the driver (its retrieval thread included) under Ray; driver and
    # agent in process (local)
    timings["evaluate_cpu_s"] = time.process_time() - cpu
    timings["retrieval_s"] = feed.busy_s  # the stage's own time, overlapped with evaluation
    timings["first_case_s"] = ev.first_case_s or 0.0
    timings.update({f"retrieval_{k}": v for k, v in retriever.stats.items()})
    imported = imports.copied if imports is not None else 0

    t = time.perf_counter()
    store = writer.compact(out / "utilities", UTILITIES, UTILITY_KEY)
    timings["compact_s"] = time.perf_counter() - t
    timings["write_s"] = timings["compact_s"]  # reductions are written during evaluation; only compaction is left
    timings["total_s"] = time.perf_counter() - t_start

    result = AuditResult(
        run_id=run_id,
        out=out,
        cases=ev.admitted,
        harmful=ev.harmful,
        cases_with_harm=ev.cases_with_harm,
        failing=ev.failing,
        recovered=ev.summary.recovered,
        evaluated=utilities.written,
        reused=ev.reused,
        without_loo=ev.without_loo,
        max_evaluations=ev.max_evaluations,
        total_evaluations=ev.total_evaluations,
        timings=timings,
        clearances=ev.summary.rows,
        failed=ev.failed,
        errors=ev.errors,
        imported=imported,
        summary=ev.summary,
        peak_cases_in_flight=ev.peak_states,
        window=ev.window,
    )
    reused = [str(Path(r).resolve()) for r in (reuse or [])]
    _manifest(result, config, agent_fingerprint, retriever.mode, inputs, folders, attempt, store, reused,
              previous_run if previous_run != run_id else None).write(out)
    return result


def _manifest(result: AuditResult, config: AuditConfig, agent_fp: str, retrieval: str, inputs: list[dict],
              folders: list[str], attempt: str, store: dict, reuse: list[str], replaced_run: str | None) -> Manifest:
    return Manifest(
        run_id=result.run_id,
        status="complete" if not result.failed else "complete_with_errors",
        attempt=attempt,  # every reduction part is named part-<attempt>-<digest>.parquet
        datasets=sorted(DATASETS),
        config=asdict(config),
        agent=agent_fp,
        retrieval=retrieval,
        inputs=inputs,
        input_folders=folders,
        versions=versions(),
        counts={
            "cases": result.cases,
            "harmful_memories": result.harmful,
            "cases_with_harm": result.cases_with_harm,
            "failing_cases": result.failing,
            "recovered_cases": result.recovered,
            "coalitions_evaluated": result.evaluated,
            "coalitions_reused": result.reused,
            "coalitions_imported_from_reuse": result.imported,
            "max_evaluations_per_case": result.max_evaluations,
            "evaluations_all_queries": result.total_evaluations,  # per query: clearances/ `evaluations`
            "budget_per_query": config.budget or None,
            "failed_cases": result.failed,
            # cases `auto` planned without the LOO screen (pipeline.game.plan.auto_measures_loo): `loo` null
            "cases_without_loo": result.without_loo,
            # non-empty clearances by the ranking that proposed them (clearances/ `source`, per query)
            **{f"cleared_by_{src}": (result.summary.sources.get(src, 0) if result.summary else 0)
               for src in (*RANKINGS, SINGLES)},
        },
        timings=result.timings,
        utilities=store | {"complete": True},
        reuse=reuse,
        replaced_run=replaced_run,
    )
