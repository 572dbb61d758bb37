"""Read an audit run folder into plain per-pool and per-query records for the report, curation and trends."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import polars as pl

from pipeline.core.errors import InputError, OutputError
from pipeline.game.clearance import nested_removals
from pipeline.store import manifest as manifests
from pipeline.store import parts
from pipeline.store.manifest import Manifest
from pipeline.store.schemas import DATASETS

REQUIRED = ("clearances", "attributions", "interactions", "contexts", "utilities")


@dataclass
class Run:
    path: Path
    manifest: Manifest
    when: str  # ISO time the run was written (manifest mtime), UTC
    clearances: pl.DataFrame
    attributions: pl.DataFrame
    interactions: pl.DataFrame
    contexts: pl.DataFrame
    utilities: pl.DataFrame  # the run's agent and utility mode only, one row per (case, coalition)

    @property
    def label(self) -> str:
        return f"{self.path.name} ({self.when[:16].replace('T', ' ')})"


def is_run(path: str | Path) -> bool:
    return manifests.exists(path) and (Path(path) / "clearances").is_dir()


def check_distinct(paths: list[str | Path], what: str = "run") -> None:
    """Each run given once to `curate` or `report` (with its `--previous`): the same folder under another name (a
    trailing slash, `./`, a link, a bind mount: resolved path and device/inode), or a copy of the same run attempt
    (same run_id and attempt), is one line, exit 2; counting it twice would double every query of it.

    Two runs with the same run_id but different attempts are two executions (two nights over unchanged inputs and
    settings) and both count: that is the evidence seen again that curation weighs (`pipeline.report.curate`)."""
    seen: dict[object, str] = {}
    for p in paths:
        folder = Path(p)
        st = folder.stat()
        keys: list[object] = [folder.resolve(), (st.st_dev, st.st_ino)]
        try:
            m = manifests.read(folder)
            keys.append((m.run_id, m.attempt))
        except (InputError, OutputError):
            pass  # the reader reports the bad manifest itself
        for key in keys:
            if key in seen:
                raise InputError(folder, "", None, f"is the same {what} as {seen[key]} (given twice); give each run "
                                                   "once")
        for key in keys:
            seen[key] = str(p)


def load_run(path: str | Path) -> Run:
    """A finished run, every part verified and every column of its schema present: a part that lacks one is one line
    naming the file and the column (`pipeline.store.parts.read_dataset`, exit 2), never a column of defaults. There is
    no per-column allowance for older runs: every part of schema version 1 has every column (a part of another version
    is refused by its version)."""
    p = Path(path)
    manifest = manifests.finished(p)
    when = datetime.fromtimestamp(manifests.path(p).stat().st_mtime, tz=timezone.utc).isoformat(timespec="milliseconds")
    read = {name: parts.read_dataset(p, name, DATASETS[name]) for name in REQUIRED}
    clear = read["clearances"]
    keys = clear.select("pool_id", "query_id", "context_hash")
    util = (
        read["utilities"]
        .filter((pl.col("agent") == manifest.agent) & (pl.col("utility_mode") == manifest.config.get("utility")))
        .select("pool_id", "query_id", "context_hash", "coalition", "utility", "correct", "answer")
        .unique(subset=["pool_id", "query_id", "context_hash", "coalition"], keep="first")
        .join(keys, on=["pool_id", "query_id", "context_hash"], how="semi")
    )
    return Run(p, manifest, when, clear, read["attributions"], read["interactions"], read["contexts"], util)


def pool_summary(run: Run) -> list[dict]:
    """Per pool: queries, harmful memories (flags and distinct), failing/recovered, evaluations, mechanisms."""
    c, a, i = run.clearances, run.attributions, run.interactions
    harmful_att = a.filter(pl.col("harmful"))
    # pairs whose members are both harmful: substitution = redundant copies that mask each other; joint interference =
    # records that hurt more together than apart. Counting every labelled pair would count pairs of a harmful memory
    # with the helpful one it contradicts (labelled joint_interference by the reader's softmax), which is not a
    # mechanism.
    harm_pos = harmful_att.select("pool_id", "query_id", "position")
    subs = (
        i.filter(pl.col("label") == "substitution")
        .join(harm_pos.rename({"position": "position_a"}), on=["pool_id", "query_id", "position_a"], how="semi")
        .join(harm_pos.rename({"position": "position_b"}), on=["pool_id", "query_id", "position_b"], how="semi")
    )
    joint = (
        i.filter(pl.col("label") == "joint_interference")
        .join(harm_pos.rename({"position": "position_a"}), on=["pool_id", "query_id", "position_a"], how="semi")
        .join(harm_pos.rename({"position": "position_b"}), on=["pool_id", "query_id", "position_b"], how="semi")
    )
    out = []
    for pool in sorted(c["pool_id"].unique().to_list()):
        cp = c.filter(pl.col("pool_id") == pool)
        rec = cp["recovered"]
        hp = harmful_att.filter(pl.col("pool_id") == pool)
        out.append({
            "pool": pool,
            "queries": cp.height,
            "harmful": hp.height,
            "harmful_distinct": hp["memory_id"].n_unique(),
            "queries_with_harm": int((cp["harmful"] > 0).sum()),
            "wrong": int((~cp["baseline_correct"]).sum()),
            # runs written before `recovered` became null for never-wrong queries: count wrong ones only
            "recovered": int(((~cp["baseline_correct"]) & rec.fill_null(False)).sum()),
            "cleared": int((cp["cleared"].list.len() > 0).sum()),
            "evaluations": int(cp["evaluations"].sum()),
            "substitution_pairs": subs.filter(pl.col("pool_id") == pool).height,
            "joint_pairs": joint.filter(pl.col("pool_id") == pool).height,
        })
    return out


def harmful_memories(run: Run) -> dict[tuple[str, str], int]:
    """(pool, memory) -> number of queries in which it is harmful."""
    g = run.attributions.filter(pl.col("harmful")).group_by("pool_id", "memory_id").len()
    return {(r[0], r[1]): int(r[2]) for r in g.iter_rows()}


def memory_texts(run: Run) -> dict[tuple[str, str], str]:
    t = run.contexts.select("pool_id", "memory_id", "text").unique(subset=["pool_id", "memory_id"], keep="first")
    return {(r[0], r[1]): r[2] for r in t.iter_rows()}


def _status(row: dict) -> str:
    if row["baseline_correct"]:
        return "correct"
    return "recovered" if row["recovered"] else "wrong"


def query_records(run: Run) -> list[dict]:
    """One record per query: the question, the frozen context with attributions, interactions, nested candidates."""
    ctx = {k: g.sort("position") for k, g in run.contexts.group_by("pool_id", "query_id")}
    att = {k: g.sort("position") for k, g in run.attributions.group_by("pool_id", "query_id")}
    inter = {k: g for k, g in run.interactions.group_by("pool_id", "query_id")}
    util: dict[tuple, dict[int, tuple]] = {}
    for pool, q, coal, u, ok, ans in run.utilities.select(
        "pool_id", "query_id", "coalition", "utility", "correct", "answer"
    ).iter_rows():
        util.setdefault((pool, q), {})[coal] = (u, ok, ans)
    tau = float(run.manifest.config["tau"])
    records = []
    for row in run.clearances.iter_rows(named=True):
        key = (row["pool_id"], row["query_id"])
        a = att[key]
        k = a.height
        c = ctx.get(key)
        texts = c["text"].to_list() if c is not None else [""] * k
        ids = a["memory_id"].to_list()
        matrix = np.full((k, k), np.nan)
        labels = [["" for _ in range(k)] for _ in range(k)]
        if key in inter:
            for pa_, pb, v, lab in inter[key].select("position_a", "position_b", "interaction", "label").iter_rows():
                matrix[pa_, pb] = matrix[pb, pa_] = v
                labels[pa_][pb] = labels[pb][pa_] = lab
        ranked = a.filter(pl.col("rank").is_not_null()).sort("rank")["position"].to_list()
        full = (1 << k) - 1
        cases = util.get(key, {})
        cands = []
        cleared = set(row["cleared"])
        for n, removed in enumerate(nested_removals(np.array(ranked, dtype=np.int64)).tolist()):
            u, ok, ans = cases.get(full & ~removed, (None, None, None))
            cands.append({"removed": [ids[p] for p in ranked[:n]], "utility": u, "correct": ok, "answer": ans,
                          "chosen": set(ids[p] for p in ranked[:n]) == cleared, "source": "shapley"})
        source = row.get("source") or "shapley"  # null in parts written before the column
        if not any(c["chosen"] for c in cands):  # proposed by another ranking (pipeline.game.clearance)
            pos = {m: p for p, m in enumerate(ids)}
            u, ok, ans = cases.get(full & ~sum(1 << pos[m] for m in row["cleared"] if m in pos), (None, None, None))
            cands.append({"removed": list(row["cleared"]), "utility": u, "correct": ok, "answer": ans,
                          "chosen": True, "source": source})
        records.append({
            "pool": row["pool_id"], "query": row["query_id"], "question": row["question"] or "",
            "gold": row["gold"] or "", "options": row["options"] or [],
            "before": row["answer_before"], "after": row["answer_after"],
            "baseline": row["baseline_utility"], "cleared_utility": row["cleared_utility"], "gain": row["gain"],
            "baseline_correct": row["baseline_correct"],
            "recovered": row["recovered"] if not row["baseline_correct"] else None,
            "reason": row["reason"], "cleared": list(row["cleared"]), "harmful": row["harmful"],
            "evaluations": row["evaluations"], "estimator": row["estimator"], "status": _status(row),
            "source": source,
            "tau": tau,
            "memories": [
                {"id": ids[p], "text": texts[p] or "", "loo": a["loo"][p], "shapley": a["shapley"][p],
                 "se": a["shapley_se"][p], "harmful": bool(a["harmful"][p]), "rank": a["rank"][p]}
                for p in range(k)
            ],
            "matrix": matrix, "labels": labels, "candidates": cands,
        })
    return records
