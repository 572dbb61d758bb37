"""`meclear report` and `meclear curate`: subcommands added to the main parser."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from pipeline.core.errors import InputError
from pipeline.core.extras import require
from pipeline.core.text import safe
from pipeline.store import manifest as manifests
from pipeline.store import writer
from pipeline.store.outdir import REPORT, check_file_out


def add_parsers(sub) -> None:
    r = sub.add_parser("report", help="one self-contained HTML report of an audit run (or of a `meclear eval` folder)",
                       description="Render RUN_DIR (an audit run or an eval output) to a single offline HTML file.")
    r.add_argument("run_dir", help="an audit run folder or a `meclear eval` output folder")
    r.add_argument("--previous", action="append", default=[], metavar="RUN_DIR",
                   help="earlier runs for the night-over-night trends (repeatable)")
    r.add_argument("--out", help="HTML file to write (default: RUN_DIR/report.html)")
    r.add_argument("--figures", choices=("harm", "all", "none"), default="harm",
                   help="per-query figures for queries with a harmful memory (default), every query, or none")
    r.add_argument("--jobs", type=int, default=0, help="processes drawing figures (0: one per CPU, at most 8)")
    r.add_argument("--no-progress", action="store_true", help="no progress output")
    r.set_defaults(func=cmd_report)

    c = sub.add_parser("curate",
                       help="rank memories by the harm they do across queries and runs (proposes, never edits)")
    c.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="audit run folders to aggregate")
    c.add_argument("--out", required=True, help="Parquet file to write")
    c.add_argument("--top", type=int, default=15, help="rows of the printed table")
    c.set_defaults(func=cmd_curate)


def cmd_report(args: argparse.Namespace) -> int:
    # the page's figures are matplotlib's: a missing extra is one line here, not a traceback from deep in build
    require("eval", [("matplotlib", "matplotlib")], "meclear report")
    from pipeline.report import build, data

    run = Path(args.run_dir)
    t = time.perf_counter()
    out = Path(args.out) if args.out else run / REPORT
    if build.is_eval(run):
        if args.previous:
            raise InputError(run, "", None, "is an eval output; --previous applies to audit runs only")
        check_file_out(out, "report", [run], own_report_of=run)
        text, what = build.eval_report(run), "benchmark report"
    else:
        for p in [run, *args.previous]:
            if p != run and build.is_eval(p):
                raise InputError(p, "", None, "is an eval output; --previous takes audit run folders only")
            if not data.is_run(p):
                raise InputError(p, "", None, "is neither an audit run (a manifest and clearances/) nor an eval "
                                              "output (summary.json, cases.parquet)")
            manifests.finished(p)  # every run read, --previous too, must have finished (one line otherwise)
        data.check_distinct([run, *args.previous])
        check_file_out(out, "report", [run, *map(Path, args.previous)], own_report_of=run)
        text, stats = build.audit_report(run, args.previous, args.figures, not args.no_progress, args.jobs)
        what = f"audit report, {stats['queries']} queries, {stats['figures']} query figures"
    out.parent.mkdir(parents=True, exist_ok=True)
    writer.write_bytes_atomic(out, text.encode("utf-8"))
    print(f"meclear report: {safe(what)} -> {safe(out)} "
          f"({len(text.encode()) / 1e6:.1f} MB, {time.perf_counter() - t:.1f} s)")
    return 0


def cmd_curate(args: argparse.Namespace) -> int:
    from pipeline.report.curate import curate, print_table, write_curation
    from pipeline.report.data import check_distinct, is_run

    for p in args.run_dirs:
        if not is_run(p):
            raise InputError(p, "", None, "is not an audit run folder (a manifest and clearances/)")
        manifests.finished(p)
    check_distinct(args.run_dirs)
    check_file_out(Path(args.out), "curation", args.run_dirs)
    table = curate(args.run_dirs)
    write_curation(table, args.out)
    print_table(table, args.top)
    print(f"\n  {table.num_rows} memories harmful at least once -> {safe(args.out)} "
          "(a proposal; the memory bank is untouched)")
    return 0
