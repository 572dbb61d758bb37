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
from pipeline.audit.settings import EXECUTORS, field_default
from pipeline.core import signals
from pipeline.core.errors import EXIT_CASE_ERRORS, EXIT_DISK_FULL, MeClearError
from pipeline.core.text import safe
from pipeline.core.validation import key_values
from pipeline.game.plan import ADAPTIVE_RULES, ESTIMATORS
from pipeline.retrieval.frozen import DENSE_MODES
from pipeline.store.manifest import FILE as manifest_file
from pipeline.store.outdir import disk_full


def _add_agent_args(p: argparse.ArgumentParser) -> None:
    from pipeline.audit.settings import RunSettings

    d = RunSettings()  # defaults are declared once, on the settings dataclasses
    p.add_argument("--agent", choices=AGENTS, default=d.agent, help="agent whose answers define v(S)")
    p.add_argument("--model", help="model path or hub name for --agent vllm/transformers; the served model's name for "
                                   "--agent openai")
    p.add_argument("--base-url", help="OpenAI-compatible endpoint for --agent openai, e.g. http://127.0.0.1:8000/v1 "
                                      "(API key from $MECLEAR_OPENAI_API_KEY or $OPENAI_API_KEY only)")
    p.add_argument("--agent-option", action="append", default=[], metavar="KEY=VALUE",
                   help="extra agent setting, e.g. dtype=bfloat16 or max_model_len=4096 (repeatable)")
    p.add_argument("--executor", choices=EXECUTORS, default=d.executor, help="Ray actor pool or in process")
    p.add_argument("--actors", type=int, default=d.actors,
                   help="agent actors (0: one per free CPU, or per GPU for LLMs)")
    p.add_argument("--gpus-per-actor", type=float, default=d.gpus_per_actor,
                   help="GPUs per agent actor (0: tensor_parallel_size for the vllm agent on a cluster with GPUs, "
                        "else CPU only)")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of permutation sampling and case order")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress output (on a non-terminal, progress is a plain line every 30 s)")


def _agent_options(args: argparse.Namespace) -> dict:
    opts = {}
    if args.model:
        opts["model"] = args.model
    if getattr(args, "base_url", None):
        opts["base_url"] = args.base_url
    opts.update(key_values(args.agent_option, "--agent-option"))
    if getattr(args, "agent", None) in ("vllm", "transformers") and isinstance(opts.get("model"), str):
        from pipeline.agents.models import resolve_model

        # Here, in the driver, so a GGUF is converted once before the actors start (they then load the folder).
        opts["model"] = resolve_model(opts["model"])
    return opts


