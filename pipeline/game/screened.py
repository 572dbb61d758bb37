"""`screened`: screen the players with a few permutations, then enumerate exactly the ones that matter.

Retrieved memories are sparse players: in a K=10 LoCoMo case a handful change the answer and the rest do nothing.
When only the players R matter (every other one is null), the Shapley values of R are those of the game restricted
to R with the others held present, v_R(T) = v((N \\ R) | T), which 2^|R| coalitions give exactly, and the others'
values are 0. The estimator:

1. evaluates the anchors (the empty set, N, N minus each player) and `pairs` antithetic permutation pairs;
2. takes as relevant every player with an observed marginal above `eps` in magnitude (eps = tau by default: a player
   whose every marginal is within tau cannot be below -tau), at most `max_relevant` (largest marginals first);
3. enumerates the restricted game over R (exact Shapley values for R; the others keep their permutation mean);
4. checks the restriction against every coalition it has evaluated: v(m) must equal v((N \\ R) | (m & R)) within
   `eps`. A coalition m it does not explain says an outsider absent from m matters: m plus each such outsider is
   evaluated, the one that moves v(m) most joins R and the restricted game is enumerated again,
   at most `grow` times and never past `max_enumerated` players.

This stopping rule checks the answer against evaluated coalitions rather than trusting a variance, so the {0, 1}
marginals of `correct` mode (often all 0 in the first draws although the player matters elsewhere) are not taken as
certainty: a player they hid shows up as an unexplained coalition. Its settings were chosen on conv-26, conv-30,
conv-41 and conv-50 and checked per conversation on all ten (docs/benchmark.md "Screened estimator").

Under a budget the enumeration is shrunk (smallest marginals dropped from R) until it fits, and growth stops when the
next enumeration would not fit. Stop reasons: "explained" (every evaluated coalition explained), "grow" (growth limit
reached with coalitions left unexplained), "budget". SE: NaN (no sampling distribution for the enumerated part).
"""

from __future__ import annotations

import numpy as np

from pipeline.core.errors import ConfigError
from pipeline.game.attribution import shapley_exact
from pipeline.game.estimators import (
    Steps,
    _anchor_only,
    _Base,
    _draw_permutations,
    _fit_permutations,
    _Run,
    anchor_coalitions,
    register,
)
from pipeline.game.plan import full_mask, prefix_masks

SCREEN_PAIRS = 6  # antithetic permutation pairs for the screen (12 permutations)
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


class Screened(_Base):
    """See the module docstring. Options: tau (the harm threshold, the default `eps`), eps, pairs, max_relevant,
    grow, max_enumerated."""

    name = "screened"

    def __init__(self, tau: float = 0.0, eps: float | None = None, pairs: int = SCREEN_PAIRS,
                 max_relevant: int = MAX_RELEVANT, grow: int = GROW, max_enumerated: int = MAX_ENUMERATED):
        eps = tau if eps is None else eps
        if not (tau >= 0 and eps >= 0 and pairs >= 0 and max_relevant >= 0 and grow >= 0 and max_enumerated >= 0):
            raise ConfigError(f"screened: tau={tau}, eps={eps}, pairs={pairs}, max_relevant={max_relevant}, "
                              f"grow={grow}, max_enumerated={max_enumerated}; all must be >= 0")
        # eps 0 would call every float difference relevant; 1e-9 keeps exact ties (a {0,1} game) exact
        self.tau, self.eps, self.pairs, self.grow = tau, max(eps, 1e-9), pairs, grow
        self.max_relevant, self.max_enumerated = min(max_relevant, max_enumerated), max_enumerated

    def _steps(self, run: _Run, rng: np.random.Generator) -> Steps:
        k, full = run.k, full_mask(run.k)
        anchors = anchor_coalitions(k)
        perms = _draw_permutations(k, 2 * self.pairs, rng, antithetic=True)
        used = _fit_permutations(k, perms, run.budget, set(anchors.tolist()), 2)
        yield np.union1d(prefix_masks(perms[:used]).ravel(), anchors) if used else anchors
        if not used and run.budget <= len(anchors):
            return _anchor_only(run, self.name)
        v = run.values
        # marginals: the LOO ones and each permutation's
        marg = [[float(v[full] - v[full & ~(1 << i)])] for i in range(k)]
        for perm in perms[:used]:
            m = 0
            for i in perm:
                n = m | 1 << int(i)
                marg[int(i)].append(float(v[n] - v[m]))
                m = n
        biggest = np.array([max(abs(x) for x in mi) for mi in marg])
        mean = np.array([np.mean(mi[1:]) if len(mi) > 1 else mi[0] for mi in marg])
        order = [int(i) for i in np.argsort(-biggest, kind="stable")]
        relevant = [i for i in order if biggest[i] > self.eps][: self.max_relevant]
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
            keys = run.values.keys
            unexplained = keys[np.abs(v[keys] - v[base | (keys & rel)]) > self.eps]
            if not len(unexplained):
                break
            if grown >= self.grow or len(relevant) >= self.max_enumerated:
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
        phi = restricted_values(mean, relevant, sub)
        return run.attribution(phi, np.full(k, np.nan), stop, self.name, draws=used)


def _absent(masks: np.ndarray, i: int) -> int:
    return int(np.count_nonzero(((masks >> i) & 1) == 0))


def _bits(players: list[int]) -> int:
    return int(sum(1 << p for p in players))


register("screened", Screened)
