"""FI-LoCoMo outputs: per-case rows (cases.parquet), the bootstrap summary (summary.json), the paper-style tables
(summary.md) and the figure (figure.png). Plain functions over plain data; files are written atomically."""

from __future__ import annotations

import json
import os
import shutil
import uuid
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.bench.bootstrap import bootstrap_groups
from pipeline.bench.curves import budget_curves
from pipeline.bench.curves import figure as curves_figure
from pipeline.bench.curves import markdown as curves_markdown
from pipeline.bench.faults import MECHANISMS
from pipeline.bench.methods import CONTROLS, Method
from pipeline.bench.metrics import METRICS, CaseResult
from pipeline.bench.schema import CASES

COUNT_METRICS = ("extra_background", "evaluations_per_case")  # reported as counts, not fractions
HEADLINE = ("recall_at_m", "recall_at_m_thresholded", "rank1_coverage", "rank2_coverage", "rank3_coverage",
            "complete_set_recall", "exact_set_match", "task_recovery", "residual_error_risk",
            "extra_background", "evaluations_per_case")


def case_rows(result, run_id: str) -> list[dict]:
    """One row per (case, method, utility), in CASES column order."""
    rows = []
    for bc, outs in result.outcomes:
        ids = bc.case.context.memory_ids
        q = bc.case.query
        for method, utility, o in outs:
            rows.append({
                "run_id": run_id,
                "case_id": bc.case_id,
                "conversation": q.pool_id,
                "query_id": q.query_id,
                "mechanism": bc.mechanism,
                "method": method,
                "utility": utility,
                "faults": list(bc.faults),
                "ranking": [ids[i] for i in o.ranking],
                "full_ranking": [ids[i] for i in o.full_ranking],
                "cleared": [ids[i] for i in o.cleared],
                "recovered": o.recovered,
                "evaluations": o.evaluations,
                "baseline_utility": o.baseline_utility,
                "cleared_utility": o.cleared_utility,
                "estimator": o.estimator,
                "permutations": o.permutations,
                "agent": result.agent_fingerprint,
                "seed": result.config.seed,
            })
    return rows


def to_case_results(rows: list[dict]) -> list[CaseResult]:
    return [
        CaseResult(r["case_id"], r["conversation"], r["mechanism"], r["method"], r["utility"], tuple(r["faults"]),
                   tuple(r["ranking"]), tuple(r["cleared"]), r["recovered"], r["evaluations"],
                   tuple(r["full_ranking"]))
        for r in rows
    ]


def _groups(results: list[CaseResult]) -> dict[tuple[str, str], list[CaseResult]]:
    out: dict[tuple[str, str], list[CaseResult]] = {}
    for c in results:
        out.setdefault(c.group, []).append(c)
    return out


def position_histogram(cases, k: int) -> dict:
    """Fault records per context position (0 = retrieved first), overall and per mechanism, counts and shares."""
    def one(sub) -> dict:
        counts = np.zeros(k, dtype=np.int64)
        for c in sub:
            for p in c.fault_positions:
                counts[p] += 1
        total = int(counts.sum())
        return {"counts": counts.tolist(), "share": (counts / total).round(4).tolist() if total else [0.0] * k}

    out = {"overall": one(cases), "by_mechanism": {m: one([c for c in cases if c.mechanism == m]) for m in MECHANISMS}}
    variants = sorted({c.variant for c in cases} - set(MECHANISMS))
    if variants:  # extra redundancies (redundant_r<r>): their own histograms, besides the mechanism's
        out["by_variant"] = {v: one([c for c in cases if c.variant == v]) for v in variants}
    return out


