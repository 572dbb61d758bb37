"""The vectorised reductions of the game core equal the former per-player / per-pair loops (kept here as references)."""

from math import factorial

import numpy as np
import pytest

from pipeline.game import interactions_exact, interactions_from_evaluated, shapley_exact
from pipeline.game.plan import popcount


def popcount_loop(masks):
    masks = np.asarray(masks, dtype=np.int64)
    out = np.zeros(masks.shape, dtype=np.int64)
    for b in range(21):
        out += (masks >> b) & 1
    return out


def shapley_loop(values):
    k = int(values.size).bit_length() - 1
    masks = np.arange(1 << k, dtype=np.int64)
    sizes = popcount_loop(masks)
    w = np.array([factorial(s) * factorial(k - s - 1) / factorial(k) for s in range(k)])
    phi = np.empty(k)
    for i in range(k):
        s = masks[(masks >> i & 1) == 0]
        phi[i] = np.sum(w[sizes[s]] * (values[s | (1 << i)] - values[s]))
    return phi


def _pair_terms(values, i, j):
    k = int(values.size).bit_length() - 1
    masks = np.arange(1 << k, dtype=np.int64)
    s = masks[((masks >> i & 1) == 0) & ((masks >> j & 1) == 0)]
    bi, bj = 1 << i, 1 << j
    return s, values[s | bi | bj] - values[s | bi] - values[s | bj] + values[s]


def _iw(k):
    return np.array([factorial(s) * factorial(k - s - 2) / factorial(k - 1) for s in range(k - 1)])


def interactions_loop(values):
    k = int(values.size).bit_length() - 1
    out = np.zeros((k, k))
    for i in range(k):
        for j in range(i + 1, k):
            s, delta = _pair_terms(values, i, j)
            out[i, j] = out[j, i] = np.sum(_iw(k)[popcount_loop(s)] * delta)
    return out


def from_evaluated_loop(values):
    k = int(values.size).bit_length() - 1
    out = np.full((k, k), np.nan)
    support = np.zeros((k, k), dtype=np.int64)
    for i in range(k):
        out[i, i] = 0.0
        for j in range(i + 1, k):
            s, delta = _pair_terms(values, i, j)
            ok = ~np.isnan(delta)
            support[i, j] = support[j, i] = int(ok.sum())
            if ok.any():
                ws = _iw(k)[popcount_loop(s[ok])]
                out[i, j] = out[j, i] = float(np.sum(ws * delta[ok]) / ws.sum())
    return out, support


def test_popcount_equals_loop():
    rng = np.random.default_rng(0)
    masks = rng.integers(0, 1 << 20, size=5000, dtype=np.int64)
    got = popcount(masks)
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, popcount_loop(masks))
    np.testing.assert_array_equal(popcount(np.arange(1 << 10).reshape(32, 32)),
                                  popcount_loop(np.arange(1 << 10).reshape(32, 32)))


@pytest.mark.parametrize("k", [1, 2, 3, 5, 8, 10])
def test_exact_reductions_equal_loops(k):
    rng = np.random.default_rng(k)
    values = rng.random(1 << k)
    np.testing.assert_allclose(shapley_exact(values), shapley_loop(values), rtol=0, atol=1e-12)
    if k >= 2:
        np.testing.assert_allclose(interactions_exact(values), interactions_loop(values), rtol=0, atol=1e-12)
        # efficiency still holds after vectorising
        assert abs(shapley_exact(values).sum() - (values[-1] - values[0])) < 1e-12


@pytest.mark.parametrize("k", [2, 4, 5, 8])
def test_sampled_interactions_equal_loop(k):
    rng = np.random.default_rng(100 + k)
    values = rng.random(1 << k)
    values[rng.random(values.size) < 0.6] = np.nan  # a sampled plan's sparse table
    got, sup = interactions_from_evaluated(values)
    ref, ref_sup = from_evaluated_loop(values)
    np.testing.assert_array_equal(sup, ref_sup)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
    np.testing.assert_allclose(np.nan_to_num(got), np.nan_to_num(ref), rtol=0, atol=1e-12)
    if k >= 4:  # the NaN path (pairs with no complete square: "unknown") is exercised
        assert (sup == 0).any() and (sup > 0).any()


def labels_loop(interactions, phi, tolerance):
    k = interactions.shape[0]
    labels = np.full((k, k), "independent", dtype=object)
    for i in range(k):
        for j in range(k):
            x = interactions[i, j]
            if np.isnan(x):
                labels[i, j] = "unknown"
            elif x > tolerance:
                labels[i, j] = "substitution" if (phi[i] < 0 and phi[j] < 0) else "complementarity"
            elif x < -tolerance:
                labels[i, j] = "substitution" if (phi[i] > 0 and phi[j] > 0) else "joint_interference"
    return labels


def test_interaction_labels_equal_loop():
    from pipeline.game import interaction_labels

    rng = np.random.default_rng(7)
    for _ in range(50):
        k = int(rng.integers(2, 9))
        inter = rng.normal(0, 0.2, (k, k))
        inter[rng.random((k, k)) < 0.2] = np.nan
        phi = rng.normal(0, 0.2, k)
        phi[rng.random(k) < 0.2] = 0.0
        got = interaction_labels(inter, phi, 0.05)
        assert got.dtype == object
        np.testing.assert_array_equal(got, labels_loop(inter, phi, 0.05))
