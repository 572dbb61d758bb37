"""Coalition evaluation and the audit's worker: whole cases run to the end next to their agent.

Runs wherever the agent lives (in process or inside a Ray actor) and does not know which. A response gives P(gold)
(token-F1 for open answers) and the binary outcome at once, so an `ItemResult` carries both (`ItemResult.utility`
picks the mode). `run_cases` takes a batch of whole cases and runs each to its end in the worker: every case's first
pass in one agent call (LLM batching kept), then the later passes (adaptive rounds, the clearance's second pass) of
those that need one, again in one call each round, then the reduction (`pipeline.audit.reduce`). It returns the rows as
Arrow tables, so the driver only routes cases and writes (issue 9: the driver's ray.get, recording and `finalize`
capped throughput however many actors were added).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from pipeline.agents import AgentSpec, build_agent
from pipeline.agents.base import Agent
from pipeline.agents.utility import in_mode, outcome
from pipeline.audit.cases import Case
from pipeline.audit.reduce import CaseState, advance, finalize
from pipeline.core.errors import (
    AgentStartError,
    ConfigError,
    EndpointGoneError,
    EngineDeadError,
    MeClearError,
)
from pipeline.core.text import gold_index
from pipeline.game import GamePlan
from pipeline.game.clearance import clearance_rankings, primary_ranking
from pipeline.game.plan import popcount
from pipeline.store.rows import (
    AttributionRow,
    ClearanceRow,
    ContextRow,
    ErrorRow,
    InteractionRow,
    UtilityRow,
    columns,
    table_columns,
)
from pipeline.store.schemas import (
    ATTRIBUTIONS,
    CLEARANCES,
    CONTEXTS,
    INTERACTIONS,
    UTILITIES,
)
from pipeline.store.writer import rows_to_table

log = logging.getLogger(__name__)

# Errors after which the agent's engine cannot answer anything any more, recognised by name so that neither vLLM nor
# torch is imported here: vLLM's EngineDeadError (the engine core process died), torch's OutOfMemoryError (CUDA OOM:
# the engine's memory state is unknown after it, and vLLM turns it into EngineDeadError on the next call anyway), and
# torch's AcceleratorError (a CUDA fault, "CUDA error: ..."; the CUDA context is unusable after one).
ENGINE_DEATH_TYPES = frozenset({"EngineDeadError", "OutOfMemoryError", "AcceleratorError"})
ENGINE_DEATH_TEXT = ("CUDA out of memory", "CUDA error:", "EngineCore encountered an issue")
# Exit status of an actor process that leaves because its engine died: an exit Ray did not ask for, so Ray restarts
# the actor (ray_exec.MAX_RESTARTS) and retries its unfinished tasks (MAX_TASK_RETRIES).
EXIT_ENGINE_DEAD = 75


def engine_died(exc: BaseException) -> bool:
    """Whether `exc` (or an exception it was raised from) says the engine is dead rather than that one case failed."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, EngineDeadError) or any(t.__name__ in ENGINE_DEATH_TYPES for t in type(exc).__mro__):
            return True
        if any(marker in str(exc) for marker in ENGINE_DEATH_TEXT):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _raise_if_engine_died(exc: Exception) -> None:
    if isinstance(exc, (EngineDeadError, EndpointGoneError)):  # neither is the case's fault
        raise exc
    if engine_died(exc):
        raise EngineDeadError(f"the agent's engine died: {_one_line(exc)}") from exc


@dataclass(frozen=True)
class WorkItem:
    """Coalitions of one case to evaluate. Items of one case always go to the same agent (prefix-cache affinity)."""

    case_index: int
    case: Case
    masks: np.ndarray  # int64
    stage: str  # "plan" or "clearance"


@dataclass(frozen=True)
class ItemResult:
    case_index: int
    stage: str
    masks: np.ndarray
    probability: np.ndarray  # P(gold option), or mean token-F1 for open answers
    correct: np.ndarray
    answer: list[str]
    gold_prob: list[float | None]
    prompt_tokens: list[int | None]
    cached_tokens: list[int | None]
    latency_s: list[float | None]
    error: str | None = None  # the agent failed on this item (a data reason); the other fields are then empty

    def utility(self, mode: str) -> np.ndarray:
        """The utilities in `mode` ('probability' or 'correct')."""
        return in_mode(self.probability, self.correct, mode)


