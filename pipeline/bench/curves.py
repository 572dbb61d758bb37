"""Budget curves of the budgeted benchmark (`meclear eval --budgets`): metric against evaluations per case, one curve
per method, per fault variant, with two-level cluster-bootstrap intervals and paired differences against ContextCite
at the same budget.

A curve is a method family at every budget (`adaptive_b16`, `adaptive_b32`, ... form the `adaptive` curve); methods
without a budget (exact enumeration, LOO, the controls, the filter) are single points at their evaluations per case.

Curve metrics, micro-averaged per case like `pipeline.bench.metrics` (M = the faults, C = what the clearance removed,
R = the method's full ranking, H = its thresholded harmful set, H* = exact enumeration's harmful set, same utility):
recall_at_m (|R[:|M|] ∩ M| / |M|), exact_set_match (C = M), same_harmful_as_exact (H = H*; only where exact ran,
K <= 12), task_recovery, extra_background (|C minus M|), evaluations_per_case (distinct agent calls, clearance checks
included).
"""

from __future__ import annotations

import numpy as np

from pipeline.bench.bootstrap import bootstrap_table
from pipeline.bench.methods import Method
from pipeline.bench.metrics import CaseTable

CURVE_METRICS = ("recall_at_m", "exact_set_match", "same_harmful_as_exact", "task_recovery", "extra_background",
                 "evaluations_per_case")
REFERENCE = "contextcite"  # paired differences are taken against ContextCite at the same budget
EXACT = "meclear_exact"


def variant(row: dict) -> str:
    """The case's fault variant (mechanism, or redundant_r<r>): the suffix of its case id."""
    return row["case_id"].rsplit(":", 1)[1]


def _contribution(row: dict, exact: set | None, with_exact: bool) -> tuple[list[float], list[float]]:
    faults, cleared = set(row["faults"]), set(row["cleared"])
    m = len(faults)
    num = [len(faults.intersection(row["full_ranking"][:m])), float(cleared == faults)]
    den = [m, 1.0]
    if with_exact:
        num.append(float(exact is not None and set(row["ranking"]) == exact))
        den.append(1.0)
    num += [float(row["recovered"]), float(len(cleared - faults)), float(row["evaluations"])]
    den += [1.0, 1.0, 1.0]
    return num, den


def _table(rows: list[dict], exact: dict[str, set], metrics: tuple[str, ...]) -> CaseTable:
    rows = sorted(rows, key=lambda r: r["case_id"])
    _, clusters = np.unique([r["conversation"] for r in rows], return_inverse=True)
    with_exact = "same_harmful_as_exact" in metrics
    pairs = [_contribution(r, exact.get(r["case_id"]), with_exact) for r in rows]
    return CaseTable(tuple(r["case_id"] for r in rows), clusters.astype(np.int64),
                     np.array([p[0] for p in pairs], dtype=np.float64),
                     np.array([p[1] for p in pairs], dtype=np.float64), metrics)


def budget_curves(rows: list[dict], methods: tuple[str, ...], utilities: tuple[str, ...], replicates: int,
                  seed: int, references: tuple[str, ...] = (REFERENCE,)) -> dict:
    """{utility: {group: {curve: [point, ...]}}} with group 'all' and every fault variant. A point: method, budget
    (None for unbudgeted methods), n_cases, metrics {name: value/ci_low/ci_high} and, for each reference curve that
    ran at the same budget (ContextCite by default), vs_<reference> (paired differences, same form)."""
    parsed = {m: Method.parse(m) for m in methods}
    has_exact = EXACT in methods
    metrics = CURVE_METRICS if has_exact else tuple(m for m in CURVE_METRICS if m != "same_harmful_as_exact")
    out: dict = {}
    for u in utilities:
        urows = [r for r in rows if r["utility"] == u]
        exact = {r["case_id"]: set(r["ranking"]) for r in urows if r["method"] == EXACT}
        groups = {"all": urows}
        for r in urows:
            groups.setdefault(variant(r), []).append(r)
        out[u] = {}
        for g, grows in groups.items():
            by_method: dict[str, list[dict]] = {}
            for r in grows:
                by_method.setdefault(r["method"], []).append(r)
            tables = {name: _table(by_method[name], exact, metrics) for name in methods if name in by_method}
            curves: dict[str, list[dict]] = {}
            for name, table in tables.items():
                meth = parsed[name]
                point = {"method": name, "budget": meth.evals, "n_cases": table.n_cases,
                         "metrics": bootstrap_table(table, replicates, seed)}
                for reference in references:
                    ref = f"{reference}_b{meth.evals}" if meth.evals is not None else None
                    if ref in tables and ref != name and tables[ref].case_ids == table.case_ids:
                        diff = CaseTable(table.case_ids, table.clusters, table.numerators - tables[ref].numerators,
                                         table.denominators, metrics)
                        point[f"vs_{reference}"] = bootstrap_table(diff, replicates, seed)
                curves.setdefault(meth.curve, []).append(point)
            out[u][g] = curves
    return out


