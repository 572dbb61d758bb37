"""`meclear`: the command line over the library. `meclear audit` with no arguments audits the bundled sample pool."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

from pipeline.agents import AGENTS
from pipeline.agents.utility import UTILITY_MODES
from pipeline.errors import MeClearError


def _add_agent_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--agent", choices=AGENTS, default="reader", help="agent whose answers define v(S) (default: reader)")
    p.add_argument("--model", help="model path or hub name for --agent vllm/transformers")
    p.add_argument("--agent-option", action="append", default=[], metavar="KEY=VALUE",
                   help="extra agent setting, e.g. dtype=bfloat16 or max_model_len=4096 (repeatable)")
    p.add_argument("--executor", choices=("ray", "local"), default="ray", help="Ray actor pool (default) or in process")
    p.add_argument("--actors", type=int, default=0, help="agent actors (0: one per free CPU, or per GPU for LLMs)")
    p.add_argument("--gpus-per-actor", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")


def _agent_options(args: argparse.Namespace) -> dict:
    import yaml

    opts = {}
    if args.model:
        opts["model"] = args.model
    for kv in args.agent_option:
        key, sep, value = kv.partition("=")
        if not sep:
            raise MeClearError(f"--agent-option {kv!r}: expected KEY=VALUE")
        opts[key] = yaml.safe_load(value)  # numbers and booleans as such
    if getattr(args, "agent", None) in ("vllm", "transformers") and isinstance(opts.get("model"), str):
        from pipeline.agents.models import resolve_model

        # Here, in the driver, so a GGUF is converted once before the actors start (they then load the folder).
        opts["model"] = resolve_model(opts["model"])
    return opts


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meclear", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    a = sub.add_parser("audit", help="attribute harmful retrieved memories and pick verified clearances",
                       description="Audit memory pools: without --memories/--queries/--locomo, the bundled sample pool.")
    a.add_argument("--memories", action="append", default=[], help="memory pool file or folder (JSONL/Parquet)")
    a.add_argument("--queries", action="append", default=[], help="query set file or folder (JSONL/Parquet)")
    a.add_argument("--locomo", help="LoCoMo json (e.g. locomo10.json) instead of memories/queries")
    a.add_argument("--conversations", default="", help="LoCoMo sample_ids to keep, comma separated")
    a.add_argument("--locomo-options", type=int, default=4, help="options per LoCoMo query (0: open answers)")
    a.add_argument("--max-queries", type=int, default=0, help="audit only the first N queries (0: all)")
    a.add_argument("--out", default="meclear-out/audit", help="run folder (default: meclear-out/audit)")
    a.add_argument("--top-k", type=int, default=5, help="retrieval budget K (players per case)")
    a.add_argument("--permutations", type=int, default=16, help="permutation budget L")
    a.add_argument("--estimator", choices=("auto", "exact", "permutation"), default="auto")
    a.add_argument("--antithetic", action="store_true", help="antithetic permutation pairs")
    a.add_argument("--tau", type=float, default=0.05, help="harm tolerance: harmful when shapley < -tau")
    a.add_argument("--kappa", type=float, default=0.05, help="LOO screen: |loo| <= kappa is inconclusive")
    a.add_argument("--utility", choices=UTILITY_MODES, default="probability")
    a.add_argument("--dense", choices=("auto", "on", "off"), default="auto", help="MiniLM dense retrieval")
    a.add_argument("--batch-size", type=int, default=256, help="coalitions per actor task")
    _add_agent_args(a)
    a.set_defaults(func=cmd_audit)

    from pipeline import eval_cli

    eval_cli.add_parser(sub, _add_agent_args, _agent_options)

    p = sub.add_parser("probe", help="does an LLM agent's answer follow its memories? (letter vs cloze scoring)",
                       description="Run the context-sensitivity probe under letter and cloze scoring, in process.")
    p.add_argument("--agent", choices=("transformers", "vllm"), default="transformers")
    p.add_argument("--model", required=True, help="model folder, .gguf file or smollm2-135m-instruct")
    p.add_argument("--agent-option", action="append", default=[], metavar="KEY=VALUE", help="extra agent setting")
    p.set_defaults(func=cmd_probe)
    return parser


def cmd_probe(args: argparse.Namespace) -> int:
    from pipeline.agents import AgentSpec, build_agent
    from pipeline.agents.probe import follow_rate, recommend

    opts = _agent_options(args)
    results = {}
    for scoring in ("letter", "cloze"):
        agent = build_agent(AgentSpec(args.agent, {**opts, "scoring": scoring}))
        try:
            results[scoring] = follow_rate(agent)
        finally:
            agent.close()
        r = results[scoring]
        print(f"  {scoring:<7} follow rate {r['follow_rate']:.3f} ({r['followed']}/{r['requests']}), "
              f"mean P(stated) {r['stated_prob']:.3f}, items answered identically whatever the memory "
              f"{r['blind_items']}/{r['items']}")
    print(f"  recommended scoring: {recommend(results)}")
    return 0


def cmd_audit(args: argparse.Namespace) -> int:
    from pipeline.audit import AuditConfig
    from pipeline.runner import InputSpec, audit

    inputs = InputSpec(
        memories=args.memories, queries=args.queries, locomo=args.locomo,
        conversations=[c for c in args.conversations.split(",") if c], locomo_options=args.locomo_options,
        max_queries=args.max_queries,
    )
    config = AuditConfig(
        top_k=args.top_k, permutations=args.permutations, estimator=args.estimator, antithetic=args.antithetic,
        tau=args.tau, kappa=args.kappa, seed=args.seed, utility=args.utility, dense=args.dense, agent=args.agent,
        agent_options=_agent_options(args), executor=args.executor, actors=args.actors,
        gpus_per_actor=args.gpus_per_actor, batch_size=args.batch_size,
    )
    what = "the bundled sample pool" if inputs.is_sample else (args.locomo or ", ".join(args.memories))
    print(f"meclear audit: {what}; agent={args.agent}, K={args.top_k}, L={args.permutations}, utility={args.utility}")
    t = time.perf_counter()
    result = audit(inputs, config, args.out, progress=not args.no_progress)
    wall = time.perf_counter() - t
    print_summary(result, wall)
    return 0


def print_summary(result, wall: float) -> None:
    rows = [
        ("queries audited", result.cases),
        ("harmful memories found", result.harmful),
        ("queries with harmful memories", result.cases_with_harm),
        ("queries answered wrongly with full context", result.failing),
        ("clearances that recovered the answer", result.recovered),
        ("coalitions evaluated (reused from earlier runs)", f"{result.evaluated} ({result.reused})"),
        ("max agent evaluations per query", result.max_evaluations),
        ("wall time", f"{wall:.1f} s"),
    ]
    width = max(len(r[0]) for r in rows)
    print()
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    cleared = [c for c in result.clearances if c["cleared"]]
    if cleared:
        print("\n  query                      cleared                                utility before -> after  recovered")
        for c in cleared[:12]:
            ids = ",".join(c["cleared"])
            print(f"  {c['pool_id'] + '/' + c['query_id']:<26} {ids[:38]:<38} "
                  f"{c['baseline_utility']:.3f} -> {c['cleared_utility']:.3f}        {c['recovered']}")
        if len(cleared) > 12:
            print(f"  ... {len(cleared) - 12} more in clearances/")
    print(f"\n  outputs: {Path(result.out).resolve()}  (run {result.run_id})")
    print("  datasets: contexts/ utilities/ attributions/ interactions/ clearances/ manifest.json")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    try:
        return args.func(args)
    except MeClearError as exc:
        print(f"meclear: error: {exc}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
