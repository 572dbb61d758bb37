"""`meclear curate`: totals equal a hand computation over the raw rows of two small runs; the file reads in polars."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import polars as pl
import pyarrow.parquet as pq

from pipeline.audit.run import AuditConfig, InputSpec, audit, sample_paths
from pipeline.cli.main import main
from pipeline.report.curate import CURATION

FAST = AuditConfig(executor="local", dense="off")


def _runs(tmp: Path) -> list[Path]:
    mem, queries = sample_paths()
    rows = [json.loads(line) for line in mem.read_text().splitlines() if line.strip()]
    changed = tmp / "night1.jsonl"  # the first night lacks two planted records
    changed.write_text("".join(json.dumps(r) + "\n" for r in rows if r["memory_id"] not in ("ana-02", "ben-20")))
    out1, out2 = tmp / "night1", tmp / "night2"
    audit(InputSpec(memories=[str(changed)], queries=[str(queries)]), FAST, out1, progress=False)
    audit(InputSpec(), FAST, out2, progress=False)
    return [out1, out2]


def test_curation_totals_equal_a_hand_computation(tmp_path, capsys):
    runs = _runs(tmp_path)
    out = tmp_path / "curation.parquet"
    before = {p: sorted(f.stat().st_mtime_ns for f in p.rglob("*")) for p in runs}
    assert main(["curate", *map(str, runs), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert pq.read_schema(out).remove_metadata() == CURATION
    got = {(r["pool_id"], r["memory_id"]): r for r in pl.read_parquet(out).to_dicts()}

    # by hand, from the raw rows
    harmful, retrieved, phis, worst = defaultdict(int), defaultdict(int), defaultdict(list), {}
    cleared, recovering, runs_seen = defaultdict(int), defaultdict(int), defaultdict(set)
    mech = defaultdict(int)
    for run in runs:
        harm_pos = {(a["pool_id"], a["query_id"], a["position"])
                    for a in pq.read_table(run / "attributions").to_pylist() if a["harmful"]}
        for i in pq.read_table(run / "interactions").to_pylist():
            if {(i["pool_id"], i["query_id"], i["position_a"]),
                    (i["pool_id"], i["query_id"], i["position_b"])} <= harm_pos:
                for m in (i["memory_a"], i["memory_b"]):
                    mech[(i["pool_id"], m, i["label"])] += 1
        for a in pq.read_table(run / "attributions").to_pylist():
            key = (a["pool_id"], a["memory_id"])
            retrieved[key] += 1
            worst[key] = min(worst.get(key, 1e9), a["shapley"])
            if a["harmful"]:
                harmful[key] += 1
                phis[key].append(a["shapley"])
                runs_seen[key].add(run.name)
        for c in pq.read_table(run / "clearances").to_pylist():
            for m in c["cleared"]:
                cleared[(c["pool_id"], m)] += 1
                recovering[(c["pool_id"], m)] += c["recovered"] is True
    assert set(got) == set(harmful)
    for key, row in got.items():
        assert row["harmful_queries"] == harmful[key] and row["retrieved_queries"] == retrieved[key], key
        assert abs(row["mean_shapley"] - sum(phis[key]) / len(phis[key])) < 1e-12, key
        assert row["worst_shapley"] == worst[key], key
        assert row["cleared"] == cleared[key] and row["cleared_recovering"] == recovering[key], key
        assert row["runs"] == len(runs_seen[key]), key
        assert row["substitution_pairs"] == mech[(*key, "substitution")], key
        assert row["joint_interference_pairs"] == mech[(*key, "joint_interference")], key
    assert sum(r["harmful_queries"] for r in got.values()) == sum(harmful.values())
    assert sum(r["substitution_pairs"] for r in got.values()) > 0  # the planted redundant copies
    assert got[("ben", "ben-02")]["substitution_pairs"] >= 1
    # memories present only on the second night are first seen there; the others on the first night
    assert got[("ana", "ana-02")]["first_seen_run"] == "night2" and got[("ana", "ana-02")]["runs"] == 1
    assert any(r["first_seen_run"] == "night1" and r["last_seen_run"] == "night2" for r in got.values())
    ranks = pl.read_parquet(out).sort("rank")
    assert ranks["rank"].to_list() == list(range(1, ranks.height + 1))
    assert ranks["harmful_queries"].to_list() == sorted(ranks["harmful_queries"].to_list(), reverse=True)
    assert "Porto" in ranks.filter(pl.col("memory_id") == "ana-02")["text"][0]
    assert "rank  pool/memory" in printed and "memory bank is untouched" in printed
    assert {p: sorted(f.stat().st_mtime_ns for f in p.rglob("*")) for p in runs} == before  # runs only read