def _one_line(exc: BaseException) -> str:
    """An exception as one line that says what was wrong. A pydantic ValidationError (how vLLM refuses settings) puts
    only "1 validation error for ModelConfig" on its first line; its errors' messages name the setting."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        try:
            msgs = [str(e.get("msg", "")) for e in errors()]
        except Exception:  # noqa: BLE001 - not pydantic after all
            msgs = []
        if any(msgs):
            return f"{type(exc).__name__}: {'; '.join(m for m in msgs if m)}".replace("\n", " ")[:500]
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"[:500]


def _failed(it: WorkItem, exc: Exception) -> ItemResult:
    empty = np.zeros(0)
    reason = f"{type(exc).__name__}: {exc}".splitlines()[0][:500]
    return ItemResult(it.case_index, it.stage, np.asarray(it.masks, dtype=np.int64), empty, empty.astype(bool),
                      [], [], [], [], [], error=reason)


def evaluate_items(agent: Agent, items: list[WorkItem]) -> list[ItemResult]:
    """Answer every coalition of every item in one agent batch, then score each response. When the batch raises, each
    item is retried alone, so an agent error on one case marks that case only (ItemResult.error). An engine that died
    (`engine_died`) is no case's fault: EngineDeadError is raised, so that the actor is replaced instead of every
    remaining case going to errors/."""
    try:
        return _evaluate(agent, items)
    except Exception as exc:  # noqa: BLE001 - any agent failure on a case is recorded, not fatal
        _raise_if_engine_died(exc)
        if len(items) == 1:
            return [_failed(items[0], exc)]
    out = []
    for it in items:
        try:
            out.extend(_evaluate(agent, [it]))
        except Exception as exc:  # noqa: BLE001
            _raise_if_engine_died(exc)
            out.append(_failed(it, exc))
    return out


def _evaluate(agent: Agent, items: list[WorkItem]) -> list[ItemResult]:
    requests = [it.case.request(int(m)) for it in items for m in it.masks]
    t0 = time.perf_counter()
    responses = agent.answer_batch(requests)
    per_request = (time.perf_counter() - t0) / max(len(requests), 1)
    out, pos = [], 0
    for it in items:
        q = it.case.query
        g = gold_index(q.options, q.answer) if q.options else -1
        resp = responses[pos : pos + len(it.masks)]
        pos += len(it.masks)
        scored = [outcome(r, q.options, q.answer) for r in resp]
        out.append(
            ItemResult(
                case_index=it.case_index,
                stage=it.stage,
                masks=np.asarray(it.masks, dtype=np.int64),
                probability=np.array([s[0] for s in scored], dtype=float),
                correct=np.array([s[1] for s in scored], dtype=bool),
                answer=[r.answer for r in resp],
                gold_prob=[float(r.option_probs[g]) if g >= 0 else None for r in resp],
                prompt_tokens=[r.prompt_tokens for r in resp],
                cached_tokens=[r.cached_tokens for r in resp],
                latency_s=[r.latency_s if r.latency_s is not None else per_request for r in resp],
            )
        )
    return out


# -- whole cases, run to the end in the worker ---------------------------------------------------------------------


@dataclass(frozen=True)
class CaseSettings:
    """What a worker needs, besides each case's plan, to run cases to the end and write their rows."""

    run_id: str
    agent: str  # the pool's agent fingerprint: the `agent` column of utilities/
    utility: str  # "probability" or "correct"
    tau: float
    kappa: float
    adaptive_z: float