def _pct(iv: dict, metric: str, signed: bool = False) -> str:
    scale = 1 if metric in ("extra_background", "evaluations_per_case") else 100
    f = "+.1f" if signed else ".1f"
    return f"{scale * iv['value']:{f}} [{scale * iv['ci_low']:{f}}, {scale * iv['ci_high']:{f}}]"


def markdown(curves: dict, references: tuple[str, ...] = (REFERENCE,)) -> list[str]:
    """summary.md sections: per utility, the overall curves table and the paired differences against each reference
    (ContextCite unless others were passed to `budget_curves`)."""
    lines = ["## Budget curves", "",
             "Per case: evaluations = distinct agent calls, clearance checks included. Percentages with 95% two-level "
             "cluster-bootstrap intervals; extra_background and evaluations_per_case are counts. Per-variant curves "
             "are in summary.json (`curves`) and curves_<utility>.png.", ""]
    for u, groups in curves.items():
        for g in ("all",):
            curves_g = groups.get(g, {})
            metrics = next((list(p["metrics"]) for pts in curves_g.values() for p in pts), [])
            lines += [f"### {u}: all cases", "", "| method | budget | n | " + " | ".join(metrics) + " |",
                      "|---|---|---|" + "---|" * len(metrics)]
            for pts in curves_g.values():
                for p in pts:
                    lines.append(f"| {p['method']} | {p['budget'] or '-'} | {p['n_cases']} | "
                                 + " | ".join(_pct(p["metrics"][k], k) for k in metrics) + " |")
            keys = [k for k in ("exact_set_match", "recall_at_m", "same_harmful_as_exact", "task_recovery")
                    if k in metrics]
            for reference in references:
                label = "ContextCite" if reference == REFERENCE else reference
                lines += ["", f"### {u}: paired difference vs {label} at the same budget (percentage points)", "",
                          "| method | budget | " + " | ".join(keys) + " |", "|---|---|" + "---|" * len(keys)]
                for pts in curves_g.values():
                    for p in pts:
                        if f"vs_{reference}" in p:
                            lines.append(f"| {p['method']} | {p['budget']} | "
                                         + " | ".join(_pct(p[f"vs_{reference}"][k], k, True) for k in keys) + " |")
            lines.append("")
    return lines


def figure(curves: dict, utility: str, path, title: str = "") -> None:
    """One panel per (fault group, metric): each curve's metric against its mean evaluations per case (log2 x), with
    95% intervals; unbudgeted methods as single markers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = curves[utility]
    names = list(groups)
    metrics = [m for m in CURVE_METRICS if m != "evaluations_per_case"
               and any(m in p["metrics"] for pts in groups["all"].values() for p in pts)]
    fig, axes = plt.subplots(len(names), len(metrics), figsize=(4.2 * len(metrics), 3.4 * len(names)),
                             squeeze=False)
    all_curves = sorted({c for g in groups.values() for c in g})
    colors = {c: plt.cm.tab20(i % 20) for i, c in enumerate(all_curves)}
    for r, g in enumerate(names):
        for c, metric in enumerate(metrics):
            ax = axes[r, c]
            for curve, pts in groups[g].items():
                pts = sorted(pts, key=lambda p: p["metrics"]["evaluations_per_case"]["value"])
                x = np.array([p["metrics"]["evaluations_per_case"]["value"] for p in pts])
                iv = [p["metrics"][metric] for p in pts]
                v = np.array([i["value"] for i in iv])
                err = np.array([[i["value"] - i["ci_low"] for i in iv], [i["ci_high"] - i["value"] for i in iv]])
                budgeted = pts[0]["budget"] is not None
                ax.errorbar(x, v, yerr=err, marker="o" if budgeted else "s", linestyle="-" if budgeted else "none",
                            capsize=2, markersize=3 if budgeted else 5, color=colors[curve], label=curve,
                            linewidth=2.2 if curve == REFERENCE else 1.1)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{g} (n={next(iter(groups[g].values()))[0]['n_cases']}): {metric}", fontsize=8)
            ax.set_xlabel("agent evaluations per case", fontsize=7)
            if metric != "extra_background":
                ax.set_ylim(-0.02, 1.05)
            ax.tick_params(labelsize=7)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 8), fontsize=7, frameon=False)
    fig.suptitle(title or f"FI-LoCoMo budget curves ({utility})", fontsize=10)
    fig.tight_layout(rect=(0, 0.05, 1, 0.97))
    fig.savefig(path, dpi=90)
    plt.close(fig)
