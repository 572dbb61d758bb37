"""Assemble the audit report (pool summary, trends over previous runs, per-query detail) and the eval report."""

from __future__ import annotations

import base64
import json
from pathlib import Path

from pipeline.core.progress import progress_bar
from pipeline.report import data as rd
from pipeline.report import plots
from pipeline.report.page import document, esc, html_table

FIGURES = ("harm", "all", "none")


def _section(title: str, body: str, sid: str = "") -> str:
    return f'<section{f" id={chr(34)}{sid}{chr(34)}" if sid else ""}><h2>{esc(title)}</h2>{body}</section>'


POOL_COLS = [
    ("pool", "pool"), ("queries", "queries audited"), ("harmful", "harmful memory flags"),
    ("harmful_distinct", "distinct harmful memories"), ("queries_with_harm", "queries with harm"),
    ("wrong", "wrongly answered"), ("recovered", "recovered by clearance"), ("cleared", "clearances chosen"),
    ("evaluations", "agent evaluations"), ("substitution_pairs", "redundant pairs (substitution, both harmful)"),
    ("joint_pairs", "joint-interference pairs (both harmful)"),
]


def pool_section(run: rd.Run, pools: list[dict]) -> str:
    total = {k: sum(p[k] for p in pools) for k, _ in POOL_COLS[1:]}
    rows = [[p[k] for k, _ in POOL_COLS] for p in pools]
    if len(pools) > 1:
        rows.append(["all pools", *[total[k] for k, _ in POOL_COLS[1:]]])
    cfg = run.manifest.config
    note = (f'<p class="muted">agent {esc(run.manifest.agent)}, utility {esc(cfg.get("utility"))}, '
            f'K={esc(cfg.get("top_k"))}, L={esc(cfg.get("permutations"))}, τ={esc(cfg.get("tau"))}, '
            f'retrieval {esc(run.manifest.retrieval)}. "Recovered" counts wrongly answered queries whose '
            "verified clearance gives the gold answer.</p>")
    fig = plots.pool_figure(pools) if len(pools) <= 40 else ""  # beyond 40 pools the table says more than bars
    return _section("Pools", html_table([h for _, h in POOL_COLS], rows, set(range(1, len(POOL_COLS)))) + note
                    + f"<figure>{fig}</figure>", "pools")


def trend_section(runs: list[rd.Run], summaries: list[list[dict]]) -> str:
    labels = [r.label for r in runs]
    pools = sorted({p["pool"] for s in summaries for p in s})
    series = {pool: [next((p for p in s if p["pool"] == pool), None) for s in summaries] for pool in pools}
    rows = []
    for pool in pools:
        for r, p in zip(runs, series[pool]):
            if p is not None:
                rows.append([pool, r.label, p["harmful"], p["wrong"], p["recovered"], p["evaluations"]])
    body = f"<figure>{plots.trend_figure(labels, series)}</figure>"
    body += html_table(["pool", "run", "harmful memory flags", "wrongly answered", "recovered", "agent evaluations"],
                       rows, {2, 3, 4, 5})
    prev, cur = runs[-2], runs[-1]
    before, after = rd.harmful_memories(prev), rd.harmful_memories(cur)
    texts = {**rd.memory_texts(prev), **rd.memory_texts(cur)}
    became = sorted(set(after) - set(before))
    stopped = sorted(set(before) - set(after))
    body += f"<h3>Became harmful since {esc(prev.label)} ({len(became)})</h3>"
    body += html_table(["pool", "memory", "queries where harmful", "text"],
                       [[p, m, after[(p, m)], texts.get((p, m), "")] for p, m in became],
                       {2}) if became else "<p class=muted>none</p>"
    body += f"<h3>Stopped being harmful ({len(stopped)})</h3>"
    body += html_table(["pool", "memory", "queries where it was harmful", "text"],
                       [[p, m, before[(p, m)], texts.get((p, m), "")] for p, m in stopped],
                       {2}) if stopped else "<p class=muted>none</p>"
    return _section("Night over night", body, "trends")


def query_section() -> str:
    head = "".join(f"<th>{esc(h)}</th>" for h in
                   ["pool", "query", "question", "status", "harmful", "utility", "after clearance", "evaluations"])
    return _section("Queries", (
        '<p><input type="search" id="qsearch" placeholder="search pool, query, question, memory id, status">'
        ' <span id="qcount" class="muted"></span>'
        ' <span class="muted">— click a column to sort, a row for detail</span></p>'
        f'<div class="wrap"><table id="qtable"><thead><tr>{head}</tr></thead><tbody></tbody></table>'
        '<button id="qmore" hidden></button></div>'
        '<div id="detail" hidden><div id="detail-body"></div></div>'
    ), "queries")


def _one_figure(rec: dict) -> str:
    return plots.packed(plots.query_figure(rec))


