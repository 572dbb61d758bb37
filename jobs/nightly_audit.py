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

from pipeline.cli import print_summary, safe
from pipeline import signals
from pipeline.errors import EXIT_CASE_ERRORS, EXIT_DISK_FULL, MeClearError
from pipeline.store.outdir import disk_full
from pipeline.audit import audit, load_job_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="YAML with inputs, audit and out")
    parser.add_argument("--reuse", action="append", default=[], metavar="PREVIOUS_OUT",
                        help="earlier run folder whose unchanged utilities are reused (repeatable)")
    parser.add_argument("--no-progress", action="store_true", help="no progress output")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        with signals.handled():  # `ray job stop` sends SIGTERM: the same cleanup and one line as Ctrl-C
            job = load_job_config(args.config)
            t = time.perf_counter()
            result = audit(job.inputs, job.audit, job.out, progress=not args.no_progress, reuse=args.reuse)
    except MeClearError as exc:
        print(f"nightly_audit: error: {safe(exc)}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt as exc:
        line, code = signals.stopped_line("nightly_audit", exc)
        print(line, file=sys.stderr)
        return code
    except OSError as exc:
        line = disk_full(exc)
        if line is None:
            raise
        print(f"nightly_audit: error: {safe(line)}", file=sys.stderr)
        return EXIT_DISK_FULL
    print_summary(result, time.perf_counter() - t)
    return EXIT_CASE_ERRORS if result.failed else 0


if __name__ == "__main__":
    sys.exit(main())
