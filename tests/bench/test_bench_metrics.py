"""FI-LoCoMo metrics and the two-level cluster bootstrap, on hand-made cases with answers computed by hand."""

from __future__ import annotations

import time

import numpy as np
import pytest

from pipeline.bench import (
    METRICS,
    BenchError,
    CaseResult,
    bootstrap,
    bootstrap_groups,
    case_table,
    full_ranking,
    group_cases,
    metrics,
    paired_difference,
    resample_weights,
)


def case(
    case_id: str,
    faults: tuple,
    ranking: tuple,
    cleared: tuple,
    recovered: bool,
    evaluations: int = 32,
    conversation: str = "conv-1",
    method: str = "meclear",
    utility: str = "gold_logprob",
    mechanism: str = "direct",
) -> CaseResult:
    return CaseResult(
        case_id, conversation, mechanism, method, utility, faults, ranking, cleared, recovered, evaluations
    )


# Three cases, checked by hand:
#  a: M={1},   ranking (1,3),   cleared {1}:     recall 1/1, complete, exact, recovered, extra 0, residual no
#  b: M={2,4}, ranking (2,0,4), cleared {2,0}:   top-2 = {2,0} -> 1 of 2, not complete, not exact, not recovered,
#     extra 1 (memory 0), residual yes (fault 4 still in context and the answer is wrong)
#  c: M={0,3}, ranking (3,0,1), cleared {3,0,1}: top-2 = {3,0} -> 2 of 2, complete, not exact, not recovered (over-
#     truncation), extra 1, residual no (no fault left)
HAND = [
    case("a", (1,), (1, 3), (1,), True, evaluations=6),
    case("b", (2, 4), (2, 0, 4), (2, 0), False, evaluations=32),
    case("c", (0, 3), (3, 0, 1), (3, 0, 1), False, evaluations=10),
]


def test_metrics_on_hand_made_cases():
    got = metrics(HAND)
    assert set(got) == set(METRICS)
    assert got["recall_at_m"] == pytest.approx((1 + 1 + 2) / (1 + 2 + 2))  # micro: 4/5, not the case mean 0.833
    assert got["complete_set_recall"] == pytest.approx(2 / 3)
    assert got["exact_set_match"] == pytest.approx(1 / 3)
    assert got["task_recovery"] == pytest.approx(1 / 3)
    assert got["extra_background"] == pytest.approx((0 + 1 + 1) / 3)
    assert got["residual_error_risk"] == pytest.approx(1 / 3)
    assert got["evaluations_per_case"] == pytest.approx((6 + 32 + 10) / 3)


def test_short_ranking_counts_missing_slots_as_misses():
    # |M| = 3, ranking names only one fault: recall 1/3
    got = metrics([case("x", ("m1", "m2", "m3"), ("m2",), ("m2",), False)])
    assert got["recall_at_m"] == pytest.approx(1 / 3)
    assert got["residual_error_risk"] == 1.0


def test_exact_match_is_order_free_and_string_ids_work():
    got = metrics([case("x", ("m1", "m2"), ("m2", "m1"), ("m2", "m1"), True)])
    assert got["exact_set_match"] == 1.0 and got["complete_set_recall"] == 1.0 and got["extra_background"] == 0.0


def test_case_table_contributions_are_sorted_by_case_id():
    table = case_table(list(reversed(HAND)))
    assert table.case_ids == ("a", "b", "c")
    j = METRICS.index("recall_at_m")
    np.testing.assert_array_equal(table.numerators[:, j], [1, 1, 2])
    np.testing.assert_array_equal(table.denominators[:, j], [1, 2, 2])


@pytest.mark.parametrize(
    "change, message",
    [
        ({"mechanism": "sideways"}, "mechanism"),
        ({"faults": ()}, "faults is empty"),
        ({"ranking": (1, 1)}, "repeats"),
        ({"evaluations": -1}, "evaluations"),
    ],
)
def test_bad_records_are_named_errors(change, message):
    fields = dict(case_id="x", faults=(1,), ranking=(1,), cleared=(1,), recovered=True)
    fields.update(change)
    with pytest.raises(BenchError, match=message):
        case(**fields)


def test_groups_must_not_mix_and_ids_must_be_unique():
    with pytest.raises(BenchError, match="mix"):
        metrics([HAND[0], case("z", (1,), (1,), (1,), True, method="loo")])
    with pytest.raises(BenchError, match="more than once"):
        metrics([HAND[0], HAND[0]])
    with pytest.raises(BenchError, match="no cases"):
        metrics([])
    assert set(group_cases(HAND + [case("z", (1,), (1,), (1,), True, method="loo")])) == {
        ("meclear", "gold_logprob"),
        ("loo", "gold_logprob"),
    }


