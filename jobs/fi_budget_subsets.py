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

`--run` may be given more than once to join runs of the same settings over disjoint conversations (a long LLM run
split by `--conversations` across sessions or machines):

    env PYTHONPATH=. python jobs/fi_budget_subsets.py --run /tmp/sm-a --run /tmp/sm-b --out /tmp/sm-ab.json

The runs must agree on every setting but `conversations` (methods, utilities, budgets, seed, K, agent, ...), and no
conversation or case may be in two of them: a conversation given twice would count twice in every mean and interval,
so it is an error, as is one run folder named twice (compared resolved, whatever the working directory).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import polars as pl

from pipeline.bench.curves import budget_curves, markdown

JOIN_IGNORES = ("conversations",)  # the one setting that may differ between joined runs


def _load_runs(runs: list[Path]) -> tuple[dict, list[dict]]:
    """The first run's config and every run's rows; SystemExit where the runs cannot be joined (see module doc)."""
    seen: dict[Path, Path] = {}
    for run in runs:
        key = run.resolve()
        if key in seen:
            raise SystemExit(f"fi_budget_subsets: --run {run} is the same folder as --run {seen[key]}: "
                             "a run given twice would count its cases twice")
        seen[key] = run
    cfg, rows, owner = None, [], {}
    for run in runs:
        for name in ("summary.json", "cases.parquet"):
            if not (run / name).is_file():
                raise SystemExit(f"fi_budget_subsets: --run {run}: no {name} (not a finished `meclear eval` folder)")
        this = json.loads((run / "summary.json").read_text())["config"]
        if cfg is None:
            cfg = this
        else:
            differ = sorted(k for k in set(cfg) | set(this) if k not in JOIN_IGNORES and cfg.get(k) != this.get(k))
            if differ:
                raise SystemExit(f"fi_budget_subsets: --run {run} differs from --run {runs[0]} in {', '.join(differ)} "
                                 f"(only {', '.join(JOIN_IGNORES)} may differ between joined runs)")
        part = pl.read_parquet(run / "cases.parquet").to_dicts()
        keys = {r["conversation"] for r in part} | {r["case_id"] for r in part}  # case ids too: renamed conversations
        both = sorted(k for k in keys if k in owner)
        if both:
            raise SystemExit(f"fi_budget_subsets: {both[0]} is in both --run {owner[both[0]]} and --run {run}: "
                             "joined runs must cover disjoint conversations")
        owner.update(dict.fromkeys(keys, run))
        rows += part
    assert cfg is not None
    return cfg, rows


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
    ap.add_argument("--run", type=Path, action="append", required=True,
                    help="output folder of `meclear eval --budgets` (repeatable: runs over disjoint conversations)")
    ap.add_argument("--subset", action="append", default=[], help="NAME=conv-a,conv-b (repeatable)")
    ap.add_argument("--rest", default=None, help="name of the subset of every other conversation of the run")
    ap.add_argument("--reference", action="append", default=[],
                    help="a further curve to take paired differences against at the same budget (repeatable; "
                         "ContextCite always)")
    ap.add_argument("--out", type=Path, default=None, help="JSON output (default <run>/subsets.json)")
    args = ap.parse_args(argv)

    if args.out is None and len(args.run) > 1:
        raise SystemExit("fi_budget_subsets: --out is required with several --run folders")
    cfg, rows = _load_runs(args.run)
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
    out = args.out or args.run[0] / "subsets.json"
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(out)  # atomic: a reader never sees half a file
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