def build_parser() -> argparse.ArgumentParser:
    from pipeline.audit.run import InputSpec
    from pipeline.audit.settings import AuditConfig

    d, i = AuditConfig(), InputSpec()  # defaults are declared once, on the settings dataclasses
    parser = argparse.ArgumentParser(prog="meclear", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    a = sub.add_parser("audit", help="attribute harmful retrieved memories and pick verified clearances",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                       description="Audit memory pools: without --memories/--queries/--locomo, the bundled sample "
                                   "pool. Exit codes: 0 done; 2 bad input, settings or --out (one line, nothing "
                                   "written); 3 finished but some cases failed (see errors/); 130 interrupted.")
    a.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="log at INFO level")
    a.add_argument("--memories", action="append", default=[], help="memory pool file or folder (JSONL/Parquet)")
    a.add_argument("--queries", action="append", default=[], help="query set file or folder (JSONL/Parquet)")
    a.add_argument("--mem0", action="append", default=[], metavar="PATH",
                   help="mem0 export (JSON list / {results: [...]} / JSONL; user_id = pool), with --queries")
    a.add_argument("--locomo", help="LoCoMo json file (e.g. locomo10.json) instead of memories/queries")
    a.add_argument("--conversations", default="", help="LoCoMo sample_ids to keep, comma separated")
    a.add_argument("--locomo-options", type=int, default=i.locomo_options,
                   help="options per LoCoMo query (0: open answers)")
    a.add_argument("--max-queries", type=int, default=i.max_queries, help="audit only the first N queries (0: all)")
    a.add_argument("--max-memory-chars", type=int, default=i.max_memory_chars,
                   help="longest memory text accepted; longer ones are input errors")
    a.add_argument("--out", default="meclear-out/audit",
                   help="run folder; a rerun into it resumes (locked while a run writes it)")
    a.add_argument("--reuse", action="append", default=[], metavar="PREVIOUS_OUT",
                   help="earlier run folder whose utilities are reused where their key is unchanged (repeatable)")
    a.add_argument("--top-k", type=int, default=d.top_k, help="retrieval budget K (players per case)")
    a.add_argument("--permutations", type=int, default=field_default(AuditConfig, "permutations"),
                   help="permutation budget L (0: 16; with --estimator adaptive, the cap 96)")
    a.add_argument("--estimator", choices=ESTIMATORS, default=d.estimator,
                   help="Shapley estimator (auto: exact for small K; with --budget, exact if 2^K fits, else the "
                        "measured best sampled one); adaptive: antithetic permutation pairs in rounds until every "
                        "Shapley value is "
                        "separated from -tau (|phi+tau| > z*SE), at most --permutations (even); screened: a screen of "
                        "12 permutations, then exact enumeration of the memories that matter, checked against every "
                        "evaluated coalition (docs/benchmark.md); sparseshap: Shapley values of a sparse order-2 "
                        "surrogate (auto's choice below a quarter of the game; below 8 evaluations per memory in "
                        "`correct` mode auto drops the LOO screen for it, named it keeps it); adjusted: the same plus "
                        "the residual's least-squares Shapley values (docs/method.md)")
    a.add_argument("--budget", type=_count_or_text, default=d.budget,
                   help="distinct agent evaluations per query, clearance checks included (0: none; at least K+2); "
                        "every estimator stays within it, clearances/ `evaluations` says what each query spent")
    a.add_argument("--adaptive-round", type=int, default=d.adaptive_round,
                   help="adaptive: permutations per round (even)")
    a.add_argument("--adaptive-z", type=float, default=d.adaptive_z, help="adaptive: z of the confidence bound")
    a.add_argument("--adaptive-prior", type=float, default=d.adaptive_prior,
                   help="adaptive: pseudo-draws of prior variance (range^2/4) added to each memory's SE (0: off)")
    a.add_argument("--adaptive-rule", choices=ADAPTIVE_RULES, default=d.adaptive_rule,
                   help="adaptive: how a case stops. check: after separation or 16 permutations, enumerate the "
                        "memories whose marginals exceed tau and stop when that restricted game explains every "
                        "evaluated coalition; separation: when every value is z SE from -tau (the paper's rule)")
    a.add_argument("--antithetic", action="store_true", default=d.antithetic, help="antithetic permutation pairs")
    a.add_argument("--tau", type=float, default=d.tau, help="harm tolerance: harmful when shapley < -tau")
    a.add_argument("--kappa", type=float, default=d.kappa, help="LOO screen: |loo| <= kappa is inconclusive")
    a.add_argument("--utility", choices=UTILITY_MODES, default=d.utility, help="utility v(S) of a coalition")
    a.add_argument("--dense", choices=DENSE_MODES, default=d.dense, help="MiniLM dense retrieval")
    a.add_argument("--batch-size", type=int, default=d.batch_size, help="coalitions per actor task")
    a.add_argument("--embed-actors", type=int, default=d.embed_actors,
                   help="--executor ray: Ray actors embedding texts the cache lacks (0: the driver embeds)")
    _add_agent_args(a)
    a.set_defaults(func=cmd_audit)

    from pipeline.cli import eval as eval_cli

    eval_cli.add_parser(sub, _add_agent_args, _agent_options)
    from pipeline.cli import report as report_cli

    report_cli.add_parsers(sub)

    p = sub.add_parser("probe", help="does an LLM agent's answer follow its memories? (letter vs cloze scoring)",
                       description="Run the context-sensitivity probe under letter and cloze scoring, in process.")
    p.add_argument("--agent", choices=("transformers", "vllm"), default="transformers", help="LLM agent to probe")
    p.add_argument("--model", required=True, help="model folder, .gguf file or smollm2-135m-instruct")
    p.add_argument("--agent-option", action="append", default=[], metavar="KEY=VALUE", help="extra agent setting")
    p.set_defaults(func=cmd_probe)
    return parser


