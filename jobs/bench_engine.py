"""vLLM engine defaults on CPU, measured (see pipeline.perf.engine): start-up and coalitions/s per variant.

    python jobs/bench_engine.py --model smollm2-135m-instruct                  # every variant, 2 sample cases
    python jobs/bench_engine.py --model smollm2-135m-instruct --variants default,bind-all --cases 3

Prints a Markdown table and writes JSON (--out). Not a test; variants run one after another, each in a fresh process,
so compare ratios from one run. The first variant is the reference for the ratio and the answer agreement.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pipeline.perf.engine import VARIANTS, format_table, report, run_all


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="model folder, smollm2-135m-instruct or PATH.gguf")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    p.add_argument("--cases", type=int, default=2, help="sample-pool cases answered per pass (default 2)")
    p.add_argument("--top-k", type=int, default=5, help="memories per case (2^K coalitions; default 5)")
    p.add_argument("--out", default="bench-engine.json", help="JSON report (default bench-engine.json)")
    args = p.parse_args(argv)
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
