"""The GPU check of a bare CUDA node: precision, coalitions/s and the floor ratio of the transformers agent on CUDA
(`benchmarks/gpu_check.py`). Needs only torch and transformers besides this repository (no Ray, no vLLM, no network).

    python jobs/gpu_check.py --model smollm2-135m-instruct --out gpu-check.json
    python jobs/gpu_check.py --model tiny          # the random test Llama, built offline

Exit 0: every precision check within tolerance; 1: a check out of tolerance; 2: no GPU (or a missing package), one
line. Prints a table and writes the JSON report to --out.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's source; benchmarks/ is not installed

from benchmarks.gpu_check import CheckSettings, run_check, table, write_report  # noqa: E402
from pipeline.core.errors import MeClearError  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    d = CheckSettings()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=d.model, help="smollm2-135m-instruct, tiny, or a model folder")
    p.add_argument("--cases", type=int, default=d.cases, help="synthetic K=5 cases (32 coalitions each)")
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--no-vllm", action="store_true", help="skip the vLLM agent even where vLLM is installed")
    p.add_argument("--out", default="gpu-check.json", help="JSON report")
    args = p.parse_args(argv)
    settings = CheckSettings(model=args.model, cases=args.cases, batch_size=args.batch_size, vllm=not args.no_vllm)
    try:
        with tempfile.TemporaryDirectory(prefix="gpu-check-") as work:
            report = run_check(settings, Path(work))
    except MeClearError as exc:
        print(str(exc).splitlines()[0], file=sys.stderr)
        return exc.exit_code
    print(table(report))
    write_report(report, Path(args.out))
    return 0 if all(r["ok"] for r in report["precision"]) else 1


if __name__ == "__main__":
    sys.exit(main())