def _figures(records: list[dict], jobs: int, progress: bool):
    """Per-query figures, packed, in order. Matplotlib is single-threaded and a figure costs ~0.13 s on the development
    machine (measured while it was busy), so the figures of a large run are drawn in worker processes."""
    # a tqdm bar on a terminal only: a job log (not a terminal) gets plain lines, never carriage returns
    bar = progress_bar(len(records), "query figures", "query", enabled=progress)
    if jobs <= 1 or len(records) < 64:
        for rec in records:
            yield _one_figure(rec)
            bar.update(1)
    else:
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(jobs) as pool:
            for svg in pool.map(_one_figure, records, chunksize=16):
                yield svg
                bar.update(1)
    bar.close()


def audit_report(run_dir: str | Path, previous: list[str | Path] = (), figures: str = "harm",
                 progress: bool = True, jobs: int = 0) -> tuple[str, dict]:
    import os

    jobs = jobs or min(8, os.cpu_count() or 1)
    run = rd.load_run(run_dir)
    prev_runs = [rd.load_run(p) for p in previous]
    pools = rd.pool_summary(run)
    records = rd.query_records(run)
    wanted = [figures == "all" or (figures == "harm" and rec["harmful"] > 0) for rec in records]
    # drawn to the end (the page holds them all anyway), so the progress reporter closes with its final line
    svgs = iter(list(_figures([rec for rec, w in zip(records, wanted) if w], jobs, progress)))
    out_q = []
    for rec, want in zip(records, wanted):
        rec = {k: v for k, v in rec.items() if k not in ("matrix", "labels")}
        rec["mem_ids"] = " ".join(m["id"] for m in rec["memories"])
        rec["figure"] = next(svgs) if want else None
        out_q.append(rec)
    sections = [pool_section(run, pools)]
    if prev_runs:
        runs = sorted([*prev_runs], key=lambda r: r.when) + [run]
        sections.append(trend_section(runs, [rd.pool_summary(r) for r in runs]))
    sections.append(query_section())
    title = f"MeClear audit report — {run.path.name}"
    sub = f"run {run.manifest.run_id} · written {run.when} · {len(records)} queries in {len(pools)} pools"
    stats = {"queries": len(records), "figures": sum(w for w in wanted)}
    return document(title, sub, sections, {"queries": out_q}, script=True), stats


def is_eval(path: str | Path) -> bool:
    return (Path(path) / "summary.json").is_file() and (Path(path) / "cases.parquet").is_file()


def eval_report(eval_dir: str | Path) -> str:
    """The benchmark's tables (from summary.json) and figure (figure.png, inlined) through the same page code."""
    p = Path(eval_dir)
    s = json.loads((p / "summary.json").read_text())
    import polars as pl

    cases = pl.read_parquet(p / "cases.parquet", glob=False)
    sections = []
    counts = [[m, c.get("kept"), *(v for k, v in c.items() if k != "kept")] for m, c in s.get("cases", {}).items()]
    if counts:
        extra = [k for k in next(iter(s["cases"].values())) if k != "kept"]
        sections.append(_section("Cases", html_table(["mechanism", "kept", *extra], counts,
                                                     set(range(1, 2 + len(extra))))
                                 + f'<p class="muted">{esc(s.get("n_cases"))} cases from '
                                 f'{(nc := cases["conversation"].n_unique())} conversation{"s" if nc != 1 else ""}, '
                                 f'{esc(s.get("fault_records"))} fault '
                                 f'records; agent {esc(s.get("agent"))}; '
                                 f'{esc(s.get("metrics", {}).get("intervals"))}</p>'))
    fractions = set(s.get("metrics", {}).get("fractions", []))
    for mode, block in s.get("utility_modes", {}).items():
        methods = block.get("methods", {})
        if not methods:
            continue
        metrics = list(next(iter(methods.values()))["overall"])
        rows = []
        for name, entry in methods.items():
            cells = [name, entry.get("n_cases")]
            for met in metrics:
                iv = entry["overall"][met]
                scale = 100.0 if met in fractions else 1.0
                cells.append(f"{iv['value'] * scale:.1f} [{iv['ci_low'] * scale:.1f}, {iv['ci_high'] * scale:.1f}]")
            rows.append(cells)
        sections.append(_section(f"Utility mode: {mode}", html_table(["method", "n", *metrics], rows,
                                                                     set(range(1, 2 + len(metrics))))
                                 + '<p class="muted">fractions in %, with 95% intervals</p>'))
    if (p / "figure.png").is_file():
        b64 = base64.b64encode((p / "figure.png").read_bytes()).decode("ascii")
        sections.append(_section("Figure", f'<img alt="benchmark figure" style="max-width:100%" '
                                           f'src="data:image/png;base64,{b64}">'))
    return document(f"MeClear benchmark — {p.name}", f"{s.get('benchmark', '')} run {s.get('run_id', '')}", sections)
