"""Task utility v(S) from an agent's response.

Two modes (`--utility`):
- `probability` (default): P(gold option) for multiple choice; mean token-F1 of the answers for open questions.
- `correct`: 1.0 when the agent's answer is the gold one, else 0.0 (expected task success under greedy decoding; the
  setting in which a masked redundant copy has a leave-one-out effect of exactly 0).

The binary outcome `correct` is the same in both modes. For multiple choice the gold option must be the strict argmax:
a tie leaves the greedy answer to chance, and we do not count chance as knowing the answer.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from typing import Sequence

from pipeline.agents.base import AgentResponse

UTILITY_MODES = ("probability", "correct")

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """Lower-case, drop punctuation and articles, collapse whitespace (the usual QA answer normalisation)."""
    text = str(text).lower().translate(_PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def token_f1(prediction: str, gold: str) -> float:
    pred, ref = normalize_answer(prediction).split(), normalize_answer(gold).split()
    if not pred or not ref:
        return float(pred == ref)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def exact_match(prediction: str, gold: str) -> bool:
    return normalize_answer(prediction) == normalize_answer(gold)


def gold_index(options: Sequence[str], gold: str) -> int:
    """Index of the gold answer among the options (exact text first, then normalised); -1 if absent."""
    for i, opt in enumerate(options):
        if opt == gold:
            return i
    norm = normalize_answer(gold)
    for i, opt in enumerate(options):
        if normalize_answer(opt) == norm:
            return i
    return -1


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