@dataclass(frozen=True)
class CaseTask:
    """One whole case for a worker: the case, its plan (made by the driver, which sizes tasks by it) and the values an
    earlier run wrote for its key (`pipeline.store.reuse.PoolReuse`: coalitions, utilities, correct, answers), if
    any."""

    case_index: int
    case: Case
    plan: GamePlan
    reused: tuple[np.ndarray, np.ndarray, np.ndarray, list] | None = None

    @property
    def first_pass(self) -> int:
        """Coalitions of the first agent call this case adds to its task (what `batch_size` bounds)."""
        if self.reused is None:
            return self.plan.n_coalitions
        return int(np.setdiff1d(self.plan.coalitions, self.reused[0]).size)


TABLES = ("contexts", "utilities", "attributions", "interactions", "clearances_table")  # CasesDone's Arrow tables


@dataclass(frozen=True)
class CasesDone:
    """What `run_cases` returns for one batch of cases: its rows as Arrow tables, built here so that the driver only
    writes them (None when there are none; `contexts` of every case, failed ones included, as the driver wrote them
    on admission before), each finished case's clearance also as a typed row (the driver's summary counts them), and
    the failed cases' error rows. `calls` lists the agent calls made, as (case index, coalitions, stage) of each item
    in call order: the agent benchmark replays exactly these batches (`benchmarks/throughput.py`, `RecordingPool`)."""

    finished: list[int]
    failed: list[int]
    clearances: list[ClearanceRow]
    contexts: pa.Table | None
    utilities: pa.Table | None
    attributions: pa.Table | None
    interactions: pa.Table | None
    clearances_table: pa.Table | None
    errors: list[dict]
    calls: list[list[tuple[int, np.ndarray, str]]]

    def __reduce__(self):
        # Pickled only when it crosses processes (a Ray actor's result): each table then travels as one Arrow IPC
        # stream, read back in ~35 us (a 256-row utilities table). Ray's own table serialiser rebuilds every column
        # apart: under cProfile a LoCoMo audit with 2 actors spent 1.47 s of the driver's 5.8 s receiving results
        # that way, 0.63 s with IPC streams.
        tables = [getattr(self, n) for n in TABLES]
        return _cases_done, (self.finished, self.failed, self.clearances, self.errors, self.calls,
                             *map(_to_ipc, tables))


def _to_ipc(table: pa.Table | None) -> pa.Buffer | None:
    if table is None:
        return None
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return sink.getvalue()


def _cases_done(finished, failed, clearances, errors, calls, *buffers) -> CasesDone:
    tables = {n: None if b is None else pa.ipc.open_stream(b).read_all() for n, b in zip(TABLES, buffers)}
    return CasesDone(finished, failed, clearances, errors=errors, calls=calls, **tables)


def usable(utility: np.ndarray) -> np.ndarray:
    return np.isfinite(utility) & (utility >= 0) & (utility <= 1)


def utility_columns(s: CaseSettings, case: Case, res: ItemResult, utility: np.ndarray,
                    keep: np.ndarray) -> dict[str, list]:
    """The usable rows of one result as `utilities/` columns."""
    n = int(keep.sum())
    q, c = case.query, case.context

    def pick(values: list) -> list:
        return [v for v, k in zip(values, keep) if k]

    return columns(UtilityRow, {
        "run_id": [s.run_id] * n,
        "pool_id": [q.pool_id] * n,
        "query_id": [q.query_id] * n,
        "context_hash": [c.context_hash] * n,
        "coalition": res.masks[keep].tolist(),
        "size": popcount(res.masks[keep]).tolist(),
        "utility": utility[keep].tolist(),
        "correct": res.correct[keep].tolist(),
        "utility_mode": [s.utility] * n,
        "agent": [s.agent] * n,
        "answer": pick(res.answer),
        "gold_prob": pick(res.gold_prob),
        "stage": [res.stage] * n,
        "prompt_tokens": pick(res.prompt_tokens),
        "cached_tokens": pick(res.cached_tokens),
        "latency_s": pick(res.latency_s),
    })


