"""How a per-query budget should be split between attribution and the verified clearance (issue 30, item 1).

    env PYTHONPATH=. python jobs/bench_split.py --locomo ../shared/data/locomo/locomo10.json --top-k 10 \
        --budgets 64,128 --reserves 0,2,4,8,16,32 --out /tmp/split.json
    env PYTHONPATH=. python jobs/bench_split.py --locomo ../shared/data/locomo/locomo10.json --top-k 10 \
        --budgets 64,128 --reserves audit --clearance audit,chain,family --utility probability --out /tmp/rule.json
    env PYTHONPATH=. python jobs/bench_split.py --locomo ../shared/data/locomo/locomo10.json --top-k 20 \
        --budgets 64,128,256 --reserves audit --loo on,off --utility correct --out /tmp/loo.json

Builds the FI-LoCoMo fault cases once (the benchmark's own builder, reader agent unless --agent says otherwise), then
replays what `meclear audit --budget B` ships (`pipeline.bench.methods.shipped`: the `auto` estimator on B minus a
reserve, the clearance on the rest; several rankings in `correct` mode) with each reserve, on the same cases, the
same agent outputs (cached per case) and the same seeds. Prints, per utility mode, budget and reserve: exact-set
match, task recovery and Recall@|M| (micro: hits over fault slots), in percent, and the mean evaluations spent, and
writes them with per-conversation rows to --out. The audit's reserve is `clearance_reserve` in
pipeline/game/estimators.py (`--reserves audit` replays it); this is the measurement behind it. `--clearance` replays
the candidate rule too: `audit` (what ships), `chain` (the Shapley chain alone), `family` (every ranking, no
preferred one): the measurement behind `pipeline.game.clearance.primary_ranking`. `--loo` replays the LOO screen:
`audit` (the audit's rule, `pipeline.game.plan.auto_measures_loo`), `on` (the K leave-one-out anchors evaluated),
`off` (none; only the sparse surrogate can go without them, so the other estimators keep theirs).
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from pipeline.bench.baselines import CachedOracle
from pipeline.bench.config import EvalConfig
from pipeline.bench.methods import CLEARANCE_VARIANTS, Method, shipped
from pipeline.bench.outcomes import CaseOutcomes
from pipeline.bench.run import BenchWorker
from pipeline.core.progress import progress_bar
from pipeline.game.estimators import clearance_reserve
from pipeline.game.plan import auto_measures_loo, full_mask

LOO_SCREENS: dict[str, bool | None] = {"audit": None, "on": True, "off": False}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--locomo", required=True)
    ap.add_argument("--conversations", default="", help="comma list of sample_ids (default: all ten)")
    ap.add_argument("--top-k", type=int, default=10)
    ap.add_argument("--budgets", default="64,128")
    ap.add_argument("--reserves", default="0,2,4,8,16,32",
                    help="comma list of reserves; 'audit' is the audit's rule (clearance_reserve)")
    ap.add_argument("--clearance", default="audit",
                    help=f"comma list of candidate rules to replay, of {', '.join(CLEARANCE_VARIANTS)}")
    ap.add_argument("--loo", default="audit", help="comma list of LOO screens to replay, of audit, on, off")
    ap.add_argument("--utility", default="correct,probability")
    ap.add_argument("--agent", default="reader")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("bench-split.json"))
    args = ap.parse_args(argv)

    budgets = _ints(args.budgets)
    reserves: list[int | None] = [None if x == "audit" else int(x) for x in args.reserves.split(",") if x]
    modes = [m for m in args.utility.split(",") if m]
    rules = [r for r in args.clearance.split(",") if r]
    bad = sorted(set(rules) - set(CLEARANCE_VARIANTS))
    if bad or not rules:
        raise SystemExit(f"bench_split: --clearance {args.clearance!r}: allowed {', '.join(CLEARANCE_VARIANTS)}")
    screens = [x for x in args.loo.split(",") if x]
    if not screens or set(screens) - set(LOO_SCREENS):
        raise SystemExit(f"bench_split: --loo {args.loo!r}: allowed {', '.join(LOO_SCREENS)}")
    convs = [c for c in args.conversations.split(",") if c]
    cfg = EvalConfig(locomo=args.locomo, conversations=tuple(convs), top_k=args.top_k, eval_budgets=tuple(budgets),
                     methods=tuple(f"auto_b{b}" for b in budgets), utility=tuple(modes), agent=args.agent,
                     dense="off", seed=args.seed)
    worker = BenchWorker(cfg)
    t0 = time.perf_counter()
    if not convs:
        (pools, _), _ = worker._load()
        convs = sorted(pools)
    cases = [bc for conv in convs for bc in worker.build(conv)[1].cases]
    build_s = time.perf_counter() - t0

    t1 = time.perf_counter()
    # (mode, budget, reserve, rule, loo) -> conversation -> [exact, recovered, hits, slots, evaluations, n]
    acc: dict[tuple, dict[str, np.ndarray]] = defaultdict(lambda: defaultdict(lambda: np.zeros(6)))
    bar = progress_bar(len(cases), "replaying the split", "case")
    used = 0
    for bc in cases:
        oracle = CaseOutcomes(worker.agent, bc.case)
        k = bc.case.k
        bar.update(1)
        if bool(oracle.outcome(np.array([full_mask(k)]))[0]):
            continue  # nothing to recover: excluded, as the benchmark excludes it
        used += 1
        faults = set(bc.fault_positions)
        for mode in modes:
            for b in budgets:
                for r in reserves:
                    for rule, screen in [(x, y) for x in rules for y in screens]:
                        ev = CachedOracle(k, oracle.mode(mode))
                        out = shipped(Method.parse(f"auto_b{b}"), k, ev, bc.case.seed, cfg.tau, mode, reserve=r,
                                      clearance=rule, loo=LOO_SCREENS[screen])
                        hits = len(set(out.full_ranking[: len(faults)]) & faults)
                        acc[(mode, b, r, rule, screen)][bc.conversation] += [set(out.cleared) == faults, out.recovered,
                                                                     hits, len(faults), out.evaluations, 1]
    bar.close()
    methods_s = time.perf_counter() - t1

    rows = []
    def order(item):
        (mode, b, r, rule, screen), _ = item
        return mode, b, -1 if r is None else r, rules.index(rule), screens.index(screen)

    for (mode, b, r, rule, screen), per in sorted(acc.items(), key=order):
        tot = sum(per.values())
        default = clearance_reserve(args.top_k, b, mode)
        rows.append({"utility": mode, "budget": b, "reserve": default if r is None else r, "audit_rule": r is None,
                     "audit_default": (default if r is None else r) == default, "clearance": rule,
                     "loo": screen, "loo_measured": auto_measures_loo(args.top_k, b, mode) if screen == "audit"
                     else screen == "on",
                     "cases": int(tot[5]), "exact_set_match": 100 * tot[0] / tot[5],
                     "recovery": 100 * tot[1] / tot[5], "recall_at_m": 100 * tot[2] / tot[3],
                     "mean_evaluations": tot[4] / tot[5],
                     "per_conversation": {c: {"cases": int(v[5]), "exact_set_match": 100 * v[0] / v[5],
                                              "recovery": 100 * v[1] / v[5]} for c, v in sorted(per.items())}})
    print(f"\n{used} cases (of {len(cases)} built) from {len(convs)} conversations, K={args.top_k}, agent "
          f"{args.agent}; build {build_s:.0f} s, replay {methods_s:.0f} s\n")
    print("| utility | B | reserve | clearance | LOO | exact-set match | recovery | Recall@\\|M\\| | mean evals |")
    print("|---|---|---|---|---|---|---|---|---|")
    for x in rows:
        mark = " (audit)" if x["audit_rule"] else ""
        loo = f"{x['loo']} ({'on' if x['loo_measured'] else 'off'})" if x["loo"] == "audit" else x["loo"]
        print(f"| {x['utility']} | {x['budget']} | {x['reserve']}{mark} | {x['clearance']} | {loo} | "
              f"{x['exact_set_match']:.1f} | {x['recovery']:.1f} | {x['recall_at_m']:.1f} | "
              f"{x['mean_evaluations']:.1f} |")
    convs_seen = sorted({c for x in rows for c in x["per_conversation"]})
    ruled = [x for x in rows if x["audit_rule"]]
    if ruled:
        print("\nPer conversation, the audit's rule: exact-set match / recovery, percent")
        heads = [f"{x['utility']} B={x['budget']} (r={x['reserve']}, {x['clearance']}, LOO {x['loo']})" for x in ruled]
        print("| conversation | " + " | ".join(heads) + " |")
        print("|---|" + "---|" * len(ruled))
        for c in convs_seen:
            cells = [x["per_conversation"].get(c) for x in ruled]
            print(f"| {c} | " + " | ".join(f"{v['exact_set_match']:.1f} / {v['recovery']:.1f} (n={v['cases']})"
                                          if v else "-" for v in cells) + " |")
    args.out.write_text(json.dumps({"config": vars(args) | {"out": str(args.out)}, "cases": used,
                                    "build_s": build_s, "replay_s": methods_s, "rows": rows}, indent=1))
    print(f"\nwrote {args.out}")
    worker.close()


if __name__ == "__main__":
    main()
