"""The audit's estimators against exact Shapley at K=10 on LoCoMo, in both utility modes: evaluations per case and
agreement of the harmful sets, on tuning and held-out conversations (issue 16 items 5 and 7).

    nice -n 10 env PYTHONPATH=. python jobs/bench_adaptive.py --locomo /work/shared/data/locomo/locomo10.json \
        --tables /tmp/ba-tables --tune conv-26,conv-30 --held-out conv-41,conv-44,conv-47 --out /tmp/ba

Two phases. `tables`: the exact audit (reader agent, BM25 retrieval, in process) of every query of each listed
conversation, once, into <tables>/<conversation>/ (skipped when already there): all 2^K coalitions per case, with
P(gold) and the binary outcome of each, i.e. both utility modes from one set of agent calls. `replay`: every estimator
configuration replays every case through the audit's own code (`pipeline.audit.reduce.CaseState` / `advance`: the
estimator contract in ask/tell form, LOO, the clearance and its budget share), answering coalitions from the table, so
"evaluations / case" counts what the audit would have spent, clearance checks included. The reference is exact
enumeration's harmful set {i : phi_i < -tau} under the same utility mode. Prints a table per subset and mode and
writes <out>/bench_adaptive.json.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl

from pipeline.audit.cases import Case, case_seed
from pipeline.audit.reduce import CaseState, advance
from pipeline.game import make_plan, shapley_exact
from pipeline.game.adaptive import DEFAULT_Z
from pipeline.io.records import Query
from pipeline.retrieval.frozen import FrozenContext

TAU = 0.05
MODES = ("probability", "correct")
# (label, estimator, budget, options): the candidates compared; `budget` 0 = none (L decides, the paper's setting)
CONFIGS = (
    ("adaptive L96, no budget", "adaptive", 0, {}),
    ("adaptive L96 separation", "adaptive", 0, {"rule": "separation"}),
    ("adaptive B150 separation", "adaptive", 150, {"rule": "separation"}),
    ("adaptive L96 prior=0.3", "adaptive", 0, {"prior": 0.3}),
    ("adaptive B150", "adaptive", 150, {}),
    ("adaptive B128", "adaptive", 128, {}),
    ("auto B128", "auto", 128, {}),
    ("permutation B128", "permutation", 128, {}),
    ("antithetic B128", "antithetic", 128, {}),
    ("kernelshap B128", "kernelshap", 128, {}),
    ("leverage B128", "leverage", 128, {}),
    ("contextcite B128", "contextcite", 128, {}),
    ("screened, no budget", "screened", 0, {}),
    ("screened B150", "screened", 150, {}),
    ("screened B128", "screened", 128, {}),
    ("adaptive B64", "adaptive", 64, {}),
    ("permutation B64", "permutation", 64, {}),
    ("leverage B64", "leverage", 64, {}),
)


@dataclass
class Table:
    """One case's exact value tables (both modes) from the exact audit."""

    pool_id: str
    query_id: str
    k: int
    probability: np.ndarray
    correct: np.ndarray  # bool


def exact_tables(locomo: str, conversation: str, folder: Path) -> None:
    from pipeline.audit.run import AuditConfig, run_audit
    from pipeline.audit.worker import AgentWorker
    from pipeline.exec.pools import LocalPool
    from pipeline.io.locomo import load_locomo

    pools, queries = load_locomo(locomo)
    qs = [q for q in queries if q.pool_id == conversation]
    cfg = AuditConfig(top_k=10, estimator="exact", dense="off", executor="local")
    run_audit(pools, qs, cfg, folder, LocalPool(AgentWorker(cfg.agent_spec)), f"tables-{conversation}",
              progress=False)


def load_tables(folder: Path) -> list[Table]:
    u = pl.read_parquet(folder / "utilities", columns=["pool_id", "query_id", "coalition", "gold_prob", "correct"])
    out = []
    for (pool_id, query_id), g in u.group_by(["pool_id", "query_id"], maintain_order=True):
        n = g.height
        k = n.bit_length() - 1
        if n != 1 << k:
            continue  # a case with a failed coalition: not a complete table
        prob, ok = np.full(n, np.nan), np.zeros(n, dtype=bool)
        prob[g["coalition"].to_numpy()] = g["gold_prob"].to_numpy()
        ok[g["coalition"].to_numpy()] = g["correct"].to_numpy()
        out.append(Table(pool_id, query_id, k, prob, ok))
    return out


