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
from pipeline.text import exact_match, gold_index, token_f1

UTILITY_MODES = ("probability", "correct")


def score(response: AgentResponse, options: Sequence[str], gold: str, mode: str) -> tuple[float, bool]:
    """(utility, correct) of one response."""
    if mode not in UTILITY_MODES:
        raise ValueError(f"utility mode {mode!r} is not one of {UTILITY_MODES}")
    if options:
        g = gold_index(options, gold)
        probs = response.option_probs
        p_gold = float(probs[g])
        correct = all(p_gold > p for i, p in enumerate(probs) if i != g)
        utility = p_gold
    else:
        correct = exact_match(response.answer, gold)
        answers = (response.answer, *response.samples)
        utility = sum(token_f1(a, gold) for a in answers) / len(answers)
    return (float(correct) if mode == "correct" else utility), correct
