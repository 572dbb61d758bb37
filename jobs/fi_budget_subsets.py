"""Budget curves of a finished `meclear eval --budgets` run, recomputed per subset of conversations: the ones the
estimator defaults were tuned on against the ones held out (issue 16: "report tuned and held-out subsets separately").

    env PYTHONPATH=. python jobs/fi_budget_subsets.py --run /tmp/fi-budget-k10-prob \
        --subset tuned=conv-26,conv-30 --rest held-out --reference kernelshap --out /tmp/fi-budget-k10-prob/subsets.json

Reads the run's cases.parquet (and the method list, bootstrap replicates and seed from its summary.json) and calls the
benchmark's own `pipeline.bench.curves.budget_curves` on each subset's rows, so every number is computed exactly as in
the run's summary (two-level cluster bootstrap, paired differences against ContextCite at the same budget). With few
conversations in a subset the cluster-level resampling has little to draw from: read its intervals as rough. Prints
each subset's curves table (summary.md format; the first, `all`, is every conversation of the run) with the paired
differences against ContextCite and each --reference (e.g. `--reference kernelshap`: is the default better than the
others, case by case), and writes them all to --out as JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import polars as pl

from pipeline.bench.curves import budget_curves, markdown


def _subsets(specs: list[str], rest: str | None, conversations: list[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for spec in specs:
        name, sep, convs = spec.partition("=")
        if not sep or not name or not convs:
            raise SystemExit(f"fi_budget_subsets: --subset {spec!r}: expected NAME=conv-a,conv-b")
        out[name] = [c for c in convs.split(",") if c]
        missing = sorted(set(out[name]) - set(conversations))
        if missing:
            raise SystemExit(f"fi_budget_subsets: --subset {name}: {', '.join(missing)} not in the run "
                             f"(it has {', '.join(conversations)})")
    if rest:
        taken = {c for convs in out.values() for c in convs}
        out[rest] = [c for c in conversations if c not in taken]
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", type=Path, required=True, help="output folder of `meclear eval --budgets`")
    ap.add_argument("--subset", action="append", default=[], help="NAME=conv-a,conv-b (repeatable)")
    ap.add_argument("--rest", default=None, help="name of the subset of every other conversation of the run")
    ap.add_argument("--reference", action="append", default=[],
                    help="a further curve to take paired differences against at the same budget (repeatable; "
                         "ContextCite always)")
    ap.add_argument("--out", type=Path, default=None, help="JSON output (default <run>/subsets.json)")
    args = ap.parse_args(argv)

    summary = json.loads((args.run / "summary.json").read_text())
    cfg = summary["config"]
    rows = pl.read_parquet(args.run / "cases.parquet").to_dicts()
    conversations = sorted({r["conversation"] for r in rows})
    references = ("contextcite", *args.reference)
    result = {}
    subsets = {"all": conversations, **_subsets(args.subset, args.rest, conversations)}
    for name, convs in subsets.items():
        sub = [r for r in rows if r["conversation"] in convs]
        curves = budget_curves(sub, tuple(cfg["methods"]), tuple(cfg["utility"]), cfg["replicates"], cfg["seed"],
                               references)
        n_cases = len({r["case_id"] for r in sub})
        result[name] = {"conversations": convs, "n_cases": n_cases, "curves": curves}
        print(f"# {name}: {', '.join(convs)} ({n_cases} cases)\n")
        print("\n".join(markdown(curves, references)[4:]))  # the tables, without summary.md's section preamble
    out = args.out or args.run / "subsets.json"
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