def bernoulli_cases(p: float, n_clusters: int, per_cluster: int, seed: int, method: str = "meclear") -> list:
    rng = np.random.default_rng(seed)
    out = []
    for c in range(n_clusters):
        for i in range(per_cluster):
            ok = bool(rng.random() < p)
            out.append(case(f"c{c}-{i}", (0,), (0,), (0,) if ok else (), ok, conversation=f"conv-{c}", method=method))
    return out


def test_bootstrap_interval_covers_known_p():
    p = 0.7
    cases = bernoulli_cases(p, n_clusters=10, per_cluster=60, seed=1)
    ci = bootstrap(cases, replicates=2000, seed=0)["task_recovery"]
    assert ci["ci_low"] <= p <= ci["ci_high"]
    assert ci["ci_low"] < ci["value"] < ci["ci_high"]
    assert ci["ci_high"] - ci["ci_low"] < 0.15


def test_bootstrap_coverage_is_near_nominal():
    # 200 data sets with known p: a 95% interval should miss p rarely (binomial sd of the miss rate ~ 1.5%).
    p, misses = 0.4, 0
    for s in range(200):
        ci = bootstrap(bernoulli_cases(p, 8, 25, seed=100 + s), replicates=400, seed=s)["task_recovery"]
        misses += not ci["ci_low"] <= p <= ci["ci_high"]
    assert misses / 200 < 0.12


def test_degenerate_data_gives_zero_width_interval():
    cases = [
        case(f"c{c}-{i}", (0, 1), (0, 1), (0, 1), True, conversation=f"conv-{c}") for c in range(4) for i in range(5)
    ]
    out = bootstrap(cases, replicates=500, seed=3)
    for name in ("recall_at_m", "complete_set_recall", "exact_set_match", "task_recovery", "residual_error_risk"):
        assert out[name]["ci_low"] == out[name]["value"] == out[name]["ci_high"]
    assert out["task_recovery"]["value"] == 1.0 and out["residual_error_risk"]["value"] == 0.0


def test_paired_difference_of_identical_methods_is_exactly_zero():
    a = bernoulli_cases(0.5, 6, 20, seed=4, method="meclear")
    b = bernoulli_cases(0.5, 6, 20, seed=4, method="loo")
    diff = paired_difference(a, b, replicates=1000, seed=0)
    for name in METRICS:
        assert diff[name] == {"value": 0.0, "ci_low": 0.0, "ci_high": 0.0}


def test_paired_difference_value_and_order_independence():
    a = bernoulli_cases(0.8, 6, 30, seed=5, method="meclear")
    b = bernoulli_cases(0.3, 6, 30, seed=6, method="loo")
    # faults and conversations are shared by construction; only the outcomes differ
    diff = paired_difference(a, list(reversed(b)), replicates=1000, seed=0)["task_recovery"]
    expected = metrics(a)["task_recovery"] - metrics(b)["task_recovery"]
    assert diff["value"] == pytest.approx(expected)
    assert diff["ci_low"] < expected < diff["ci_high"]


def test_paired_difference_needs_the_same_cohort():
    a = bernoulli_cases(0.5, 2, 3, seed=1)
    b = bernoulli_cases(0.5, 2, 3, seed=1, method="loo")[:-1]
    with pytest.raises(BenchError, match="same cases"):
        paired_difference(a, b)
    c = [case(x.case_id, (9,), (9,), (9,), True, conversation=x.conversation, method="loo") for x in a]
    with pytest.raises(BenchError, match="faults differ"):
        paired_difference(a, c)


def test_bootstrap_is_deterministic_given_a_seed():
    cases = bernoulli_cases(0.6, 5, 20, seed=7)
    assert bootstrap(cases, replicates=300, seed=11) == bootstrap(cases, replicates=300, seed=11)
    assert bootstrap(cases, replicates=300, seed=11) != bootstrap(cases, replicates=300, seed=12)


