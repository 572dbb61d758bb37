"""Scale benchmark: a synthetic pool of N queries (LoCoMo-like, pipeline.testing.synth), audited cold then warm.

    PYTHONPATH=. python jobs/bench_scale.py --queries 10000 --out /tmp/bench_scale [--dense on] [--executor local]

"cold" starts from an empty embedding cache and an empty output folder; "warm" audits the same pool into a new output
folder with the cache the cold run filled (a later night over an unchanged pool). Each phase runs in a fresh process,
so its peak RSS is its own (ru_maxrss of the driver; with --executor local the reader agent runs in it too).
Prints a table and writes <out>/bench_scale.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

FIELDS = ("retrieval_s", "retrieval_embed_s", "retrieval_texts_embedded", "first_case_s", "evaluate_s", "write_s",
          "total_s")


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def run_phase(args: argparse.Namespace, phase: str) -> dict:
    from pipeline.audit.run import AuditConfig, InputSpec, audit

    root = Path(args.out)
    mem, qry = root / "pool" / "memories.jsonl", root / "pool" / "queries.jsonl"
    cfg = AuditConfig(top_k=args.top_k, dense=args.dense, executor=args.executor, agent="reader",
                      utility="probability")
    t = time.perf_counter()
    res = audit(InputSpec(memories=[str(mem)], queries=[str(qry)]), cfg, root / f"out-{phase}", progress=False)
    wall = time.perf_counter() - t
    row = {"phase": phase, "queries": res.cases, "coalitions": res.evaluated, "wall_s": wall,
           "coalitions_per_s": res.evaluated / wall if wall else 0.0,
           "eval_coalitions_per_s": res.evaluated / res.timings["evaluate_s"] if res.timings["evaluate_s"] else 0.0,
           "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
           "output_mb": _size(root / f"out-{phase}") / 2**20}
    row.update({k: res.timings.get(k, 0.0) for k in FIELDS})
    return row


def main() -> None:
    from pipeline.retrieval.frozen import DEFAULT_TOP_K

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--queries", type=int, default=10_000)
    ap.add_argument("--top-k", type=int, default=DEFAULT_TOP_K)
    ap.add_argument("--dense", choices=("on", "off"), default="on")
    ap.add_argument("--executor", choices=("local", "ray"), default="local")
    ap.add_argument("--out", default="bench_scale")
    ap.add_argument("--phase", choices=("cold", "warm"), help=argparse.SUPPRESS)  # internal: one phase, JSON out
    args = ap.parse_args()
    root = Path(args.out)
    if args.phase:
        print(json.dumps(run_phase(args, args.phase)))
        return
    from pipeline.testing.synth import write_jsonl

    write_jsonl(root / "pool", args.queries)
    env = {**os.environ, "MECLEAR_CACHE": str(root / "cache")}
    if (root / "cache").exists():
        import shutil

        shutil.rmtree(root / "cache")
    rows = []
    for phase in ("cold", "warm"):
        if (root / f"out-{phase}").exists():
            import shutil

            shutil.rmtree(root / f"out-{phase}")
        cmd = [sys.executable, __file__, *sys.argv[1:], "--phase", phase]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    cols = ("phase", "queries", "coalitions", "retrieval_s", "retrieval_texts_embedded", "evaluate_s", "write_s",
            "wall_s", "coalitions_per_s", "peak_rss_mb", "output_mb")
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(f"{r[c]:.1f}" if isinstance(r[c], float) else str(r[c]) for c in cols))
    (root / "bench_scale.json").write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "phase"},
                                                      "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