def summarize(result, rows: list[dict], run_id: str, source_sha256: str) -> dict:
    """The summary.json document: counts, per-mode per-method metrics with 95% cluster-bootstrap intervals (overall
    and by mechanism), paired differences versus LOO, the config, the agent fingerprint and the timings."""
    cfg = result.config
    results = to_case_results(rows)
    reference = "loo" if "loo" in cfg.methods else None
    overall = bootstrap_groups(_groups(results), reference, cfg.replicates, cfg.seed) if results else {}
    by_mech = {
        m: bootstrap_groups(_groups(sub), reference, cfg.replicates, cfg.seed)
        for m in MECHANISMS
        if (sub := [c for c in results if c.mechanism == m])
    }
    # Paired differences versus the `position` control too: attribution earns its agent calls only by beating it.
    vs_pos = (bootstrap_groups(_groups(results), "position", cfg.replicates, cfg.seed)
              if results and "position" in cfg.methods else {})
    modes: dict[str, dict] = {}
    for utility in cfg.utility:
        methods = {}
        for method in cfg.methods:
            g = (method, utility)
            if g not in overall:
                continue
            entry = {
                "n_cases": sum(1 for c in results if c.group == g),
                "overall": overall[g]["metrics"],
                "by_mechanism": {m: b[g]["metrics"] for m, b in by_mech.items()},
            }
            if "vs_reference" in overall[g]:
                entry["paired_vs_loo"] = overall[g]["vs_reference"]
                entry["paired_vs_loo_by_mechanism"] = {m: b[g]["vs_reference"] for m, b in by_mech.items()}
            if "vs_reference" in vs_pos.get(g, {}):
                entry["paired_vs_position"] = vs_pos[g]["vs_reference"]
            methods[method] = entry
        modes[utility] = {"methods": methods}
    kept = {m: sum(1 for c in result.cases if c.variant == m) for m in result.counts}
    hist = position_histogram(result.cases, cfg.top_k)
    scored = {bc.case_id for bc, _ in result.outcomes}
    return {
        "benchmark": "FI-LoCoMo",
        "run_id": run_id,
        "cases": {m: {**asdict(c), "kept": kept[m]} for m, c in result.counts.items()},
        "queries": result.queries,
        "n_cases": len(result.cases),
        "fault_records": sum(len(c.faults) for c in result.cases),
        "fault_positions": hist,
        "excluded": {"by_mechanism": dict(result.excluded), "total": sum(result.excluded.values()),
                     "rule": "full context answered correctly when re-evaluated in the methods phase; excluded from "
                             "every method's metrics"},
        "n_scored_cases": len(scored),
        "scored_by_mechanism": {m: {"cases": sum(1 for bc, _ in result.outcomes if bc.mechanism == m),
                                    "conversations": len({bc.conversation for bc, _ in result.outcomes
                                                          if bc.mechanism == m})} for m in MECHANISMS},
        "conversations": {"run": result.conversations_run,
                          "with_cases": len({bc.conversation for bc, _ in result.outcomes})},
        "agent_calls": dict(result.agent_calls),
        "build_cache_hits": result.cache_hits,
        "utility_modes": modes,
        "metrics": {"fractions": [m for m in METRICS if m not in COUNT_METRICS], "counts": list(COUNT_METRICS),
                    "intervals": f"95% two-level cluster bootstrap (conversations, then cases), {cfg.replicates} "
                                 "replicates, percentile; paired differences taken per case before resampling"},
        "config": asdict(cfg),
        "agent": result.agent_fingerprint,
        "retrieval": result.retrieval,
        "source": {"path": cfg.locomo, "sha256": source_sha256},
        "timings": dict(result.timings),
        **({"curves": budget_curves(rows, cfg.methods, cfg.utility, cfg.replicates, cfg.seed),
            "budgets": list(cfg.eval_budgets)} if cfg.eval_budgets and rows else {}),
    }


def _fmt(iv: dict, metric: str) -> str:
    if metric in COUNT_METRICS:
        return f"{iv['value']:.2f} [{iv['ci_low']:.2f}, {iv['ci_high']:.2f}]"
    return f"{100 * iv['value']:.1f} [{100 * iv['ci_low']:.1f}, {100 * iv['ci_high']:.1f}]"


def _diff(iv: dict, metric: str) -> str:
    scale, unit = (1, "") if metric in COUNT_METRICS else (100, "")
    return f"{scale * iv['value']:+.1f}{unit} [{scale * iv['ci_low']:+.1f}, {scale * iv['ci_high']:+.1f}]"