def test_resample_weights_are_two_level():
    clusters = np.repeat(np.arange(3), [2, 5, 9])
    w = resample_weights(clusters, replicates=400, seed=0)
    sizes = np.array([2, 5, 9])
    # each replicate draws 3 clusters; a cluster drawn c times contributes c * n_c case draws, so totals per cluster
    # are multiples of its size and sum to the sizes of 3 drawn clusters
    per_cluster = np.stack([w[:, clusters == c].sum(axis=1) for c in range(3)], axis=1)
    assert np.all(per_cluster % sizes == 0)
    assert np.all((per_cluster // sizes).sum(axis=1) == 3)
    with pytest.raises(BenchError, match="replicates"):
        bootstrap(HAND, replicates=0)
    with pytest.raises(BenchError, match="level"):
        bootstrap(HAND, level=1.5)


def test_bootstrap_groups_is_fast_and_paired():
    # ~1,000 cases x 12 method/mode groups x 2,000 replicates: should take seconds, not minutes
    groups = {}
    for m, method in enumerate(["loo", "meclear", "contextcite", "proxyspex"]):
        for u, utility in enumerate(["gold_logprob", "exact", "judge"]):
            cases = bernoulli_cases(0.3 + 0.1 * m, 10, 100, seed=10 * m + u, method=method)
            groups[(method, utility)] = [
                CaseResult(c.case_id, c.conversation, c.mechanism, c.method, utility, c.faults, c.ranking, c.cleared,
                           c.recovered, c.evaluations)
                for c in cases
            ]
    start = time.perf_counter()
    out = bootstrap_groups(groups, reference_method="loo", replicates=2000, seed=0)
    assert time.perf_counter() - start < 10.0
    assert "vs_reference" not in out[("loo", "exact")]
    assert set(out[("meclear", "exact")]["vs_reference"]) == set(METRICS)
    assert out[("meclear", "judge")]["metrics"]["task_recovery"]["value"] == pytest.approx(
        metrics(groups[("meclear", "judge")])["task_recovery"]
    )


# --- Full-ranking Recall@|M|, the thresholded variant, rank-r coverage, seeded ties (issue 7) ---------------------

def ranked(case_id, faults, full, thresholded=(), **kw) -> CaseResult:
    return CaseResult(case_id, kw.get("conversation", "conv-1"), kw.get("mechanism", "direct"), "m", "correct", faults,
                      thresholded, (), False, 6, full)


def test_full_ranking_recall_counts_memories_the_threshold_dropped():
    # LOO on a redundant pair under `correct` utility: both copies score 0, so the thresholded list is empty (0 of 2)
    # while the full ranking may still put them first.
    got = metrics([ranked("x", ("f0", "f1"), ("f1", "f0", "a", "b", "c"))])
    assert got["recall_at_m"] == 1.0 and got["recall_at_m_thresholded"] == 0.0


def test_rank_r_coverage_on_hand_made_cases():
    # a: M={f}, f at rank 2;  b: M={g,h}, g at rank 1, h at rank 3;  c: M={i}, i at rank 5.
    cases = [
        ranked("a", ("f",), ("x", "f", "y", "z", "w"), ("x", "f")),
        ranked("b", ("g", "h"), ("g", "x", "h", "y", "z"), ("g",)),
        ranked("c", ("i",), ("x", "y", "z", "w", "i")),
    ]
    got = metrics(cases)
    assert got["rank1_coverage"] == pytest.approx(1 / 4)  # g
    assert got["rank2_coverage"] == pytest.approx(2 / 4)  # g, f
    assert got["rank3_coverage"] == pytest.approx(3 / 4)  # g, f, h
    assert got["recall_at_m"] == pytest.approx((0 + 1 + 0) / 4)  # a: top-1 = x; b: top-2 = {g, x}; c: top-1 = x
    assert got["recall_at_m_thresholded"] == pytest.approx((0 + 1 + 0) / 4)


def test_full_ranking_breaks_ties_at_random_with_the_seed():
    scores = np.array([0.0, -0.5, 0.0, 0.0, -0.5])
    first = full_ranking(scores, seed=11)
    np.testing.assert_array_equal(first, full_ranking(scores, seed=11))  # deterministic per seed
    assert set(first[:2]) == {1, 4} and set(first[2:]) == {0, 2, 3}  # ties stay inside their score level
    # Over seeds every tied memory leads equally often: no position is favoured.
    leads = np.bincount([full_ranking(np.zeros(5), seed=s)[0] for s in range(2000)], minlength=5)
    assert leads.min() > 330 and leads.max() < 470
    # NaN ranks last; strict order is kept without ties.
    np.testing.assert_array_equal(full_ranking(np.array([np.nan, 0.2, -1.0]), seed=0), [2, 1, 0])


def test_recall_with_all_tied_scores_is_chance_on_average():
    # One fault among K=5 tied memories: Recall@|M| over seeded tie orders averages 1/5.
    ids = ("f", "a", "b", "c", "d")
    vals = [metrics([ranked("x", ("f",), tuple(ids[i] for i in full_ranking(np.zeros(5), s)))])["recall_at_m"]
            for s in range(1000)]
    assert np.mean(vals) == pytest.approx(0.2, abs=0.04)


def test_full_ranking_must_not_repeat_ids():
    with pytest.raises(BenchError, match="full_ranking"):
        ranked("x", ("f",), ("f", "f", "a"))
