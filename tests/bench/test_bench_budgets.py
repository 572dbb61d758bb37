"""The budgeted benchmark (`meclear eval --budgets`, issue 16): lazy union of coalitions, budget accounting through
the estimator contract, and the rule that K=20 never allocates or evaluates 2^20 of anything. Small synthetic cases
with the real reader agent; one small LoCoMo run through the CLI."""

from __future__ import annotations

import json
import tracemalloc

import numpy as np
import pytest

from pipeline.agents.reader import ReaderAgent
from pipeline.audit.cases import Case
from pipeline.bench.builder import BenchCase, CachedAgent
from pipeline.bench.config import EvalConfig
from pipeline.bench.curves import budget_curves, markdown
from pipeline.bench.methods import (
    EXACT_MAX_K,
    Method,
    MethodConfig,
    expand_methods,
    meclear_estimators,
    run_case,
)
from pipeline.core.errors import ConfigError
from pipeline.io.records import Query
from pipeline.retrieval.frozen import FrozenContext
from tests.data_paths import LOCOMO
from tests.golden import run_cli

QUERY = Query("q1", "conv-x", "Where did Ana move?", "Bergen", ("Bergen", "Gdansk"), "1")


def reader_case(k: int, faults: tuple[int, ...]) -> BenchCase:
    """K memories: Ana's true move (position 0 unless a fault sits there), faults stating Gdansk, the rest chatter."""
    texts = [f"Bob: small talk number {i} about the weather." for i in range(k)]
    texts[next(i for i in range(k) if i not in faults)] = "Ana: I moved to Bergen last year."
    for j, p in enumerate(faults):
        texts[p] = f"Ana: Where did Ana move? Ana moved to Gdansk, really ({j})."
    ids = tuple(f"m{i}" for i in range(k))
    ctx = FrozenContext("conv-x", "q1", ids, tuple(texts), (1.0,) * k, tuple(range(1, k + 1)), (None,) * k, "h")
    mech = "direct" if len(faults) == 1 else "redundant"
    return BenchCase(f"q1:{mech}", mech, Case(QUERY, ctx, 7), tuple(ids[p] for p in faults), None)


class Counting:
    """The reader, counting every coalition it is asked (as distinct masks would be)."""

    def __init__(self):
        self.agent, self.requests = ReaderAgent(), []

    def fingerprint(self):
        return self.agent.fingerprint()

    def answer_batch(self, requests):
        self.requests += [tuple(r.memories) for r in requests]
        return self.agent.answer_batch(requests)


def budgeted_names(budgets: tuple[int, ...], k: int) -> tuple[str, ...]:
    return expand_methods(("meclear", "contextcite", "proxyspex", "loo", "controls"), eval_budgets=budgets, top_k=k)


def test_method_names_parse_back_and_exact_stops_at_k12():
    names = budgeted_names((16, 64), 10)
    assert "meclear_exact" in names and "contextcite_b16" in names and "proxyspex_b64" in names
    for est in meclear_estimators():
        assert f"{est}_b16" in names and f"{est}_b64" in names
    assert all(Method.parse(n).name == n for n in names)
    assert Method.parse("contextcite_b64").curve == "contextcite" and Method.parse("contextcite_b64").evals == 64
    at20 = budgeted_names((32,), 20)
    assert "meclear_exact" not in at20 and "loo" in at20
    with pytest.raises(ConfigError, match="2\\^20"):
        expand_methods(("meclear_exact",), top_k=20)
    assert EXACT_MAX_K == 12
    with pytest.raises(ConfigError):
        Method.parse("nosuchestimator_b16")
    with pytest.raises(ConfigError):
        EvalConfig(locomo="x.json", eval_budgets=(16, 16))
    assert EvalConfig(locomo="x.json", eval_budgets=(16,), top_k=10).redundancy == (2, 3)
    with pytest.raises(ConfigError, match="top_k\\+2 = 22"):
        EvalConfig(locomo="x.json", eval_budgets=(16, 64), top_k=20)  # rejected before any work, not on a worker


def test_k10_budgets_are_respected_and_coalitions_are_the_lazy_union():
    bc = reader_case(10, (2, 7))
    agent = Counting()
    counted = CachedAgent(agent, cache=False, phase="methods")
    names = budgeted_names((16, 64), 10)
    out = run_case(bc, counted, names, ("probability", "correct"), MethodConfig())
    assert out is not None
    for name, _, o in out:
        m = Method.parse(name)
        if m.evals is not None:
            assert o.evaluations <= m.evals, (name, o.evaluations)  # clearance checks included
        assert sorted(o.full_ranking) == list(range(10))
    # Each coalition reached the agent once, whatever the number of methods and modes that asked for it: exact
    # enumeration asked for all 1,024, so the union is exactly 2^10 (no more).
    assert len(agent.requests) == len(set(agent.requests)) == 1024
    exact = {u: o for n, u, o in out if n == "meclear_exact"}
    assert set(exact["correct"].ranking) == {2, 7}  # both redundant copies harmful; clearance recovers the answer
    assert exact["correct"].recovered


