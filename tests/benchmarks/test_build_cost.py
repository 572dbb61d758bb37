"""The builder benchmark (`jobs/bench_engine.py --builder`, `benchmarks.build_cost`) on the reader agent: the same
function the SmolLM2 figure comes from, with a cheap agent, checked for identical cases and fewer engine calls."""

from __future__ import annotations

import pytest

from pipeline.agents.reader import ReaderAgent
from tests.data_paths import LOCOMO


@pytest.mark.skipif(not LOCOMO.is_file(), reason=f"{LOCOMO} not available")
def test_builder_benchmark_builds_the_same_cases_with_fewer_engine_calls():
    """The builder benchmark (`jobs/bench_engine.py --builder`) on the reader: "before" (per-candidate causal checks)
    and "after" (wave prefetch) build identical cases from empty caches, and the waves need fewer engine calls."""
    from benchmarks.build_cost import compare_builds, format_builder
    from pipeline.bench.builder import BuildConfig
    from pipeline.bench.reretrieval import PoolIndex
    from pipeline.io.locomo import load_locomo

    pools, queries = load_locomo(LOCOMO, conversations=["conv-26"])
    rep = compare_builds(ReaderAgent(), PoolIndex(pools, dense="off"), pools["conv-26"], queries,
                         BuildConfig(max_queries=24))
    before, wave, groups = rep["rows"]
    assert [r["variant"] for r in rep["rows"]] == ["off", "wave", "groups"]
    assert rep["identical"] and len(rep["case_ids"]) == before["cases"] == groups["cases"] > 0
    for after in (wave, groups):
        assert after["checked"] == before["checked"] == 24 and after["clean"] == before["clean"]
        # the clean checks are the same one batch every way; the causal checks go in fewer, larger batches
        assert before["engine_calls"]["build_clean"] == after["engine_calls"]["build_clean"] == 1
        assert before["requests"]["build_clean"] == after["requests"]["build_clean"] == 24
        assert after["engine_calls"]["build_verify"] < before["engine_calls"]["build_verify"]
        assert rep["ratio_engine_calls"][after["variant"]] > 1
        # batching ahead may ask requests a decision never needs (a case kept earlier made a position over-full)
        assert after["requests"]["build_verify"] >= before["requests"]["build_verify"]
    # whole waves ask checks a case kept earlier in the wave makes needless; groups ask none here (16 of 16)
    assert groups["requests"]["build_verify"] == before["requests"]["build_verify"] < wave["requests"]["build_verify"]
    assert before["prompt_tokens"] is None and before["floor_s"] is None  # the reader reports no tokens
    table = format_builder(rep)
    assert "| off (before: per-candidate checks) | 24 |" in table and "cases identical every way: yes" in table


def test_builder_benchmark_ways_start_with_the_reference():
    from benchmarks.build_cost import check_ways

    assert check_ways(["off", "groups"]) == ("off", "groups")
    for bad in ((), ("groups",), ("off", "off"), ("off", "fast")):
        with pytest.raises(ValueError, match="'off' first"):
            check_ways(bad)
