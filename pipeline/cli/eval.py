"""`meclear eval`: the FI-LoCoMo benchmark (fault-injected LoCoMo) over MeClear and the paper's baselines.

A thin layer over `pipeline.bench.run`: parse and validate the flags into an EvalConfig, run, print the headline.
"""

from __future__ import annotations

import argparse
import time

from pipeline.audit.settings import field_default
from pipeline.core.errors import ConfigError
from pipeline.core.text import safe
from pipeline.retrieval.frozen import DENSE_MODES


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def _ints(flag: str, value: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in _csv(value))
    except ValueError:
        raise ConfigError(f"{flag} {value!r}: expected comma-separated integers, e.g. 4,8,16") from None


def add_parser(sub, add_agent_args, agent_options) -> None:
    from pipeline.bench.config import EvalConfig

    def d(name: str):  # defaults are declared once, on EvalConfig
        return field_default(EvalConfig, name)

    e = sub.add_parser(
        "eval", help="run the FI-LoCoMo benchmark (fault-injected LoCoMo) with bootstrap intervals",
        description="FI-LoCoMo: inject direct, redundant and joint faults into LoCoMo pools, verify them causally "
                    "under the agent, run MeClear and the baselines on every case, and report the paper's metrics "
                    "with 95% two-level cluster-bootstrap intervals. Writes cases.parquet, summary.json, summary.md "
                    "and figure.png to --out. --executor defaults to local here (fastest on small machines); use "
                    "--executor ray to shard over Ray actors.")
    e.add_argument("--locomo", required=True, help="LoCoMo json (e.g. locomo10.json); read only")
    e.add_argument("--out", required=True, help="output folder")
    e.add_argument("--methods", default=",".join(d("methods")),
                   help="comma list (default %(default)s); 'meclear' = meclear_l<L> for each budget + "
                        "meclear_exact, 'loo' = loo + loo_threshold, 'controls' = position + random + oracle; "
                        "single names like meclear_l8 or position also work")
    e.add_argument("--utility", default=",".join(d("utility")), help="utility modes, comma list (default %(default)s)")
    e.add_argument("--conversations", default="", help="LoCoMo sample_ids to use, comma separated (default all)")
    e.add_argument("--max-cases", type=int, default=d("max_cases"),
                   help="keep at most N cases PER MECHANISM over the whole run, in file order (0: all)")
    e.add_argument("--max-queries", type=int, default=d("max_queries"),
                   help="try at most the first N eligible queries of each conversation (0: all); bounds the build "
                        "with an expensive agent")
    e.add_argument("--replicates", type=int, default=d("replicates"), help="bootstrap replicates (default %(default)s)")
    e.add_argument("--permutation-budgets", default=",".join(map(str, d("budgets"))),
                   help="MeClear permutation budgets L (default %(default)s)")
    e.add_argument("--budgets", default="",
                   help="agent evaluations per case, comma list (e.g. 16,32,64,128,256): the budgeted benchmark; every "
                        "estimator of the audit, ContextCite and ProxySPEX runs at every budget, clearance checks "
                        "included; exact enumeration only at K <= 12; adds budget curves (summary, curves_<mode>.png)")
    e.add_argument("--redundancy", default="",
                   help="fault records per redundant conflict, r >= 2; a comma list builds one redundant variant per r "
                        "(default 2, or 2,3 with --budgets)")
    e.add_argument("--top-k", type=int, default=d("top_k"), help="retrieval budget K (default %(default)s)")
    e.add_argument("--tau", type=float, default=d("tau"), help="harm tolerance tau")
    e.add_argument("--kappa", type=float, default=d("kappa"), help="LOO screen tolerance kappa")
    e.add_argument("--filter-threshold", type=float, default=d("filter_threshold"),
                   help="relevance filter (agents without drop_memories): drop memories sharing fewer than this "
                        "fraction of the question's content words")
    e.add_argument("--dense", choices=DENSE_MODES, default=d("dense"), help="MiniLM dense retrieval")
    add_agent_args(e)
    # In process by default: on 2 vCPUs one process with single-threaded torch/BLAS was measured fastest (3 LoCoMo
    # conversations: 148 s local, 188 s on 2 Ray actors, 214 s local with default thread pools). --executor ray shards
    # conversations and case chunks over Ray actors (a cluster, or a bigger machine).
    e.set_defaults(func=lambda args: cmd_eval(args, agent_options), executor="local")


