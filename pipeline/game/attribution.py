"""Attribution over a value table: leave-one-out, Shapley values (exact or permutation-sampled), pairwise interactions.

A value table is a float64 array of length 2^K indexed by coalition mask, NaN where a coalition was not evaluated.
Sign convention: effects are contributions, so negative means harmful.
"""

from __future__ import annotations

from math import factorial

import numpy as np

from pipeline.game.plan import full_mask, popcount, prefix_masks


def _need(values: np.ndarray, masks: np.ndarray, what: str) -> np.ndarray:
    got = values[masks]
    if np.isnan(got).any():
        missing = np.asarray(masks)[np.isnan(got)][:5].tolist()
        raise ValueError(f"{what} needs coalitions that were not evaluated, e.g. masks {missing}")
    return got


def n_players(values: np.ndarray) -> int:
    k = int(values.size).bit_length() - 1
    if values.size != 1 << k:
        raise ValueError(f"value table has {values.size} entries; expected a power of two (2^K)")
    return k


def loo_effects(values: np.ndarray) -> np.ndarray:
    """loo_i = v(N) - v(N minus i)."""
    k = n_players(values)
    full = full_mask(k)
    without = np.array([full & ~(1 << i) for i in range(k)], dtype=np.int64)
    return _need(values, np.array([full]), "LOO")[0] - _need(values, without, "LOO")


def _shapley_weights(k: int) -> np.ndarray:
    """w[s] = s! (K-s-1)! / K!: the probability that a player's predecessors are one given set of size s."""
    return np.array([factorial(s) * factorial(k - s - 1) / factorial(k) for s in range(k)])


def shapley_exact(values: np.ndarray) -> np.ndarray:
    """Exact Shapley values by enumeration of all 2^K coalitions."""
    k = n_players(values)
    masks = np.arange(1 << k, dtype=np.int64)
    _need(values, masks, "exact Shapley")
    sizes = popcount(masks)
    w = _shapley_weights(k)
    phi = np.empty(k)
    for i in range(k):
        s = masks[(masks >> i & 1) == 0]
        phi[i] = np.sum(w[sizes[s]] * (values[s | (1 << i)] - values[s]))
    return phi


def permutation_contributions(values: np.ndarray, permutations: np.ndarray) -> np.ndarray:
    """(L, K) marginal contribution of each player (column = player) in each sampled permutation."""
    perms = np.asarray(permutations, dtype=np.int64)
    pref = prefix_masks(perms)
    v = _need(values, pref.ravel(), "permutation Shapley").reshape(pref.shape)
    marg = np.diff(v, axis=1)  # marg[l, j]: contribution of perms[l, j]
    out = np.empty_like(marg)
    np.put_along_axis(out, perms, marg, axis=1)
    return out


def shapley_permutation(
    values: np.ndarray, permutations: np.ndarray, antithetic: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """Permutation-sampled Shapley values and their standard errors.

    Each permutation's contributions are an unbiased draw of phi. With antithetic sampling, rows (2j, 2j+1) are a
    permutation and its reverse; their mean is one draw, so the standard error is taken over pairs.
    """
    contrib = permutation_contributions(values, permutations)
    if antithetic:
        contrib = 0.5 * (contrib[0::2] + contrib[1::2])
    n = contrib.shape[0]
    phi = contrib.mean(axis=0)
    se = contrib.std(axis=0, ddof=1) / np.sqrt(n) if n > 1 else np.full(phi.shape, np.nan)
    return phi, se


def _interaction_weights(k: int) -> np.ndarray:
    """w[s] = s! (K-s-2)! / (K-1)!: Shapley interaction weight of a set of size s outside the pair (sums to 1)."""
    return np.array([factorial(s) * factorial(k - s - 2) / factorial(k - 1) for s in range(k - 1)])


def _pair_terms(values: np.ndarray, i: int, j: int) -> tuple[np.ndarray, np.ndarray]:
    k = n_players(values)
    masks = np.arange(1 << k, dtype=np.int64)
    s = masks[((masks >> i & 1) == 0) & ((masks >> j & 1) == 0)]
    bi, bj = 1 << i, 1 << j
    delta = values[s | bi | bj] - values[s | bi] - values[s | bj] + values[s]
    return s, delta


def interactions_exact(values: np.ndarray) -> np.ndarray:
    """(K, K) symmetric matrix of the pairwise Shapley interaction index (diagonal 0)."""
    k = n_players(values)
    _need(values, np.arange(1 << k, dtype=np.int64), "exact interactions")
    out = np.zeros((k, k))
    if k < 2:
        return out
    w = _interaction_weights(k)
    for i in range(k):
        for j in range(i + 1, k):
            s, delta = _pair_terms(values, i, j)
            out[i, j] = out[j, i] = np.sum(w[popcount(s)] * delta)
    return out


def interactions_from_evaluated(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pairwise interactions from whatever coalitions were evaluated, without spending more evaluations.

    The interaction index is a weighted mean of the discrete second derivative over sets S outside the pair; here the
    mean runs over the S whose four coalitions were all evaluated, with the same weights renormalised. Equals the exact
    index when the table is complete. Returns (matrix, support), support[i, j] = number of sets S used (0: unknown, NaN).
    """
    k = n_players(values)
    out = np.full((k, k), np.nan)
    support = np.zeros((k, k), dtype=np.int64)
    if k < 2:
        return np.zeros((k, k)), support
    w = _interaction_weights(k)
    for i in range(k):
        out[i, i] = 0.0
        for j in range(i + 1, k):
            s, delta = _pair_terms(values, i, j)
            ok = ~np.isnan(delta)
            support[i, j] = support[j, i] = int(ok.sum())
            if ok.any():
                ws = w[popcount(s[ok])]
                out[i, j] = out[j, i] = float(np.sum(ws * delta[ok]) / ws.sum())
    return out, support


INTERACTION_LABELS = ("substitution", "complementarity", "joint_interference", "independent", "unknown")


def interaction_labels(interactions: np.ndarray, phi: np.ndarray, tolerance: float) -> np.ndarray:
    """Label each pair by the structure of its interaction (not by what the memories say).

    - substitution: the pair does less together than its parts, in the direction both act alone (redundant copies:
      two harmful copies mask each other, I > 0; two helpful copies back each other up, I < 0);
    - complementarity: I > tolerance otherwise (together they help more than the sum);
    - joint_interference: I < -tolerance otherwise (together they hurt more than the sum);
    - independent: |I| <= tolerance; unknown: the interaction could not be estimated.
    """
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
