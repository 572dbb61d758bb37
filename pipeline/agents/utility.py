"""Task utility v(S) from an agent's response.

Two modes (`--utility`):
- `probability` (default): P(gold option) for multiple choice; mean token-F1 of the answers for open questions.
- `correct`: 1.0 when the agent's answer is the gold one, else 0.0 (expected task success under greedy decoding; the
  setting in which a masked redundant copy has a leave-one-out effect of exactly 0).

The binary outcome `correct` is the same in both modes. For multiple choice the gold option must be the strict argmax:
a tie leaves the greedy answer to chance, and we do not count chance as knowing the answer.
"""

from __future__ import annotations

from typing import Sequence

from pipeline.agents.base import AgentResponse
from pipeline.core.text import exact_match, gold_index, token_f1

UTILITY_MODES = ("probability", "correct")


def outcome(response: AgentResponse, options: Sequence[str], gold: str) -> tuple[float, bool]:
    """(P(gold option) -- mean token-F1 of the answers for open questions --, correct) of one response. Both utility
    modes are read off this pair (`in_mode`), so a response is scored once whatever the mode."""
    if options:
        g = gold_index(options, gold)
        probs = response.option_probs
        p_gold = float(probs[g])
        return p_gold, all(p_gold > p for i, p in enumerate(probs) if i != g)
    answers = (response.answer, *response.samples)
    return sum(token_f1(a, gold) for a in answers) / len(answers), exact_match(response.answer, gold)


def in_mode(probability, correct, mode: str):
    """The utility in `mode` of (probability, correct) as `outcome` gives them: scalars or numpy arrays alike."""
    if mode not in UTILITY_MODES:
        raise ValueError(f"utility mode {mode!r} is not one of {UTILITY_MODES}")
    if mode == "probability":
        return probability
    return correct.astype(float) if hasattr(correct, "astype") else float(correct)


def score(response: AgentResponse, options: Sequence[str], gold: str, mode: str) -> tuple[float, bool]:
    """(utility in `mode`, correct) of one response."""
    if mode not in UTILITY_MODES:
        raise ValueError(f"utility mode {mode!r} is not one of {UTILITY_MODES}")
    probability, correct = outcome(response, options, gold)
    return in_mode(probability, correct, mode), correct
