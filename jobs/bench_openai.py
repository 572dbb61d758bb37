"""Served-model throughput: `meclear audit --agent openai` on a `vllm serve` of a model (1..N actors, client
concurrencies, scoring methods) against `meclear audit --agent vllm` on the same model in-process
(benchmarks/served.py).

    python jobs/bench_openai.py                      # tiny random Llama on CPU: starts its own vllm serve on loopback
    python jobs/bench_openai.py --model /models/Qwen2.5-7B-Instruct --base-url http://10.0.0.5:8000/v1 \\
        --served-name Qwen/Qwen2.5-7B-Instruct --engine-option dtype=bfloat16 --actors 1,4 --concurrency 8,32

Prints a table and writes JSON (--out). Not a test: nothing is asserted. vLLM starts engine processes with spawn,
hence the __main__ guard.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

# benchmarks/ is not in the wheel: the harness and the library from this checkout (docs/architecture.md)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.served import ServedBenchConfig, format_report, run_benchmark  # noqa: E402
from pipeline.core.errors import MeClearError  # noqa: E402
from pipeline.core.text import safe  # noqa: E402
from pipeline.core.validation import key_values  # noqa: E402


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(",") if v.strip())


def main(argv: list[str] | None = None) -> int:
    d = ServedBenchConfig
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=d.model, help="model folder (the in-process side and the tokenizer), or 'tiny'")
    p.add_argument("--base-url", help="a running server of --model (default: start vllm serve on loopback)")
    p.add_argument("--served-name", help="the name the server lists the model under (default: --model)")
    p.add_argument("--max-queries", type=int, default=d.max_queries)
    p.add_argument("--top-k", type=int, default=d.top_k)
    p.add_argument("--actors", default="1,2", help="openai actor counts, comma separated")
    p.add_argument("--concurrency", default="8", help="requests in flight per actor, comma separated")
    p.add_argument("--methods", default="echo,top_ids", help="scoring methods (echo, top_ids, top)")
    p.add_argument("--top-logprobs", type=int, default=d.top_logprobs)
    p.add_argument("--repetitions", type=int, default=d.repetitions)
    p.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE",
                   help="in-process vLLM setting, mirrored on the server this job starts")
    p.add_argument("--out", default="bench-openai.json", help="JSON report (default bench-openai.json)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = ServedBenchConfig(
            model=args.model, base_url=args.base_url, served_name=args.served_name, max_queries=args.max_queries,
            top_k=args.top_k, actors=_ints(args.actors), concurrency=_ints(args.concurrency),
            methods=tuple(m for m in args.methods.split(",") if m), top_logprobs=args.top_logprobs,
            repetitions=args.repetitions, engine_options=key_values(args.engine_option, "--engine-option"))
        report = run_benchmark(config)
    except (MeClearError, ValueError) as exc:
        print(f"bench_openai: error: {safe(exc)}", file=sys.stderr)
        return getattr(exc, "exit_code", 2)
    Path(args.out).write_text(json.dumps(report, indent=2, default=str))
    print(format_report(report))
    print(f"\nreport: {Path(args.out).resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
