"""Adaptive vs exact Shapley at K=10 on a LoCoMo subset: evaluations per case and agreement of the harmful sets.

    PYTHONPATH=. python jobs/bench_adaptive.py --locomo /work/shared/data/locomo/locomo10.json --queries 36 \
        --out /tmp/bench_adaptive

Reader agent, BM25 retrieval (--dense off), in process. Prints a table and writes <out>/bench_adaptive.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import polars as pl

from pipeline.audit import AuditConfig, run_audit
from pipeline.evaluate import AgentWorker
from pipeline.pools import LocalPool
from pipeline.io.locomo import load_locomo


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--locomo", required=True)
    ap.add_argument("--queries", type=int, default=36, help="queries, taken evenly over the conversations")
    ap.add_argument("--offset", type=int, default=0,
                    help="start at this query (0 <= offset < stride): a disjoint subset of the same size for held-out checks")
    ap.add_argument("--top-k", type=int, default=10)
    ap.add_argument("--cap", type=int, default=96, help="adaptive: maximum permutations L (even: antithetic pairs)")
    ap.add_argument("--out", default="bench_adaptive")
    args = ap.parse_args()
    pools, queries = load_locomo(args.locomo)
    step = max(1, len(queries) // args.queries)
    if not 0 <= args.offset < step:
        ap.error(f"--offset {args.offset}: allowed 0..{step - 1} (the stride between chosen queries)")
    queries = queries[args.offset :: step][: args.queries]
    out = Path(args.out)
    rows = {}
    for est in ("exact", "adaptive"):
        cfg = AuditConfig(top_k=args.top_k, estimator=est, permutations=args.cap, dense="off", executor="local")
        ex = LocalPool(AgentWorker(cfg.agent_spec))
        t = time.perf_counter()
        res = run_audit(pools, queries, cfg, out / est, ex, f"reader-{est}", progress=False)
        wall = time.perf_counter() - t
        att = pl.read_parquet(out / est / "attributions").sort(["pool_id", "query_id", "position"])
        cl = pl.read_parquet(out / est / "clearances")
        rows[est] = {"att": att, "evals": cl["evaluations"].mean(), "wall_s": wall, "cases": res.cases}
    ex_h = rows["exact"]["att"].group_by(["pool_id", "query_id"]).agg(pl.col("harmful").sort_by("position"))
    ad_h = rows["adaptive"]["att"].group_by(["pool_id", "query_id"]).agg(pl.col("harmful").sort_by("position"))
    j = ex_h.join(ad_h, on=["pool_id", "query_id"], suffix="_ad")
    agree = sum(a == b for a, b in zip(j["harmful"].to_list(), j["harmful_ad"].to_list())) / j.height
    stops = rows["adaptive"]["att"].group_by(["pool_id", "query_id"]).agg(pl.col("stop_reason").first(),
                                                                            pl.col("permutations").first())
    summary = {
        "queries": len(queries), "offset": args.offset, "k": args.top_k, "cap": args.cap,
        "exact_evaluations_per_case": rows["exact"]["evals"],
        "adaptive_evaluations_per_case": rows["adaptive"]["evals"],
        "adaptive_mean_permutations": stops["permutations"].mean(),
        "stopped_by_separation": int((stops["stop_reason"] == "separation").sum()),
        "stopped_by_cap": int((stops["stop_reason"] == "cap").sum()),
        "harmful_set_agreement": agree,
        "exact_wall_s": rows["exact"]["wall_s"], "adaptive_wall_s": rows["adaptive"]["wall_s"],
    }
    for k, v in summary.items():
        print(f"{k:32s} {v:.3f}" if isinstance(v, float) else f"{k:32s} {v}")
    (out / "bench_adaptive.json").write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