def error_rows(run_id: str, case: Case, res: ItemResult, utility: np.ndarray) -> list[dict]:
    """Why a result cannot be used: the agent failed on the item, or utilities outside [0, 1] (NaN included)."""
    q, c = case.query, case.context
    base = {"run_id": run_id, "pool_id": q.pool_id, "query_id": q.query_id, "context_hash": c.context_hash,
            "stage": res.stage}
    if res.error is not None:
        return [ErrorRow(**base, coalition=None, kind="agent_error", reason=res.error).as_row()]
    rows = []
    for m, u in zip(res.masks.tolist(), utility.tolist()):
        if not np.isfinite(u):
            rows.append(ErrorRow(**base, coalition=m, kind="non_finite_utility",
                                 reason=f"utility {u} (agent answer unusable)").as_row())
        elif not 0.0 <= u <= 1.0:
            rows.append(ErrorRow(**base, coalition=m, kind="utility_out_of_range",
                                 reason=f"utility {u}; allowed 0..1").as_row())
    return rows


def context_columns(run_id: str, cases: list[Case]) -> dict[str, list]:
    """`contexts/` columns of the cases: one row per memory of each frozen context, in retrieval order."""
    ctx = [c.context for c in cases]
    return columns(ContextRow, {
        "run_id": [run_id] * sum(c.k for c in ctx),
        "pool_id": [c.query.pool_id for c in cases for _ in range(c.k)],
        "query_id": [c.query.query_id for c in cases for _ in range(c.k)],
        "context_hash": [c.context_hash for c in ctx for _ in range(c.k)],
        "position": [i for c in ctx for i in range(c.k)],
        "memory_id": [m for c in ctx for m in c.memory_ids],
        "text": [t for c in ctx for t in c.texts],
        "retrieval_score": [v for c in ctx for v in c.scores],
        "bm25_rank": [v for c in ctx for v in c.bm25_ranks],
        "dense_rank": [v for c in ctx for v in c.dense_ranks],
    })


def _table(rows: list, schema: pa.Schema) -> pa.Table | None:
    """Typed rows (`pipeline.store.rows`) as an Arrow table of `schema`."""
    return rows_to_table(table_columns(rows, schema.names), schema) if rows else None


def _columns_table(blocks: list[dict[str, list]], schema: pa.Schema) -> pa.Table | None:
    if not blocks:
        return None
    return rows_to_table({n: [v for b in blocks for v in b[n]] for n in schema.names}, schema)


def run_cases(agent: Agent, tasks: list[CaseTask], s: CaseSettings) -> CasesDone:
    """Run each case of the batch to its end: one agent call per round holding every case that still needs
    coalitions (round 1: the first passes; then adaptive rounds and clearance passes), then finalize each.

    A case whose agent fails, or returns a non-finite or out-of-range utility, fails there: its usable rows are kept,
    its error rows returned, the other cases go on (the semantics the driver had). A case whose values were all
    reused makes no agent call and is only reduced here."""
    states: dict[int, CaseState] = {}
    for t in tasks:
        st = CaseState(t.case, t.plan, s.tau, s.adaptive_z, clearance_rankings(s.utility, bool(t.plan.eval_budget)),
                       primary_ranking(s.utility))
        if t.reused is not None:
            st.record(*t.reused)
        states[t.case_index] = st
    alive = [t.case_index for t in tasks]
    failed: list[int] = []
    utilities: list[dict[str, list]] = []
    errors: list[dict] = []
    calls: list[list[tuple[int, np.ndarray, str]]] = []
    while True:
        items = []
        for ci in alive:
            if (need := advance(states[ci], s.tau, s.adaptive_z)) is not None:
                items.append(WorkItem(ci, states[ci].case, need.masks, need.stage))
        if not items:
            break
        calls.append([(it.case_index, it.masks, it.stage) for it in items])
        for res in evaluate_items(agent, items):
            st = states[res.case_index]
            utility = res.utility(s.utility)
            if res.error is None:
                keep = usable(utility)
                st.record(res.masks[keep], utility[keep], res.correct[keep], [a for a, k in zip(res.answer, keep) if k])
                if keep.any():
                    utilities.append(utility_columns(s, st.case, res, utility, keep))
            if bad := error_rows(s.run_id, st.case, res, utility):
                errors.extend(bad)
                failed.append(res.case_index)
        alive = [ci for ci in alive if ci not in failed]
    attributions: list[AttributionRow] = []
    interactions: list[InteractionRow] = []
    clearances: list[ClearanceRow] = []
    for ci in alive:
        if not states[ci].complete:  # a bug: advance asked for nothing, yet the case cannot be reduced
            raise RuntimeError(f"case {states[ci].case.key}: no coalitions asked for, but not complete")
        rows = finalize(states[ci], s.run_id, s.tau, s.kappa)
        attributions.extend(rows.attributions)
        interactions.extend(rows.interactions)
        clearances.append(rows.clearance)
    return CasesDone(alive, failed, clearances,
                     contexts=rows_to_table(context_columns(s.run_id, [t.case for t in tasks]), CONTEXTS),
                     utilities=_columns_table(utilities, UTILITIES),
                     attributions=_table(attributions, ATTRIBUTIONS),
                     interactions=_table(interactions, INTERACTIONS),
                     clearances_table=_table(clearances, CLEARANCES),
                     errors=errors, calls=calls)


