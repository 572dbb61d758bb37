"""`screened`: screen the players with a few permutations, then enumerate exactly the ones that matter.

The estimator evaluates the anchors (the empty set, N, N minus each player) and `pairs` antithetic permutation pairs,
then hands the marginals it saw to `pipeline.game.restricted.certify`: the players with a marginal above `eps` are
enumerated exactly with the others held present, and every evaluated coalition must be explained by that restricted
game within `eps`; an unexplained one names an outsider, which joins (at most `grow` times, `max_enumerated` players).
Its settings were chosen on conv-26, conv-30, conv-41 and conv-50 and checked per conversation on all ten
(docs/benchmark.md "Screened estimator"). `adaptive` uses the same check after its own rounds (its default rule).

Under a budget the enumeration is shrunk (smallest marginals dropped) until it fits, and growth stops when the next
enumeration would not fit. Stop reasons: "explained", "grow", "budget". SE: NaN (no sampling distribution for the
enumerated part).
"""

from __future__ import annotations

import numpy as np

from pipeline.core.errors import ConfigError
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
from pipeline.game.plan import prefix_masks
from pipeline.game.restricted import (  # noqa: F401  (subset_masks, restricted_values: this module's former API)
    GROW,
    MAX_ENUMERATED,
    MAX_RELEVANT,
    certify,
    observed_marginals,
    restricted_values,
    subset_masks,
)

SCREEN_PAIRS = 6  # antithetic permutation pairs for the screen (12 permutations)


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
        self.tau, self.eps, self.pairs, self.grow = tau, eps, pairs, grow
        self.max_relevant, self.max_enumerated = min(max_relevant, max_enumerated), max_enumerated

    def _steps(self, run: _Run, rng: np.random.Generator) -> Steps:
        k = run.k
        anchors = anchor_coalitions(k)
        perms = _draw_permutations(k, 2 * self.pairs, rng, antithetic=True)
        used = _fit_permutations(k, perms, run.budget, set(anchors.tolist()), 2)
        yield np.union1d(prefix_masks(perms[:used]).ravel(), anchors) if used else anchors
        if not used and run.budget <= len(anchors):
            return _anchor_only(run, self.name)
        marg = observed_marginals(run.values, k, perms[:used])
        mean = np.array([np.mean(mi[1:]) if len(mi) > 1 else mi[0] for mi in marg])
        phi, stop, _ = yield from certify(run, marg, mean, self.eps, self.max_relevant, self.grow,
                                          self.max_enumerated)
        return run.attribution(phi, np.full(k, np.nan), stop, self.name, draws=used)


register("screened", Screened)