def _count_or_text(text: str) -> int | str:
    """An integer, or the text itself, so the settings' validation reports a bad count in its one line (exit 2)
    rather than argparse's usage block."""
    try:
        return int(text)
    except ValueError:
        return text


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
    from pipeline.audit.run import InputSpec, audit
    from pipeline.audit.settings import AuditConfig

    inputs = InputSpec(
        memories=args.memories, queries=args.queries, locomo=args.locomo,
        conversations=[c for c in args.conversations.split(",") if c], locomo_options=args.locomo_options,
        max_queries=args.max_queries, max_memory_chars=args.max_memory_chars, mem0=args.mem0,
    )
    config = AuditConfig(
        top_k=args.top_k, permutations=args.permutations, estimator=args.estimator, antithetic=args.antithetic,
        tau=args.tau, kappa=args.kappa, seed=args.seed, utility=args.utility, dense=args.dense, agent=args.agent,
        agent_options=_agent_options(args), executor=args.executor, actors=args.actors,
        gpus_per_actor=args.gpus_per_actor, batch_size=args.batch_size, embed_actors=args.embed_actors,
        adaptive_round=args.adaptive_round, adaptive_z=args.adaptive_z, budget=args.budget,
        adaptive_prior=args.adaptive_prior, adaptive_rule=args.adaptive_rule,
    )
    what = "the bundled sample pool" if inputs.is_sample else (args.locomo or ", ".join(args.memories or args.mem0))
    print(f"meclear audit: {safe(what)}; agent={config.agent}, K={config.top_k}, L={config.permutations}, "
          f"budget={config.budget or 'none'}, estimator={config.estimator}, "
          f"utility={config.utility}")
    t = time.perf_counter()
    result = audit(inputs, config, args.out, progress=not args.no_progress, reuse=args.reuse)
    wall = time.perf_counter() - t
    print_summary(result, wall)
    return EXIT_CASE_ERRORS if result.failed else 0


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
    _print_clearances(result.summary)
    if result.failed:
        print(f"\n  {result.failed} queries failed and are in errors/ (first: "
              f"{safe(result.errors[0]['query_id'])}: {safe(result.errors[0]['reason'])})")
    print(f"\n  outputs: {safe(Path(result.out).resolve())}  (run {result.run_id})")
    print(f"  datasets: contexts/ utilities/ attributions/ interactions/ clearances/ errors/ {manifest_file}")


def _print_clearances(summary, limit: int = 12) -> None:
    """Lead with the failing queries the clearance recovered, then those it could not, then gains on correct ones.
    `summary`: the driver's counts and first rows (`pipeline.audit.reduce.ClearanceSummary`); all rows are in
    clearances/."""
    recovered = [c for c in summary.rows if c.recovered is True]
    if summary.recovered:
        print(f"\n  wrongly answered, recovered by the clearance ({summary.recovered}):")
        print("  query                      cleared                          answer before -> after (gold)")
        for c in recovered[:limit]:
            ids = safe(",".join(c.cleared))
            print(f"  {safe(c.pool_id + '/' + c.query_id):<26} {ids[:32]:<32} "
                  f"{str(c.answer_before)[:20]!r} -> {str(c.answer_after)[:20]!r} ({str(c.gold)[:20]!r})")
        if summary.recovered > limit:
            print(f"  ... {summary.recovered - limit} more in clearances/")
    if summary.unrecovered:
        why = ", ".join(f"{n} {r}" for r, n in sorted(summary.unrecovered.items(), key=lambda kv: -kv[1]))
        print(f"\n  wrongly answered, not recovered: {sum(summary.unrecovered.values())} ({why})")
    if summary.improved:
        print(f"  answered correctly already, clearance raised the utility: {summary.improved} (see clearances/)")


def safe_log_record(record: logging.LogRecord) -> bool:
    """A log filter: the message (which may quote ids, field names or paths from the inputs) printed through `safe`."""
    record.msg, record.args = safe(record.getMessage()), None
    return True


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    logging.captureWarnings(True)  # library warnings (they may quote input text) reach the console through the filter
    for handler in logging.getLogger().handlers:
        handler.addFilter(safe_log_record)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    return run_command(lambda: args.func(args), "meclear")


def run_command(body, prog: str) -> int:
    """Run a command's `body` as the CLI and the jobs do: its exit code; a MeClearError, a signal (Ctrl-C, SIGTERM,
    SIGHUP: the finally blocks below have shut the agents down and released the lock) or a full disk as one line
    `<prog>: ...` and its exit code (pipeline.core.errors)."""
    with signals.handled():  # SIGTERM and SIGHUP stop a run the way Ctrl-C does
        try:
            return body()
        except MeClearError as exc:
            print(f"{prog}: error: {safe(exc)}", file=sys.stderr)
            return exc.exit_code
        except KeyboardInterrupt as exc:
            line, code = signals.stopped_line(prog, exc)
            print(line, file=sys.stderr)
            return code
        except OSError as exc:
            line = disk_full(exc)
            if line is None:
                raise
            print(f"{prog}: error: {safe(line)}", file=sys.stderr)
            return EXIT_DISK_FULL

if __name__ == "__main__":
    sys.exit(main())
