"""Attribution over a value table: leave-one-out, Shapley values (exact or permutation-sampled), pairwise interactions.

A value table is a float64 array of length 2^K indexed by coalition mask, NaN where a coalition was not evaluated.
Sign convention: effects are contributions, so negative means harmful.
"""

from __future__ import annotations

from functools import lru_cache
from math import factorial

import numpy as np

from pipeline.game.plan import MAX_PLAYERS, full_mask, popcount, prefix_masks
from pipeline.game.sparse import SparseTable


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


@lru_cache(maxsize=MAX_PLAYERS + 1)
def _shapley_index(k: int) -> tuple[np.ndarray, np.ndarray]:
    """For every player i (row): the 2^(K-1) coalitions without i, and their Shapley weights. Cached per K."""
    masks = np.arange(1 << k, dtype=np.int64)
    w = _shapley_weights(k)
    s = np.stack([masks[(masks >> i & 1) == 0] for i in range(k)])
    return s, w[popcount(s)]


def shapley_exact(values: np.ndarray) -> np.ndarray:
    """Exact Shapley values by enumeration of all 2^K coalitions (all players in one vectorised pass)."""
    k = n_players(values)
    _need(values, np.arange(1 << k, dtype=np.int64), "exact Shapley")
    s, w = _shapley_index(k)
    bits = np.left_shift(np.int64(1), np.arange(k, dtype=np.int64))[:, None]
    return np.sum(w * (values[s | bits] - values[s]), axis=1)


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


def shapley_least_squares(values: np.ndarray, masks: np.ndarray) -> np.ndarray:
    """Shapley values fitted to every evaluated coalition in `masks` (KernelSHAP: Lundberg & Lee 2017; Covert & Lee
    2021), not only a permutation's marginal pairs.

    Minimises sum_S w(S) (v(S) - v(empty) - sum_{i in S} phi_i)^2 subject to sum_i phi_i = v(N) - v(empty), which holds
    exactly (both coalitions are always evaluated). The Shapley kernel's mass of each coalition size s, (K-1)/(s(K-s)),
    is spread evenly over the evaluated coalitions of that size: a size whose coalitions are all evaluated weighs them
    exactly as the kernel does, so with every coalition evaluated this is exact Shapley (and it is exact for any
    additive game whatever was sampled, as long as the fit is determined). Consistent, not unbiased.
    """
    k = n_players(values)
    full = full_mask(k)
    m = np.unique(np.asarray(masks, dtype=np.int64))
    m = m[(m != 0) & (m != full)]
    base, total = _need(values, np.array([0, full]), "least-squares Shapley")
    if k < 2 or not m.size:  # nothing between the empty and the full coalition: split the total evenly
        return np.full(k, (total - base) / max(k, 1))
    size = popcount(m)
    w = (k - 1) / (size * (k - size)) / np.bincount(size, minlength=k + 1)[size]
    x = (m[:, None] >> np.arange(k) & 1).astype(float)
    y = _need(values, m, "least-squares Shapley") - base
    kkt = np.zeros((k + 1, k + 1))  # normal equations with the efficiency constraint as a Lagrange multiplier
    kkt[:k, :k] = x.T @ (w[:, None] * x)
    kkt[:k, k] = kkt[k, :k] = 1.0
    rhs = np.append(x.T @ (w * y), total - base)
    return np.linalg.lstsq(kkt, rhs, rcond=None)[0][:k]  # lstsq: a min-norm answer if few sizes were sampled


def _interaction_weights(k: int) -> np.ndarray:
    """w[s] = s! (K-s-2)! / (K-1)!: Shapley interaction weight of a set of size s outside the pair (sums to 1)."""
    return np.array([factorial(s) * factorial(k - s - 2) / factorial(k - 1) for s in range(k - 1)])


