"""Verified query-scoped clearance (the paper's Theorem 2), over one nested filtration or several.

The harmful set H = {i : phi_i < -tau} is ranked most negative first. The candidates are the |H|+1 prefixes of that
ranking (remove nothing, the most harmful, the two most harmful, ...). A non-empty candidate is admissible only if its
empirical gain v(N \\ C) - v(N) is positive and the agent's answer on N \\ C is the gold one (verified recovery). The
selection maximises gain, then minimises size; with no admissible non-empty candidate the context is left unchanged.

Theorem 2's three properties (non-negative gain, verified recovery, smallest among the maximum-gain candidates) hold
for ANY candidate family that contains the unchanged context, so `candidate_family` draws nested candidates from
several rankings at once (issue 30): the Shapley estimate's, a sparse linear surrogate's fitted to the coalitions the
estimator already evaluated (ContextCite's model, at no extra agent call), and LOO's; plus every single removal,
whose coalition N minus i is an LOO anchor the audit evaluates anyway. Candidates are deduplicated by mask (the first
ranking that proposes a set names it), and `affordable` evaluates them lazily: free ones always, the others in family
order while the budget lasts. `select_best` records which ranking proposed the chosen candidate.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from pipeline.game.plan import full_mask

# The rankings a clearance may draw candidates from (issue 30), in priority order: the first proposes the primary
# nested chain (checked whole, as the single-ranking clearance does), the others are added size by size while the
# budget lasts.
RANKINGS = ("shapley", "surrogate", "loo")
SINGLES = "single"  # every one-memory removal: free, its coalition is an LOO anchor
UNCHANGED = "unchanged"


def clearance_rankings(utility: str, budgeted: bool) -> tuple[str, ...]:
    """The rankings the audit's clearance draws candidates from (measured: docs/method.md "Verified clearance over
    several rankings"; reader, K=10, all ten conversations, 478 FI-LoCoMo cases; SmolLM2, 81 cases).

    Under a budget, all of RANKINGS plus single removals, in both modes. `correct`: the gains are {0, 1} steps, so
    every admissible candidate has the same gain and Theorem 2's rule picks the smallest: more candidates can only
    find a smaller or a recovering one (+3.1 pp recovery and +1.9 pp exact-set match over the Shapley chain at B=128,
    +4.1 / +1.2 pp at B=64). `probability`: the same family, but the Shapley chain is preferred (`primary_ranking`;
    the others are a fallback where the chain clears nothing and the answer is wrong):
    with continuous gains "largest gain first" over the whole family prefers a larger set from another ranking that
    adds a little utility (-12.5 pp exact-set match at B=64), while the chain alone left redundant copies in place
    whenever the estimate flagged one copy only (SmolLM2, B=128: recovery 82.7% against ContextCite's 98.8%).
    Without a budget (the paper's settings) the chain alone, so those runs stay what the paper describes."""
    if budgeted:
        return RANKINGS
    return ("shapley",)


def primary_ranking(utility: str) -> str | None:
    """The ranking whose candidates `select_best` prefers in this utility mode: `shapley` in `probability` mode (the
    other rankings' candidates are a fallback, chosen only when no candidate of the chain is admissible), None in
    `correct` mode (the whole family competes: its gains are equal steps, so the smallest admissible set wins)."""
    return "shapley" if utility == "probability" else None


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
    candidates: int  # |H| + 1 (several rankings: the candidates evaluated, the unchanged context included)
    source: str = "shapley"  # the ranking that proposed the chosen candidate ("unchanged" when nothing is removed)


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
        source="shapley" if best else UNCHANGED,
    )



@dataclass(frozen=True)
class Candidate:
    removed_mask: int  # positions removed (0: the unchanged context)
    removed: tuple[int, ...]  # the same positions, in the order of the ranking that proposed them
    source: str  # that ranking's name, SINGLES, or UNCHANGED


def candidate_family(k: int, rankings: Sequence[tuple[str, np.ndarray]], singles: bool = True) -> list[Candidate]:
    """The candidates in evaluation order: the unchanged context; every prefix of the first ranking; then the other
    rankings' prefixes, size 1 of each, size 2 of each, ...; then every single removal (K of them) when `singles`.
    A set proposed twice is kept once, named by the first ranking that proposed it."""
    out = [Candidate(0, (), UNCHANGED)]
    seen = {0}

    def add(removed: Sequence[int], source: str) -> None:
        mask = int(sum(1 << int(i) for i in removed))
        if mask not in seen:
            seen.add(mask)
            out.append(Candidate(mask, tuple(int(i) for i in removed), source))

    if rankings:
        name, first = rankings[0]
        for n in range(1, len(first) + 1):
            add(first[:n], name)
        rest = [(name, np.asarray(r, dtype=np.int64)) for name, r in rankings[1:]]
        for n in range(1, max((len(r) for _, r in rest), default=0) + 1):
            for name, r in rest:
                if n <= len(r):
                    add(r[:n], name)
    if singles:
        for i in range(k):
            add((i,), SINGLES)
    return out


def kept_coalitions(k: int, candidates: Sequence[Candidate]) -> np.ndarray:
    """The kept-context coalition N minus C of each candidate, in order."""
    return np.array([full_mask(k) & ~c.removed_mask for c in candidates], dtype=np.int64)


def affordable(k: int, candidates: Sequence[Candidate], evaluated: Callable[[np.ndarray], np.ndarray],
               left: int | None) -> list[Candidate]:
    """The candidates to check with `left` more evaluations (None: all): every candidate whose coalition is already
    evaluated (`evaluated(masks)` -> bools), and the others in family order while `left` lasts. Order kept."""
    candidates = list(candidates)
    if left is None:
        return candidates
    kept = kept_coalitions(k, candidates)
    free = np.asarray(evaluated(kept), dtype=bool)
    out, spent = [], 0
    for c, is_free in zip(candidates, free, strict=True):
        if is_free or spent < left:
            spent += not is_free
            out.append(c)
    return out


def select_best(k: int, candidates: Sequence[Candidate], values: np.ndarray, correct: np.ndarray,
                primary: str | None = None) -> Clearance:
    """Theorem 2's rule over an arbitrary candidate family (the first must be the unchanged context): the largest
    positive gain among verified candidates, then the smallest, then the first in family order; else unchanged.

    `primary`: a ranking whose candidates are preferred. The rule runs over the unchanged context and `primary`'s
    candidates; only when none of them is admissible and the answer on the full context is wrong does it run over
    the whole family (the fallback is for recovery: with continuous gains some single removal nearly always adds a
    little utility, and a query answered correctly must not be cleared on that). The guarantee still holds: the
    family Theorem 2 is applied to is the chain, or everything evaluated; both contain the unchanged context (a
    family chosen from the data, as the chain itself is)."""
    candidates = list(candidates)
    if not candidates or candidates[0].removed_mask != 0:
        raise ValueError("a clearance's candidate family must start with the unchanged context")
    kept = kept_coalitions(k, candidates)
    util = np.asarray(values[kept], dtype=np.float64)
    if np.isnan(util).any():
        raise ValueError("clearance needs every candidate it selects among evaluated")
    ok = np.asarray(correct[kept], dtype=bool)
    gains = util - util[0]
    admissible = (gains > 0) & ok
    admissible[0] = False
    if primary is not None:
        own = np.array([c.source == primary for c in candidates], dtype=bool)
        if (admissible & own).any() or ok[0]:
            admissible &= own
    best = 0
    for c in range(1, len(candidates)):
        if not admissible[c]:
            continue
        size, best_size = len(candidates[c].removed), len(candidates[best].removed)
        if best == 0 or gains[c] > gains[best] or (gains[c] == gains[best] and size < best_size):
            best = c
    chosen = candidates[best]
    return Clearance(
        removed_mask=chosen.removed_mask,
        removed=chosen.removed,
        baseline_utility=float(util[0]),
        cleared_utility=float(util[best]),
        gain=float(gains[best]),
        recovered=bool(ok[best]),
        baseline_correct=bool(ok[0]),
        candidates=len(candidates),
        source=chosen.source,
    )


def verification_rankings(k: int, phi: np.ndarray, tau: float, loo: np.ndarray | None, masks: np.ndarray,
                          values: np.ndarray, sources: Sequence[str] = RANKINGS) -> list[tuple[str, np.ndarray]]:
    """The harmful rankings (score < -tau, most harmful first) the clearance draws candidates from, in `sources`
    order: `shapley` (phi, ties by LOO), `surrogate` (ContextCite's sparse linear model fitted to the evaluated
    coalitions `masks`/`values`: no new agent call) and `loo` (LOO effects; skipped when `loo` is None)."""
    from pipeline.game.linear import surrogate_scores

    out = []
    for name in sources:
        if name == "shapley":
            out.append((name, harmful_ranking(phi, tau, loo)))
        elif name == "surrogate":
            w = surrogate_scores(masks, values, k)
            out.append((name, harmful_ranking(w, tau, loo)))
        elif name == "loo" and loo is not None:
            out.append((name, harmful_ranking(loo, tau)))
        elif name not in RANKINGS:
            raise ValueError(f"clearance ranking {name!r} is unknown; allowed {RANKINGS}")
    return out