def config_from_args(args: argparse.Namespace, agent_options) -> "EvalConfig":  # noqa: F821
    from pipeline.bench.config import EvalConfig

    if args.max_cases < 0:
        raise ConfigError(f"--max-cases {args.max_cases}: must be >= 0")
    if args.max_queries < 0:
        raise ConfigError(f"--max-queries {args.max_queries}: must be >= 0")
    if args.gpus_per_actor < 0:
        raise ConfigError(f"--gpus-per-actor {args.gpus_per_actor}: must be >= 0")
    return EvalConfig(
        locomo=args.locomo, conversations=tuple(_csv(args.conversations)), max_cases=args.max_cases,
        max_queries=args.max_queries, methods=tuple(_csv(args.methods)), utility=tuple(_csv(args.utility)),
        budgets=_ints("--permutation-budgets", args.permutation_budgets), seed=args.seed, replicates=args.replicates,
        eval_budgets=_ints("--budgets", args.budgets),
        top_k=args.top_k, redundancy=_ints("--redundancy", args.redundancy) or None, tau=args.tau, kappa=args.kappa,
        filter_threshold=args.filter_threshold, dense=args.dense, agent=args.agent, agent_options=agent_options(args),
        executor=args.executor, actors=args.actors, gpus_per_actor=args.gpus_per_actor,
    )


def cmd_eval(args: argparse.Namespace, agent_options) -> int:
    from pipeline.bench.run import evaluate

    config = config_from_args(args, agent_options)
    print(f"meclear eval: {safe(args.locomo)}; agent={config.agent}, methods={','.join(config.methods)}, "
          f"utility={','.join(config.utility)}, executor={config.executor}")
    t = time.perf_counter()
    summary = evaluate(config, args.out, progress=not args.no_progress)
    print_headline(summary, time.perf_counter() - t, args.out)
    return 0


def print_headline(summary: dict, wall: float, out: str) -> None:
    cases = ", ".join(f"{m} {c['kept']}/{c['tried']}" for m, c in summary["cases"].items())
    ex = summary["excluded"]
    print(f"\n  cases kept/tried: {cases}; from {summary['conversations']['with_cases']} conversations; excluded "
          f"(full context right again): {ex['total']}; scored {summary['n_scored_cases']}")
    pos = summary["fault_positions"]["overall"]["counts"]
    print(f"  fault records per context position: {pos}; agent requests: "
          + ", ".join(f"{k} {v}" for k, v in summary["agent_calls"].items()))
    for mode, body in summary["utility_modes"].items():
        print(f"\n  utility={mode:<12} recall@|M|  thresholded  rank-1/2/3 coverage   recovery  redundant recall"
              "  evals/case")
        for name, e in body["methods"].items():
            o, red = e["overall"], e["by_mechanism"].get("redundant")
            rr = f"{100 * red['recall_at_m']['value']:6.1f}%" if red else "     -"
            cov = "/".join(f"{100 * o[f'rank{r}_coverage']['value']:.0f}" for r in (1, 2, 3))
            print(f"  {name:<22} {100 * o['recall_at_m']['value']:6.1f}%   "
                  f"{100 * o['recall_at_m_thresholded']['value']:6.1f}%   {cov:>14}%   "
                  f"{100 * o['task_recovery']['value']:6.1f}%  {rr:>14}  {o['evaluations_per_case']['value']:8.1f}")
    print(f"\n  wall time {wall:.1f} s; outputs in {safe(out)}: cases.parquet summary.json summary.md figure.png")