@lru_cache(maxsize=MAX_PLAYERS + 1)
def _pair_index(k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """For the P = K(K-1)/2 pairs i < j (row-major): i, j, the (P, 2^(K-2)) sets S outside the pair, their sizes'
    interaction weights, and the bits of i and j as (P, 1) columns. Cached per K, so a case's reduction is a handful
    of array operations instead of a Python loop over pairs (interactions_exact took 3.7 s of a 20 s K=5 phase)."""
    masks = np.arange(1 << k, dtype=np.int64)
    ii, jj = np.triu_indices(k, 1)
    s = np.stack([masks[((masks >> i & 1) == 0) & ((masks >> j & 1) == 0)] for i, j in zip(ii, jj)]).reshape(
        len(ii), max(1 << max(k - 2, 0), 1) if len(ii) else 0
    )
    w = _interaction_weights(k)[popcount(s)] if len(ii) else np.zeros_like(s, dtype=float)
    bi = np.left_shift(np.int64(1), ii.astype(np.int64))[:, None]
    bj = np.left_shift(np.int64(1), jj.astype(np.int64))[:, None]
    return ii, jj, s, w, (bi, bj)


def _pair_deltas(values: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    ii, jj, s, w, (bi, bj) = _pair_index(k)
    delta = values[s | bi | bj] - values[s | bi] - values[s | bj] + values[s]
    return ii, jj, w, delta


def interactions_exact(values: np.ndarray) -> np.ndarray:
    """(K, K) symmetric matrix of the pairwise Shapley interaction index (diagonal 0)."""
    k = n_players(values)
    _need(values, np.arange(1 << k, dtype=np.int64), "exact interactions")
    out = np.zeros((k, k))
    if k < 2:
        return out
    ii, jj, w, delta = _pair_deltas(values, k)
    out[ii, jj] = out[jj, ii] = np.sum(w * delta, axis=1)
    return out


def interactions_from_evaluated(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pairwise interactions from whatever coalitions were evaluated, without spending more evaluations.

    The interaction index is a weighted mean of the discrete second derivative over sets S outside the pair; here the
    mean runs over the S whose four coalitions were all evaluated, with the same weights renormalised. Equals the exact
    index when the table is complete. Returns (matrix, support), support[i, j] = number of sets S used (0: unknown,
    NaN).
    """
    k = n_players(values)
    out = np.full((k, k), np.nan)
    support = np.zeros((k, k), dtype=np.int64)
    if k < 2:
        return np.zeros((k, k)), support
    np.fill_diagonal(out, 0.0)
    if isinstance(values, SparseTable) and k > SPARSE_PAIRS_FROM:
        return _interactions_sparse(values, k, out, support)
    ii, jj, w, delta = _pair_deltas(values, k)
    ok = ~np.isnan(delta)
    ws = np.where(ok, w, 0.0)
    n_ok = ok.sum(axis=1)
    support[ii, jj] = support[jj, ii] = n_ok
    with np.errstate(invalid="ignore", divide="ignore"):
        est = np.sum(ws * np.where(ok, delta, 0.0), axis=1) / ws.sum(axis=1)
    est = np.where(n_ok > 0, est, np.nan)
    out[ii, jj] = out[jj, ii] = est
    return out, support


# Above this K a sparse table's interactions are found from its evaluated coalitions, pair by pair, instead of over
# every set S of the (P, 2^(K-2)) index: at K=16 that index took 5.3 s and 145 MB a case, at K=20 it would be ~16x.
SPARSE_PAIRS_FROM = 12


def _interactions_sparse(values: SparseTable, k: int, out: np.ndarray, support: np.ndarray
                         ) -> tuple[np.ndarray, np.ndarray]:
    """`interactions_from_evaluated` over the evaluated coalitions only: for a pair (i, j) the usable sets S are
    those with S, S+i, S+j and S+i+j all evaluated, so every candidate S is an evaluated coalition with i and j
    cleared. Same weights and renormalisation as the dense path."""
    keys = values.keys
    w_all = _interaction_weights(k)
    for i in range(k):
        for j in range(i + 1, k):
            bi, bj = np.int64(1) << np.int64(i), np.int64(1) << np.int64(j)
            s = np.unique(keys & ~(bi | bj))
            corners = values[np.stack([s, s | bi, s | bj, s | bi | bj])]
            ok = ~np.isnan(corners).any(axis=0)
            n_ok = int(ok.sum())
            support[i, j] = support[j, i] = n_ok
            if n_ok:
                c = corners[:, ok]
                ws = w_all[popcount(s[ok])]
                out[i, j] = out[j, i] = float(np.sum(ws * (c[3] - c[1] - c[2] + c[0])) / ws.sum())
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
    x = np.asarray(interactions, dtype=float)
    phi = np.asarray(phi, dtype=float)
    both_harmful = (phi[:, None] < 0) & (phi[None, :] < 0)
    both_helpful = (phi[:, None] > 0) & (phi[None, :] > 0)
    with np.errstate(invalid="ignore"):  # NaN compares False, and is caught by the first condition
        conditions = [np.isnan(x), (x > tolerance) & both_harmful, x > tolerance, (x < -tolerance) & both_helpful,
                      x < -tolerance]
    labels = np.select(conditions, ["unknown", "substitution", "complementarity", "substitution",
                                    "joint_interference"], "independent").astype(object)
    return labels