class AgentWorker:
    """The worker of the audit's pools (in process or a Ray actor): builds its agent once and runs batches of whole
    cases (`run_cases`). A build failure is kept as one line and its exit code and returned by `fingerprint`, so the
    driver reports it as such (`agent_fingerprint`) instead of an actor traceback. `agent`: an already built agent
    (tests). `exit_on_engine_death`: set for Ray actors (`pipeline.audit.actors.start_agent_pool`): when the engine dies
    the process exits, which Ray treats as an actor failure (restart, then the task retried); an exception would only
    fail the task, and the actor would stay up with a dead engine."""

    def __init__(self, spec: AgentSpec, agent: Agent | None = None, exit_on_engine_death: bool = False):
        self.agent, self.error, self.exit_on_engine_death = agent, None, exit_on_engine_death
        if agent is not None:
            return
        try:
            self.agent = build_agent(spec)
        except MeClearError as exc:
            self.error = (str(exc), exc.exit_code)
        except Exception as exc:  # noqa: BLE001 - an engine that cannot start
            self.error = (f"agent {spec.name!r} could not start: {_one_line(exc)}", 2)

    def fingerprint(self) -> str | tuple[str, int]:
        return self.error if self.agent is None else self.agent.fingerprint()

    def pid(self) -> int:
        return os.getpid()

    def run_cases(self, tasks: list["CaseTask"], settings: "CaseSettings") -> "CasesDone":
        if self.agent is None:  # a restarted actor whose agent could not be rebuilt (its server gone, say)
            message, code = self.error
            raise (EndpointGoneError if code == EndpointGoneError.exit_code else AgentStartError)(message)
        try:
            return run_cases(self.agent, tasks, settings)
        except EngineDeadError as exc:
            if not self.exit_on_engine_death:
                raise
            # Engine processes are killed by the reaper's watcher once this process is gone (pipeline.core.reaper).
            log.error("%s; leaving the actor so that Ray restarts it and retries its task", exc)
            logging.shutdown()
            os._exit(EXIT_ENGINE_DEAD)

    def reset_prefix_cache(self) -> bool:
        """Empty the engine's prefix cache (the throughput benchmark starts every repetition cold)."""
        return bool(self.agent.reset_prefix_cache())

    def close(self) -> None:
        if self.agent is not None:
            self.agent.close()


def agent_fingerprint(built: list) -> str:
    """The one fingerprint of a pool's agents (`AgentWorker.fingerprint` of each worker); raises the first build
    failure as AgentStartError with its exit code, or ConfigError when the workers built different agents."""
    failures = [b for b in built if isinstance(b, (tuple, list))]
    if failures:
        message, code = failures[0]
        err = AgentStartError(message)
        err.exit_code = code
        raise err
    fps = set(built)
    if len(fps) != 1:
        raise ConfigError(f"ray executor: actors built different agents {sorted(fps)}; check the agent settings")
    return fps.pop()
