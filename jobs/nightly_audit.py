"""Nightly memory-health audit as a Ray job.

    ray job submit --address http://HEAD:8265 --runtime-env env.yaml -- \\
        python jobs/nightly_audit.py --config jobs/configs/nightly_audit.yaml

Under `ray job submit` RAY_ADDRESS is set and the audit joins that cluster; run directly, it starts a local Ray.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from pipeline.audit.run import audit, load_job_config
from pipeline.cli.main import print_summary, run_command
from pipeline.core.errors import EXIT_CASE_ERRORS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="YAML with inputs, audit and out")
    parser.add_argument("--reuse", action="append", default=[], metavar="PREVIOUS_OUT",
                        help="earlier run folder whose unchanged utilities are reused (repeatable)")
    parser.add_argument("--no-progress", action="store_true", help="no progress output")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    def body() -> int:
        job = load_job_config(args.config)
        t = time.perf_counter()
        result = audit(job.inputs, job.audit, job.out, progress=not args.no_progress, reuse=args.reuse)
        print_summary(result, time.perf_counter() - t)
        return EXIT_CASE_ERRORS if result.failed else 0

    # `ray job stop` sends SIGTERM: the same cleanup and one line as Ctrl-C, exit 143
    return run_command(body, "nightly_audit")


if __name__ == "__main__":
    sys.exit(main())
