"""FI-LoCoMo end to end: `meclear eval` on one conversation, the case builder's causal checks, re-retrieval equivalence.

The real LoCoMo file is read where it exists (skipped otherwise); it is never written, which one test checks by hash.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from pipeline.agents.reader import ReaderAgent
from pipeline.bench.builder import BuildConfig, build_pool, check_masks, passes, verify
from pipeline.bench.faults import MECHANISMS
from pipeline.bench.methods import expand_methods
from pipeline.bench.metrics import METRICS
from pipeline.bench.reretrieval import PoolIndex
from pipeline.cli.main import main
from pipeline.core.errors import ConfigError
from pipeline.core.provenance import sha256_file
from pipeline.io.locomo import load_locomo
from pipeline.io.records import Memory, Pool
from pipeline.retrieval.frozen import Retriever
from tests.data_paths import LOCOMO

needs_locomo = pytest.mark.skipif(not LOCOMO.is_file(), reason=f"{LOCOMO} not available")
METHODS = ("meclear_l4", "meclear_l8", "meclear_l16", "meclear_exact", "loo", "loo_threshold", "contextcite",
           "proxyspex", "filter", "position", "random", "oracle")
SMALL = ["--locomo", str(LOCOMO), "--conversations", "conv-26", "--replicates", "200", "--no-progress"]


@pytest.fixture(scope="module")
def source_hash() -> str:
    return sha256_file(LOCOMO)


@pytest.fixture(scope="module")
def small_run(tmp_path_factory, source_hash) -> Path:
    """One reduced run through the CLI function: conv-26, 3 cases per mechanism, hybrid retrieval, in process."""
    out = tmp_path_factory.mktemp("fi") / "run"
    assert main(["eval", *SMALL, "--out", str(out), "--max-cases", "3", "--executor", "local"]) == 0
    return out


@needs_locomo
def test_eval_outputs_structure_and_invariants(small_run, source_hash):
    df = pl.read_parquet(small_run / "cases.parquet")
    summary = json.loads((small_run / "summary.json").read_text())
    assert set(df["method"].unique()) == set(METHODS)
    assert set(df["utility"].unique()) == {"probability", "correct"}
    # Same paired cohort for every method and mode; at most 3 cases per mechanism (--max-cases is per mechanism).
    cohorts = df.group_by("method", "utility").agg(pl.col("case_id").sort())
    assert len({tuple(c) for c in cohorts["case_id"].to_list()}) == 1
    per_mech = df.filter((pl.col("method") == "loo") & (pl.col("utility") == "correct")).group_by("mechanism").len()
    assert dict(per_mech.iter_rows()) == {m: summary["cases"][m]["kept"] for m in MECHANISMS}
    assert all(1 <= summary["cases"][m]["kept"] <= 3 for m in MECHANISMS)
    # Fault counts by mechanism (r = 2 redundant copies), and every fault is a real injected record of its case.
    sizes = dict(df.group_by("mechanism").agg(pl.col("faults").list.len().max()).iter_rows())
    assert sizes == {"direct": 1, "redundant": 2, "joint": 2}
    assert all(f.startswith(f"{c}#f") for c, fs in zip(df["case_id"], df["faults"]) for f in fs)
    # Budgets: K=5 means at most 32 distinct coalitions, whatever the method.
    assert df["evaluations"].max() <= 32
    for m in ("meclear_exact", "meclear_l16"):
        assert df.filter(pl.col("method") == m)["evaluations"].max() <= 32
    assert (df.filter(pl.col("method") == "meclear_exact")["evaluations"] == 32).all()
    assert (df["cleared"].list.len() <= 5).all()
    # summary.json: every metric of every method and mode, fractions within [0, 1], intervals around the value.
    for mode in ("probability", "correct"):
        methods = summary["utility_modes"][mode]["methods"]
        assert set(methods) == set(METHODS)
        for name, entry in methods.items():
            assert set(entry["overall"]) == set(METRICS)
            assert set(entry["by_mechanism"]) == set(MECHANISMS)
            for metric, iv in entry["overall"].items():
                assert iv["ci_low"] - 1e-9 <= iv["value"] <= iv["ci_high"] + 1e-9
                if metric not in ("extra_background", "evaluations_per_case"):
                    assert 0.0 <= iv["value"] <= 1.0
            assert ("paired_vs_loo" in entry) == (name != "loo")
            assert ("paired_vs_position" in entry) == (name != "position")
    # The paper's blind spot: in correct mode LOO flags no redundant fault (by construction of the cases: removing one
    # copy leaves the answer wrong, so its LOO is exactly 0). Deliberately changed (issue 7): this now reads the
    # THRESHOLDED Recall@|M|; the full-ranking Recall@|M| ranks LOO's zeros at random with the case seed.
    correct = summary["utility_modes"]["correct"]["methods"]
    red = {n: e["by_mechanism"]["redundant"] for n, e in correct.items()}
    assert red["loo"]["recall_at_m_thresholded"]["value"] == 0.0 == red["loo_threshold"]["recall_at_m_thresholded"][
        "value"]
    assert red["meclear_exact"]["recall_at_m"]["value"] >= 0.6 and red["meclear_l16"]["recall_at_m"]["value"] >= 0.6
    # Controls: the oracle (true faults first) recovers every scored case and ranks every fault in the top |M|;
    # position and random spend exactly K + 1 = 6 evaluations (the full nested clearance).
    for mode in ("probability", "correct"):
        o = summary["utility_modes"][mode]["methods"]["oracle"]["overall"]
        assert o["task_recovery"]["value"] == 1.0 and o["recall_at_m"]["value"] == 1.0
    assert set(df.filter(pl.col("method").is_in(["position", "random"]))["evaluations"]) <= {6}
    # Every row carries a full ranking of the K memories; the thresholded list is a prefix-free subset of it.
    assert (df["full_ranking"].list.len() == 5).all()
    assert all(set(r) <= set(f) for r, f in zip(df["ranking"].to_list(), df["full_ranking"].to_list()))
    ctx = df.filter(pl.col("method") == "oracle")
    assert all(set(f[: len(m)]) == set(m) for f, m in zip(ctx["full_ranking"].to_list(), ctx["faults"].to_list()))
    # The fault-position histogram, excluded count, conversations and agent calls by phase are reported.
    hist = summary["fault_positions"]
    assert sum(hist["overall"]["counts"]) == summary["fault_records"] and len(hist["overall"]["counts"]) == 5
    assert all(sum(hist["by_mechanism"][m]["counts"]) > 0 for m in MECHANISMS)
    assert summary["excluded"]["total"] + summary["n_scored_cases"] == summary["n_cases"]
    assert summary["conversations"] == {"run": 1, "with_cases": 1}
    assert {"build_clean", "build_verify", "methods"} <= set(summary["agent_calls"])
    assert summary["agent"].startswith("reader-") and summary["source"]["sha256"] == source_hash
    md = (small_run / "summary.md").read_text()
    assert "## Utility: correct" in md and "Sensitivity to the permutation budget" in md
    assert "Paired difference vs the position control" in md
    assert "Fault records per context position" in md and "Excluded" in md and "| oracle |" in md
    assert (small_run / "figure.png").stat().st_size > 10_000
    assert not list(small_run.glob(".*"))  # no temporary files left behind


@needs_locomo
def test_builder_cases_pass_their_mechanism_check_and_source_is_untouched(source_hash):
    pools, queries = load_locomo(LOCOMO, conversations=["conv-30"])
    index = PoolIndex(pools, dense="off")
    agent = ReaderAgent()
    res = build_pool(agent, index, pools["conv-30"], queries, BuildConfig(max_cases=5))
    assert {c.mechanism for c in res.cases} == set(MECHANISMS)
    for m in MECHANISMS:
        got = [c for c in res.cases if c.mechanism == m]
        assert len(got) <= 5 and res.counts[m].verified >= len(got) and res.counts[m].tried >= res.counts[m].verified
    for bc in res.cases:
        assert verify(ReaderAgent(), bc), bc.case_id  # a fresh agent agrees
        assert set(bc.faults) <= set(bc.case.context.memory_ids)
        assert bc.case.k == 5
        # The source pool holds no fault: injection lives only in the benchmark's copy.
        assert not set(bc.faults) & {m.memory_id for m in pools["conv-30"].memories}
    assert sha256_file(LOCOMO) == source_hash


def test_mechanism_checks_on_outcomes():
    # outcomes in check_masks order: N, N minus F, then N minus each single fault
    assert check_masks("direct", 5, (0,)) == [31, 30]
    assert check_masks("redundant", 5, (0, 3)) == [31, 22, 30, 23]
    assert passes("direct", [False, True]) and not passes("direct", [True, True])
    assert passes("redundant", [False, True, False, False]) and not passes("redundant", [False, True, True, False])
    assert passes("joint", [False, True, True, True]) and not passes("joint", [False, True, False, True])
    assert not passes("joint", [False, False, True, True])


def test_pool_index_equals_retriever_on_extended_pool():
    """Re-retrieval with injected records equals a full re-index of the pool copy (BM25; dense is the same formula)."""
    from pipeline.audit.run import InputSpec

    pools, queries, _ = InputSpec().load()
    index = PoolIndex(pools, dense="off")
    for q in queries[:12]:
        extra = (Memory(f"{q.query_id}#f0", f"[1 May, 2024] Ana: About {q.question} - it was {q.options[0]}."),
                 Memory(f"{q.query_id}#f1", "[2 May, 2024] Ana: Random thought: nothing."))
        pool = pools[q.pool_id]
        copy = {q.pool_id: Pool(pool.pool_id, pool.memories + extra, pool.source)}
        assert index.freeze(q, extra=extra) == Retriever(copy, 5, dense="off").freeze_all([q])[0]
        assert index.freeze(q) == Retriever(pools, 5, dense="off").freeze_all([q])[0]


def test_method_names_expand_and_bad_input_writes_nothing(tmp_path):
    assert expand_methods(["meclear", "loo"]) == ("meclear_l4", "meclear_l8", "meclear_l16", "meclear_exact", "loo",
                                                  "loo_threshold")
    assert expand_methods(["meclear_l8", "filter"]) == ("meclear_l8", "filter")
    assert expand_methods(["controls", "random"]) == ("position", "random", "oracle")
    with pytest.raises(ConfigError):
        expand_methods(["shapley"])
    out = tmp_path / "never"
    assert main(["eval", "--locomo", str(tmp_path / "missing.json"), "--out", str(out), "--executor", "local"]) == 2
    assert main(["eval", "--locomo", str(LOCOMO), "--out", str(out), "--methods", "nope", "--executor", "local"]) == 2
    assert main(["eval", "--locomo", str(LOCOMO), "--out", str(out), "--utility", "gold", "--executor", "local"]) == 2
    if LOCOMO.is_file():
        assert main(["eval", "--locomo", str(LOCOMO), "--out", str(out), "--conversations", "conv-999",
                     "--executor", "local"]) == 2
    assert not out.exists()


@needs_locomo
@pytest.mark.ray
def test_ray_executor_gives_the_same_rows_as_local(ray_session, tmp_path):
    args = [*SMALL, "--max-cases", "2", "--dense", "off", "--methods", "meclear_l8,loo,contextcite,filter"]
    assert main(["eval", *args, "--out", str(tmp_path / "local"), "--executor", "local"]) == 0
    assert main(["eval", *args, "--out", str(tmp_path / "ray"), "--executor", "ray", "--actors", "2"]) == 0
    cols = ["case_id", "method", "utility", "faults", "ranking", "cleared", "recovered", "evaluations"]
    local, ray = (pl.read_parquet(tmp_path / d / "cases.parquet").select(cols).sort("case_id", "method", "utility")
                  for d in ("local", "ray"))
    assert local.equals(ray) and local.height > 0
    assert np.isclose(json.loads((tmp_path / "ray" / "summary.json").read_text())["cases"]["joint"]["kept"], 2)


@needs_locomo
def test_ray_job_entry_point_reads_a_yaml_config(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("fi_locomo", Path(__file__).parents[2] / "jobs" / "fi_locomo.py")
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    job_main = job.main
    cfg = tmp_path / "fi.yaml"
    cfg.write_text(f"locomo: {LOCOMO}\nconversations: [conv-26]\nmax_cases: 1\nmethods: [loo, meclear_l4]\n"
                   "utility: [correct]\ndense: 'off'\nreplicates: 50\nexecutor: local\n")
    assert job_main(["--config", str(cfg), "--out", str(tmp_path / "out"), "--no-progress"]) == 0
    df = pl.read_parquet(tmp_path / "out" / "cases.parquet")
    assert set(df["method"]) == {"loo", "loo_threshold", "meclear_l4"} and set(df["utility"]) == {"correct"}
    cfg.write_text(f"locomo: {LOCOMO}\nmax_case: 1\n")  # misspelt key: an error, not ignored
    assert job_main(["--config", str(cfg), "--out", str(tmp_path / "bad")]) == 2
    assert not (tmp_path / "bad").exists()
