"""vLLM engine defaults on CPU, measured (see benchmarks/engine.py): start-up and coalitions/s per variant.

    python jobs/bench_engine.py --model smollm2-135m-instruct                  # every variant, 2 sample cases
    python jobs/bench_engine.py --model smollm2-135m-instruct --variants default,bind-all --cases 3
    python jobs/bench_engine.py --model smollm2-135m-instruct --floor --locomo locomo10.json   # floor ratio
    python jobs/bench_engine.py --model smollm2-135m-instruct --builder --locomo locomo10.json --max-queries 8

--floor: one K=5 LoCoMo case under cloze (the step method first, then option requests alone, then the audit's default
with a prefix request per coalition) and letter scoring, on an engine with glibc malloc and then on one with tcmalloc
preloaded (--malloc): prompt and uncached tokens, the FLOPs they imply, the GEMM rate measured in the same run
(torch's matmul or vLLM's oneDNN GEMM, the faster), the time and its ratio to that floor (see benchmarks/floor.py).

--builder: the FI-LoCoMo cases of one conversation (its first --max-queries eligible queries) built twice on one
engine, "before" with per-candidate causal checks and "after" with the wave-batched ones, each from empty caches:
requests and engine calls by phase, tokens, wall seconds per clean-checked query, the floor; the cases must be
identical both ways (exit 1 otherwise; see benchmarks.build_cost).

Prints a Markdown table and writes JSON (--out). Not a test; variants run one after another, each in a fresh process,
so compare ratios from one run. The first variant is the reference for the ratio and the answer agreement.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# benchmarks/ is not in the wheel: the harness and the library from this checkout (docs/architecture.md)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.engine import VARIANTS, format_table, report, run_all  # noqa: E402


def _write(report: dict, table: str, out: str) -> None:
    Path(out).write_text(json.dumps(report, indent=2))
    print(table)
    print(f"\nreport: {Path(out).resolve()}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="model folder, smollm2-135m-instruct or PATH.gguf")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    p.add_argument("--cases", type=int, default=2, help="sample-pool cases answered per pass (default 2)")
    p.add_argument("--top-k", type=int, default=5, help="memories per case (2^K coalitions; default 5)")
    p.add_argument("--floor", action="store_true", help="the floor-ratio benchmark instead of the variants")
    p.add_argument("--builder", action="store_true", help="the case-building benchmark instead of the variants")
    p.add_argument("--locomo", help="LoCoMo json (--floor, --builder)")
    p.add_argument("--conversation", default="conv-26", help="LoCoMo sample_id (--floor, --builder; default conv-26)")
    p.add_argument("--max-queries", type=int, default=8,
                   help="eligible queries of the conversation clean-checked (--builder; default 8)")
    p.add_argument("--prefetch", default="off,wave,groups",
                   help="ways to build, 'off' (before) first (--builder; default off,wave,groups)")
    p.add_argument("--dense", default="auto", choices=("auto", "on", "off"),
                   help="MiniLM in retrieval, as for meclear eval (--builder; default auto)")
    p.add_argument("--query-index", type=int, default=0, help="which eligible query of it (--floor; default 0)")
    p.add_argument("--passes", type=int, default=3, help="timed passes per method, cache emptied each (--floor)")
    p.add_argument("--malloc", default="glibc,auto",
                   help="one engine per MECLEAR_CPU_MALLOC value, the first is the one before (--floor; default "
                        "glibc,auto: glibc malloc, then tcmalloc where the system has it)")
    p.add_argument("--dtype", default="auto",
                   help="the agent's dtype (--floor, --builder; default auto: bfloat16 on a CPU with native bfloat16, "
                        "float32 on one without; float32 on a bfloat16 CPU shows what the others get)")
    p.add_argument("--out", default="bench-engine.json", help="JSON report (default bench-engine.json)")
    args = p.parse_args(argv)
    if args.builder:
        from benchmarks.build_cost import check_ways, format_builder, run_builder_bench

        try:
            ways = check_ways(w for w in args.prefetch.split(",") if w)
        except ValueError as exc:
            p.error(f"--prefetch: {exc}")
        if not args.locomo or args.max_queries < 1 or args.top_k < 2:
            p.error("--builder needs --locomo; --max-queries must be >= 1 and --top-k >= 2")
        rep = run_builder_bench(args.model, args.locomo, args.conversation, args.max_queries, args.top_k, args.dense,
                                ways=ways, dtype=args.dtype)
        _write(rep, format_builder(rep), args.out)
        return 0 if rep["identical"] else 1  # the cases must be the same every way
    if args.floor:
        mallocs = [m for m in args.malloc.split(",") if m]
        if not args.locomo or args.passes < 1 or args.top_k < 1:
            p.error("--floor needs --locomo; --passes and --top-k must be >= 1")
        if not mallocs or set(mallocs) - {"glibc", "auto"}:
            p.error(f"--malloc must list glibc and/or auto, got {args.malloc!r}")
        from benchmarks.floor import format_floor, run_floor_case

        rep = run_floor_case(args.model, args.locomo, args.conversation, args.top_k, args.passes, args.query_index,
                             mallocs, dtype=args.dtype)
        _write(rep, format_floor(rep), args.out)
        return 0
    names = [n for n in args.variants.split(",") if n]
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown or not names or args.cases < 1 or args.top_k < 1:
        p.error(f"--variants must name some of {', '.join(VARIANTS)} (got {unknown or names}); --cases, --top-k >= 1")
    from pipeline.agents.models import resolve_model

    model = resolve_model(args.model)  # converted once, before any variant starts
    results = run_all(names, model, args.cases, args.top_k)
    Path(args.out).write_text(json.dumps({"model": args.model, "cases": args.cases, "top_k": args.top_k,
                                          **report(results)}, indent=2))
    print(format_table(results))
    print(f"\nreport: {Path(args.out).resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
