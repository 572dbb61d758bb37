"""A sparse linear surrogate fitted to coalitions already evaluated: ContextCite's model (Cohen-Wang et al., 2024),
in numpy, so the audit can rank by it without scikit-learn and without an extra agent call (issue 30).

ContextCite fits a Lasso (alpha 0.01, intercept) on standardised keep-indicators with the logit of the utility as the
target; `pipeline.game.surrogates.contextcite_fit` does that with scikit-learn on its own random ablations. Here the
rows are whatever coalitions the Shapley estimator asked for (anchors included), and the solver is plain cyclic
coordinate descent on the same objective, (1 / 2n) |y - b - X w|^2 + alpha |w|_1. Its weights are a second ranking of
harm for the verified clearance (`pipeline.game.clearance.candidate_family`): negative = harmful.
"""

from __future__ import annotations

import numpy as np

from pipeline.game.surrogates import CONTEXTCITE_ALPHA, keep_indicators, logit

MAX_SWEEPS = 2_000
TOL = 1e-8


def lasso(x: np.ndarray, y: np.ndarray, alpha: float, max_sweeps: int = MAX_SWEEPS, tol: float = TOL
          ) -> tuple[np.ndarray, float]:
    """Coordinate-descent Lasso with an intercept: (weights, intercept) minimising (1/2n)|y - b - Xw|^2 + alpha|w|_1.
    Columns are centred first (the intercept is then the mean residual), as scikit-learn's Lasso does."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    n, p = x.shape
    xm, ym = x.mean(axis=0), y.mean()
    xc, yc = x - xm, y - ym
    norms = (xc**2).sum(axis=0) / n
    w = np.zeros(p)
    resid = yc.copy()
    for _ in range(max_sweeps):
        biggest = 0.0
        for j in range(p):
            if norms[j] == 0.0:
                continue
            old = w[j]
            rho = xc[:, j] @ resid / n + norms[j] * old
            new = np.sign(rho) * max(abs(rho) - alpha, 0.0) / norms[j]
            if new != old:
                resid -= xc[:, j] * (new - old)
                w[j] = new
                biggest = max(biggest, abs(new - old))
        if biggest < tol:
            break
    return w, float(ym - xm @ w)


def surrogate_scores(masks: np.ndarray, values: np.ndarray, k: int, alpha: float = CONTEXTCITE_ALPHA) -> np.ndarray:
    """ContextCite's weights on the 0/1 mask scale, fitted to the evaluated coalitions `masks` with utilities
    `values` (probabilities or 0/1 outcomes; logit target, clipped). Zeros when the utilities do not vary."""
    masks = np.asarray(masks, dtype=np.int64)
    y = logit(np.asarray(values, dtype=np.float64))
    if masks.size < 2 or np.ptp(y) == 0.0:
        return np.zeros(k)
    x = keep_indicators(masks, k)
    scale = x.std(axis=0)
    scale = np.where(scale == 0.0, 1.0, scale)  # a memory kept (or dropped) in every row: StandardScaler's rule
    w, _ = lasso(x / scale, y, alpha)
    return w / scale
