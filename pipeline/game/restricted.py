"""Certify a sampled attribution by a check instead of a variance: enumerate the players that matter, then test.

Retrieved memories are sparse players: in a K=10 LoCoMo case a handful change the answer and the rest do nothing.
When only the players R matter (every other one is null), the Shapley values of R are those of the game restricted
to R with the others held present, v_R(T) = v((N \\ R) | T), which 2^|R| coalitions give exactly, and the others'
values are 0. `certify`, given the marginals a screen observed (LOO and permutation draws):

1. takes as relevant every player with an observed marginal above `eps` in magnitude (eps = tau: a player whose
   every marginal is within tau cannot be below -tau), at most `max_relevant` (largest marginals first);
2. enumerates the restricted game over R (exact Shapley values for R; the others keep their permutation mean);
3. checks the restriction against every coalition evaluated so far: v(m) must equal v((N \\ R) | (m & R)) within
   `eps`. A coalition m it does not explain says an outsider absent from m matters: m plus each such outsider is
   evaluated, the one that moves v(m) most joins R and the restricted game is enumerated again, at most `grow` times
   and never past `max_enumerated` players.

The check is what a variance cannot give in `correct` mode: there the marginals are {-1, 0, 1} and a memory's first
draws are often all 0 although it matters in some coalition, so a sample SD of 0 says nothing (a bounded-variable
bound would need hundreds of draws to certify a zero at tau = 0.05). A player the draws hid shows up as a coalition
the restriction does not explain. Used by `screened` (a fixed screen) and by `adaptive` (its rounds are the screen;
pipeline.game.estimators.Adaptive). Stop reasons: "explained", "grow" (growth limit reached with coalitions left
unexplained), "budget" (the enumeration was shrunk, smallest marginals first, or growth stopped, to fit).
"""

from __future__ import annotations

from collections.abc import Generator

import numpy as np

from pipeline.game.attribution import shapley_exact
from pipeline.game.plan import full_mask

MAX_RELEVANT = 6  # players enumerated exactly at first (2^6 = 64 coalitions)
GROW = 3  # players added where the restriction leaves coalitions unexplained
MAX_ENUMERATED = 8  # ... but never more than 8 enumerated (2^8 = 256 coalitions): a case's cost stays bounded


def subset_masks(base: int, players: list[int]) -> np.ndarray:
    """`base | T` for every T over `players`, in the order of T's bits (index t: player j in T iff bit j of t)."""
    t = np.arange(1 << len(players), dtype=np.int64)
    out = np.full(t.shape, base, dtype=np.int64)
    for j, p in enumerate(players):
        out |= ((t >> j) & 1) << p
    return out


def restricted_values(phi_mean: np.ndarray, players: list[int], sub: np.ndarray) -> np.ndarray:
    """Exact Shapley values of the restricted game `sub` (2^|R| values) for `players`; the permutation means for the
    rest."""
    phi = np.array(phi_mean, dtype=np.float64)
    if players:
        phi[players] = shapley_exact(sub)
    return phi


def observed_marginals(values, k: int, perms: np.ndarray) -> list[list[float]]:
    """Per player: its LOO marginal first, then its marginal in each of `perms` (all evaluated in `values`)."""
    full = full_mask(k)
    marg = [[float(values[full] - values[full & ~(1 << i)])] for i in range(k)]
    for perm in perms:
        m = 0
        for i in perm:
            n = m | 1 << int(i)
            marg[int(i)].append(float(values[n] - values[m]))
            m = n
    return marg


def certify(run, marg: list[list[float]], mean: np.ndarray, eps: float, max_relevant: int = MAX_RELEVANT,
            grow: int = GROW, max_enumerated: int = MAX_ENUMERATED
            ) -> Generator[np.ndarray, None, tuple[np.ndarray, str, list[int]]]:
    """See the module docstring. `run` is an estimator run (pipeline.game.estimators._Run: `k`, `values`, `budget`,
    `evaluations`, `missing`); yields the coalitions it needs, returns (phi, stop, enumerated players)."""
    full, v = full_mask(run.k), run.values
    eps = max(eps, 1e-9)  # 0 would call every float difference relevant; 1e-9 keeps exact ties (a {0,1} game) exact
    max_relevant = min(max_relevant, max_enumerated)
    biggest = np.array([max(abs(x) for x in mi) for mi in marg])
    order = [int(i) for i in np.argsort(-biggest, kind="stable")]
    relevant = [i for i in order if biggest[i] > eps][:max_relevant]
    stop = "explained"
    while relevant and len(run.missing(subset_masks(full & ~_bits(relevant), relevant))) > (
            run.budget - run.evaluations):
        relevant, stop = relevant[:-1], "budget"  # the smallest marginal goes first
    grown = 0
    while True:
        base = full & ~_bits(relevant)
        masks = subset_masks(base, relevant)
        yield masks
        sub = v[masks]
        if stop == "budget":
            break
        rel = _bits(relevant)
        keys = v.keys
        unexplained = keys[np.abs(v[keys] - v[base | (keys & rel)]) > eps]
        if not len(unexplained):
            break
        if grown >= grow or len(relevant) >= max_enumerated:
            stop = "grow"
            break
        outside = [i for i in order if i not in relevant]
        if not outside:
            break
        # The culprit is an outsider absent from an unexplained coalition (the restriction put it back). Asked
        # directly: the worst-explained coalition m plus each outsider absent from it, the one that moves v(m)
        # most joins (|A| evaluations; without the budget for them, the outsider absent from the largest share
        # of unexplained coalitions relative to all evaluated ones, as a null one is absent as often from both).
        err = np.abs(v[unexplained] - v[base | (unexplained & rel)])
        worst = int(unexplained[int(np.argmax(err))])
        absent = [i for i in outside if not worst >> i & 1]
        probes = np.array([worst | 1 << i for i in absent], dtype=np.int64)
        lift = {i: _absent(unexplained, i) / max(_absent(keys, i), 1) for i in outside}
        if len(absent) > 1 and len(run.missing(probes)) <= run.budget - run.evaluations:
            yield probes
            moved = dict(zip(absent, np.abs(v[probes] - v[worst]).tolist()))
            nxt = max(absent, key=lambda i: (moved[i], lift[i], biggest[i]))
        else:
            nxt = max(absent or outside, key=lambda i: (lift[i], biggest[i]))
        wider = relevant + [nxt]
        if len(run.missing(subset_masks(full & ~_bits(wider), wider))) > run.budget - run.evaluations:
            stop = "budget"
            break
        relevant, grown = wider, grown + 1
    return restricted_values(mean, relevant, sub), stop, relevant


def _absent(masks: np.ndarray, i: int) -> int:
    return int(np.count_nonzero(((masks >> i) & 1) == 0))


def _bits(players: list[int]) -> int:
    return int(sum(1 << p for p in players))