def markdown(summary: dict) -> str:
    """Paper-style tables: method x metric with 95% intervals, per utility mode; per-mechanism recall and recovery;
    paired differences versus LOO; sensitivity to the permutation budget L."""
    lines = ["# FI-LoCoMo results", ""]
    lines += ["Controls (no attribution, same nested clearance over all K memories): `position` (retrieval order), "
              "`random` (seeded), `oracle` (true faults first: the ceiling). recall_at_m ranks all K memories (ties "
              "at random with the case seed); recall_at_m_thresholded counts only the flagged harmful list; "
              "rank<r>_coverage is the share of fault records at rank <= r.", ""]
    cfg = summary["config"]
    lines += [f"Agent `{summary['agent']}`, retrieval {summary['retrieval']} (K={cfg['top_k']}), tau=kappa="
              f"{cfg['tau']}, seed {cfg['seed']}, {cfg['replicates']} bootstrap replicates. Percentages with 95% "
              "two-level cluster-bootstrap intervals; extra_background and evaluations_per_case are per-case counts.",
              "", "## Cases", "", "| mechanism | tried | verified | kept | fault sets written | not retrieved | "
              "position over its share (skipped unchecked) | check failed |", "|---|---|---|---|---|---|---|---|"]
    for m, c in summary["cases"].items():
        lines.append(f"| {m} | {c['tried']} | {c['verified']} | {c['kept']} | {c['candidates']} | "
                     f"{c['not_retrieved']} | {c.get('position_skipped', 0)} | {c['check_failed']} |")
    q = summary["queries"]
    conv = summary["conversations"]
    ex = summary["excluded"]
    lines += ["", f"{q['eligible']} eligible queries (categories 1-4 with evidence), {q.get('checked', q['eligible'])} "
              f"clean-checked, {q['clean']} answered correctly on their clean context; {summary['n_cases']} cases "
              f"from {conv['with_cases']} conversations, {summary['fault_records']} fault records. Excluded (full "
              f"context answered correctly again in the methods phase): {ex['total']} "
              f"({', '.join(f'{m} {n}' for m, n in ex['by_mechanism'].items())}); {summary['n_scored_cases']} cases "
              "scored.", "", "### Fault records per context position (0 = retrieved first)", "",
              "| mechanism | " + " | ".join(f"pos {i}" for i in range(cfg['top_k'])) + " |",
              "|---|" + "---|" * cfg["top_k"]]
    fp = summary["fault_positions"]
    for name, h in [("all", fp["overall"]), *fp["by_mechanism"].items()]:
        lines.append(f"| {name} | " + " | ".join(f"{n} ({100 * sh:.0f}%)" for n, sh in zip(h["counts"], h["share"]))
                     + " |")
    calls = summary["agent_calls"]
    lines += ["", "Agent requests by phase: " + ", ".join(f"{k} {v}" for k, v in calls.items())
              + f"; build cache hits {summary['build_cache_hits']}.", ""]
    for mode, body in summary["utility_modes"].items():
        methods = body["methods"]
        lines += [f"## Utility: {mode}", "", "| method | n | " + " | ".join(HEADLINE) + " |",
                  "|---|---|" + "---|" * len(HEADLINE)]
        for name, e in methods.items():
            lines.append(f"| {name} | {e['n_cases']} | " + " | ".join(_fmt(e["overall"][k], k) for k in HEADLINE)
                         + " |")
        lines += ["", f"### By mechanism ({mode})", "", "| method | " + " | ".join(
            f"{m} {k}" for m in MECHANISMS for k in ("recall_at_m", "task_recovery")) + " |",
            "|---|" + "---|" * (2 * len(MECHANISMS))]
        for name, e in methods.items():
            cells = [_fmt(e["by_mechanism"][m][k], k) if m in e["by_mechanism"] else "-"
                     for m in MECHANISMS for k in ("recall_at_m", "task_recovery")]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        paired = {n: e["paired_vs_loo"] for n, e in methods.items() if "paired_vs_loo" in e}
        if paired:
            keys = ("recall_at_m", "complete_set_recall", "exact_set_match", "task_recovery")
            lines += ["", f"### Paired difference vs LOO ({mode}, percentage points)", "",
                      "| method | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
            for name, d in paired.items():
                lines.append(f"| {name} | " + " | ".join(_diff(d[k], k) for k in keys) + " |")
        paired = {n: e["paired_vs_position"] for n, e in methods.items() if "paired_vs_position" in e}
        if paired:
            keys = ("recall_at_m", "task_recovery", "evaluations_per_case")
            lines += ["", f"### Paired difference vs the position control ({mode}, percentage points; evaluations "
                      "per case as a count)", "", "| method | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
            for name, d in paired.items():
                lines.append(f"| {name} | " + " | ".join(_diff(d[k], k) for k in keys) + " |")
        sens = _meclear_names(methods)
        if sens:
            keys = ("recall_at_m", "complete_set_recall", "exact_set_match", "task_recovery", "extra_background",
                    "evaluations_per_case")
            lines += ["", f"### Sensitivity to the permutation budget L ({mode})", "",
                      "| method | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
            for name in sens:
                lines.append(f"| {name} | " + " | ".join(_fmt(methods[name]["overall"][k], k) for k in keys) + " |")
        lines.append("")
    if "curves" in summary:
        lines += curves_markdown(summary["curves"])
    t = summary["timings"]
    lines += ["## Timings", "", ", ".join(f"{k} {v:.1f}" for k, v in t.items()), "", "![figure](figure.png)", ""]
    return "\n".join(lines)


def _meclear_names(names) -> list[str]:
    """The MeClear variants among the method names, in their order (the sensitivity-to-L table and panel)."""
    return [n for n in names if Method.parse(n).family == "meclear"]


def _budget_label(method: Method) -> str:
    return "exact" if method.budget is None else f"l{method.budget}"


def figure(summary: dict, path: Path) -> None:
    """Recall@|M| (full ranking) and task recovery by mechanism (bars with 95% intervals; every bar marked at its value
    so a zero shows, zeros labelled), and MeClear's sensitivity to L (offset curves with distinct markers), one row per
    utility mode. x labels carry n cases and the conversations behind each interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(summary["utility_modes"])
    scored = summary.get("scored_by_mechanism", {})
    conv = summary["conversations"]["with_cases"]
    ticks = [f"{m}\nn={scored.get(m, {}).get('cases', 0)}, {scored.get(m, {}).get('conversations', 0)} conv."
             for m in MECHANISMS]
    fig, axes = plt.subplots(len(modes), 3, figsize=(19, 4.8 * len(modes)), squeeze=False)
    for row, mode in enumerate(modes):
        methods = summary["utility_modes"][mode]["methods"]
        names = list(methods)
        for col, metric in enumerate(("recall_at_m", "task_recovery")):
            ax = axes[row, col]
            width = 0.8 / max(len(names), 1)
            for j, name in enumerate(names):
                bm = methods[name]["by_mechanism"]
                x = np.arange(len(MECHANISMS)) + (j - (len(names) - 1) / 2) * width
                iv = [bm.get(m, {}).get(metric, {"value": np.nan, "ci_low": np.nan, "ci_high": np.nan})
                      for m in MECHANISMS]
                v = np.array([i["value"] for i in iv])
                err = np.array([[i["value"] - i["ci_low"] for i in iv], [i["ci_high"] - i["value"] for i in iv]])
                color = plt.cm.tab20(j % 20)  # distinct colours for up to 20 methods; controls hatched
                ax.bar(x, v, width, yerr=err, capsize=2, label=name, color=color,
                       hatch="//" if name in CONTROLS else None, edgecolor="white" if name in CONTROLS else None)
                ax.plot(x, v, linestyle="none", marker="_", markersize=9, markeredgewidth=2, color=color)
                for xi, vi in zip(x, v):
                    if vi == 0:
                        ax.annotate("0", (xi, 0), xytext=(0, 3), textcoords="offset points", ha="center",
                                    fontsize=6, color=color)
            ax.set_xticks(np.arange(len(MECHANISMS)), ticks, fontsize=8)
            ax.set_ylim(-0.02, 1.05)
            ax.set_xlabel("fault mechanism (n cases, conversations)")
            ax.set_ylabel(f"{metric} (share)")
            ax.set_title(f"{metric} by mechanism ({mode}); 95% CI over {conv} conversations", fontsize=9)
        ax = axes[row, 2]
        sens = _meclear_names(names)
        keys = ("recall_at_m", "complete_set_recall", "exact_set_match", "task_recovery")
        for i, (metric, marker) in enumerate(zip(keys, ("o", "s", "^", "D"))):
            iv = [methods[n]["overall"][metric] for n in sens]
            v = np.array([it["value"] for it in iv])
            err = np.array([[it["value"] - it["ci_low"] for it in iv], [it["ci_high"] - it["value"] for it in iv]])
            ax.errorbar(np.arange(len(sens)) + (i - 1.5) * 0.08, v, yerr=err, marker=marker, capsize=3, label=metric)
        ax.set_xticks(np.arange(len(sens)), [_budget_label(Method.parse(n)) for n in sens])
        ax.set_ylim(-0.02, 1.05)
        ax.set_xlabel("MeClear permutation budget L")
        ax.set_ylabel("share of cases")
        n_all = sum(v.get("cases", 0) for v in scored.values())
        ax.set_title(f"MeClear sensitivity to L ({mode}); n={n_all}, {conv} conversations", fontsize=9)
        ax.legend(fontsize=7)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=max(len(labels), 1), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_outputs(out: Path, rows: list[dict], summary: dict) -> None:
    """cases.parquet, summary.json, summary.md, figure.png: all rendered into a staging folder first, then renamed
    into `out`, so a failure while rendering (the figure, say) leaves no partial set of outputs behind."""
    out.mkdir(parents=True, exist_ok=True)
    staging = out / f".outputs.{uuid.uuid4().hex[:8]}.staging"
    staging.mkdir()
    try:
        pq.write_table(pa.Table.from_pylist(rows, schema=CASES), staging / "cases.parquet", compression="zstd")
        _write_text(staging / "summary.json", json.dumps(summary, indent=2, sort_keys=False, default=str))
        if summary["n_cases"]:
            figure(summary, staging / "figure.png")
        for mode in summary.get("curves", {}):
            curves_figure(summary["curves"], mode, staging / f"curves_{mode}.png",
                          f"FI-LoCoMo budget curves, K={summary['config']['top_k']}, utility {mode}; "
                          f"{summary['n_scored_cases']} cases, 95% cluster-bootstrap intervals")
        _write_text(staging / "summary.md", markdown(summary))
        for f in sorted(staging.iterdir()):  # summary.md last: its presence means the set is complete
            if f.name != "summary.md":
                os.replace(f, out / f.name)
        os.replace(staging / "summary.md", out / "summary.md")
    finally:
        shutil.rmtree(staging, ignore_errors=True)