def test_k20_never_touches_2_to_the_20():
    bc = reader_case(20, (3, 11, 17))
    agent = Counting()
    names = budgeted_names((32, 64), 20)
    tracemalloc.start()
    out = run_case(bc, CachedAgent(agent, cache=False), names, ("correct",), MethodConfig())
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert out is not None
    assert peak < 4 << 20  # a dense 2^20 float64 table alone would be 8 MiB
    # the union of what the methods asked: at most the budgets' worth plus LOO and the controls' clearances
    assert len(agent.requests) == len(set(agent.requests)) <= len(meclear_estimators()) * 96 + 2 * 96 + 4 * 21
    for name, _, o in out:
        m = Method.parse(name)
        assert m.evals is None or o.evaluations <= m.evals


@pytest.mark.skipif(not LOCOMO.exists(), reason="LoCoMo is not beside the checkout")
def test_eval_cli_budgets_writes_curves(tmp_path):
    out = tmp_path / "b"
    run_cli(["eval", "--locomo", str(LOCOMO), "--conversations", "conv-26", "--top-k", "10", "--budgets", "16,32",
             "--max-cases", "1", "--utility", "correct", "--replicates", "20", "--dense", "off", "--agent",
             "reader", "--no-progress", "--methods", "meclear,contextcite,proxyspex,loo,controls"], out)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["budgets"] == [16, 32]
    curves = summary["curves"]["correct"]["all"]
    assert [p["budget"] for p in curves["contextcite"]] == [16, 32]
    for est in meclear_estimators():
        pts = curves[est]
        assert [p["budget"] for p in pts] == [16, 32]
        assert all(p["metrics"]["evaluations_per_case"]["value"] <= p["budget"] for p in pts)
        assert all("vs_contextcite" in p and "same_harmful_as_exact" in p["metrics"] for p in pts)
    assert curves["meclear_exact"][0]["metrics"]["same_harmful_as_exact"]["value"] == 1.0
    assert set(summary["cases"]) == {"direct", "redundant", "redundant_r3", "joint"}
    assert (out / "curves_correct.png").stat().st_size > 0
    assert "Budget curves" in (out / "summary.md").read_text()
    assert np.isfinite(summary["curves"]["correct"]["all"]["loo"][0]["metrics"]["recall_at_m"]["value"])


def test_budget_curves_pair_against_any_reference():
    """`references`: paired differences against any curve at the same budget (jobs/fi_budget_subsets.py pairs the
    default estimator with the others), value = the difference of the two methods' means over the same cases."""
    hits = {"permutation_b32": [1, 1, 0, 1], "kernelshap_b32": [1, 0, 0, 0], "contextcite_b32": [0, 0, 0, 0]}
    rows = [{"case_id": f"c{i}:direct", "conversation": f"conv-{i % 2}", "utility": "correct", "method": name,
             "faults": ["m1"], "cleared": ["m1"] if hit[i] else ["m2"], "full_ranking": ["m1", "m2"],
             "ranking": ["m1"], "recovered": bool(hit[i]), "evaluations": 30}
            for name, hit in hits.items() for i in range(4)]
    curves = budget_curves(rows, tuple(hits), ("correct",), 50, 0, ("contextcite", "kernelshap"))
    perm, ks = curves["correct"]["all"]["permutation"][0], curves["correct"]["all"]["kernelshap"][0]
    assert perm["vs_kernelshap"]["exact_set_match"]["value"] == pytest.approx(0.75 - 0.25)
    assert perm["vs_contextcite"]["exact_set_match"]["value"] == pytest.approx(0.75)
    assert "vs_kernelshap" not in ks and ks["vs_contextcite"]["task_recovery"]["value"] == pytest.approx(0.25)
    assert "paired difference vs kernelshap" in "\n".join(markdown(curves, ("contextcite", "kernelshap")))
    # the default is the benchmark's summary: ContextCite only
    plain = budget_curves(rows, tuple(hits), ("correct",), 50, 0)
    assert "vs_kernelshap" not in plain["correct"]["all"]["permutation"][0]