def replay(t: Table, mode: str, estimator: str, budget: int, options: dict, seed: int) -> tuple[np.ndarray, int, str]:
    """Run one case through the audit's reduction with values from the table: (phi, evaluations, stop)."""
    values = t.probability if mode == "probability" else t.correct.astype(float)
    k = t.k
    ctx = FrozenContext(t.pool_id, t.query_id, tuple(f"m{i}" for i in range(k)), ("",) * k, (0.0,) * k,
                        tuple(range(1, k + 1)), (None,) * k, "h")
    case = Case(Query(t.query_id, t.pool_id, "?", "a", ("a", "b")), ctx, seed)
    plan = make_plan(k, 96 if estimator == "adaptive" else 16, estimator, seed=seed, budget=budget,
                     prior=options.get("prior", 0.0), utility=mode,
                     rule=options.get("rule", "check"))
    st = CaseState(case, plan, TAU, DEFAULT_Z)
    while (need := advance(st, TAU, DEFAULT_Z)) is not None:
        st.record(need.masks, values[need.masks], t.correct[need.masks])
    return st.phi, st.evaluations, st.stop or ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--locomo", required=True)
    ap.add_argument("--tables", required=True, help="folder of the exact audits, one per conversation (filled once)")
    ap.add_argument("--tune", default="conv-26,conv-30", help="conversations the settings were chosen on")
    ap.add_argument("--held-out", default="conv-41,conv-44,conv-47", help="conversations not used for tuning")
    ap.add_argument("--seeds", type=int, default=2, help="replays per case (case seed shifted by 0..seeds-1)")
    ap.add_argument("--configs", default="", help="labels to run, separated by ; (labels hold commas)")
    ap.add_argument("--per-conversation", action="store_true",
                    help="one table per conversation (a mean over a subset can hide a conversation that misses)")
    ap.add_argument("--out", default="bench_adaptive")
    args = ap.parse_args()
    subsets = {"tuned": args.tune.split(","), "held-out": args.held_out.split(",")}
    if args.per_conversation:
        subsets = {c: [c] for c in [*subsets["tuned"], *subsets["held-out"]] if c}
    tables_dir, out = Path(args.tables), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cases: dict[str, list[Table]] = {}
    for name, convs in subsets.items():
        cases[name] = []
        for c in convs:
            if not (tables_dir / c / "manifest.json").exists():
                t0 = time.perf_counter()
                exact_tables(args.locomo, c, tables_dir / c)
                print(f"exact tables {c}: {time.perf_counter() - t0:.0f} s", flush=True)
            cases[name] += [t for t in load_tables(tables_dir / c) if t.k == 10]
    wanted = set(args.configs.split(";")) if args.configs else None
    configs = [c for c in CONFIGS if wanted is None or c[0] in wanted]
    results = []
    for name, tabs in cases.items():
        for mode in MODES:
            exact = {}
            for t in tabs:
                v = t.probability if mode == "probability" else t.correct.astype(float)
                exact[t.query_id] = shapley_exact(v) < -TAU
            n_harm = sum(bool(h.any()) for h in exact.values())
            print(f"\n{name} ({','.join(subsets[name])}), {len(tabs)} cases at K=10, utility {mode}; exact harmful set "
                  f"non-empty in {n_harm}", flush=True)
            print(f"  {'estimator':28s} {'evals/case':>10s} {'max':>5s} {'same set as exact':>18s} {'stops':s}")
            for label, est, budget, opts in configs:
                t0 = time.perf_counter()
                agree, evals, stops = [], [], {}
                for t in tabs:
                    base = case_seed(0, t.pool_id, t.query_id)
                    for s in range(args.seeds):
                        phi, n, stop = replay(t, mode, est, budget, opts, base + s)
                        agree.append(bool(np.array_equal(phi < -TAU, exact[t.query_id])))
                        evals.append(n)
                        stops[stop] = stops.get(stop, 0) + 1
                row = {"subset": name, "conversations": subsets[name], "mode": mode, "config": label,
                       "estimator": est, "budget": budget, "options": opts, "cases": len(tabs), "seeds": args.seeds,
                       "evaluations_per_case": float(np.mean(evals)), "max_evaluations": int(np.max(evals)),
                       "agreement": float(np.mean(agree)), "stops": stops, "seconds": time.perf_counter() - t0}
                results.append(row)
                print(f"  {label:28s} {row['evaluations_per_case']:10.1f} {row['max_evaluations']:5d} "
                      f"{100 * row['agreement']:17.1f}% {stops}", flush=True)
                (out / "bench_adaptive.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
