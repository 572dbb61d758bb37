"""Verified query-scoped clearance over a nested filtration (the paper's Theorem 2).

The harmful set H = {i : phi_i < -tau} is ranked most negative first. The candidates are the |H|+1 prefixes of that
ranking (remove nothing, the most harmful, the two most harmful, ...). A non-empty candidate is admissible only if its
empirical gain v(N \\ C) - v(N) is positive and the agent's answer on N \\ C is the gold one (verified recovery). The
selection maximises gain, then minimises size; with no admissible non-empty candidate the context is left unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipeline.game.plan import full_mask


def harmful_ranking(phi: np.ndarray, tau: float, loo: np.ndarray | None = None) -> np.ndarray:
    """Positions with phi < -tau, most harmful first; ties broken by LOO (more negative first), then position."""
    phi = np.asarray(phi, dtype=float)
    idx = np.flatnonzero(phi < -tau)
    tie = np.zeros(phi.size) if loo is None else np.nan_to_num(np.asarray(loo, dtype=float))
    order = np.lexsort((idx, tie[idx], phi[idx]))  # last key is primary
    return idx[order].astype(np.int64)


def nested_removals(ranking: np.ndarray) -> np.ndarray:
    """Masks of removed positions for the |H|+1 nested candidates, starting with the empty removal."""
    bits = np.left_shift(np.int64(1), np.asarray(ranking, dtype=np.int64))
    return np.concatenate([[0], np.cumsum(bits)]).astype(np.int64)


def clearance_coalitions(k: int, ranking: np.ndarray) -> np.ndarray:
    """The kept-context coalitions the clearance must evaluate: N minus each nested candidate."""
    return (full_mask(k) & ~nested_removals(ranking)).astype(np.int64)


@dataclass(frozen=True)
class Clearance:
    removed_mask: int  # positions cleared from the context (0 = unchanged)
    removed: tuple[int, ...]  # the same positions, most harmful first
    baseline_utility: float
    cleared_utility: float
    gain: float
    recovered: bool  # the agent's answer on the selected context is the gold one
    baseline_correct: bool
    candidates: int  # |H| + 1


def select_clearance(
    k: int, ranking: np.ndarray, values: np.ndarray, correct: np.ndarray
) -> Clearance:
    """Pick the clearance among the nested candidates. `correct[mask]` is the binary task outcome of a coalition."""
    full = full_mask(k)
    removals = nested_removals(ranking)
    kept = full & ~removals
    util = values[kept]
    if np.isnan(util).any():
        raise ValueError("clearance needs every nested candidate evaluated; run clearance_coalitions first")
    ok = np.asarray(correct[kept], dtype=bool)  # index first: `correct` may be a SparseTable
    gains = util - util[0]
    best = 0
    for c in range(1, len(removals)):  # nested and growing: the first index reaching the best gain is the smallest
        if gains[c] > 0 and ok[c] and gains[c] > gains[best]:
            best = c
    return Clearance(
        removed_mask=int(removals[best]),
        removed=tuple(int(x) for x in ranking[:best]),
        baseline_utility=float(util[0]),
        cleared_utility=float(util[best]),
        gain=float(gains[best]),
        recovered=bool(ok[best]),
        baseline_correct=bool(ok[0]),
        candidates=len(removals),
    )
