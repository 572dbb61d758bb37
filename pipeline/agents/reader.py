"""The `reader` agent: a deterministic lexical evidence reader. A CPU baseline and demo agent, not an LLM.

For multiple choice, the support of option o is sum over memories m of relevance(m, question) x match(m, o), where
relevance is the fraction of the question's content words that m contains and match is the fraction of o's
distinctive words (words no other option has, question words excluded) that m contains. Probabilities are a softmax of
beta x support over the options, so an empty context gives the uniform distribution. When no option is the strict
argmax the reader abstains (answer ""), which the utility scoring counts as not correct.
Open questions: the answer is the most relevant memory's utterance (text after the speaker), scored by token-F1.

Support is additive over memories while the softmax is not, so the reader shows the structures MeClear is about:
conflicting records pull mass to a wrong option, redundant copies mask each other under `correct` utility, and two
individually weak records can jointly overturn the answer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from pipeline.agents.base import AgentRequest, AgentResponse
from pipeline.core.text import tokens
from pipeline.core.validation import check, fingerprint

MAX_BETA = 1e6


@dataclass(frozen=True)
class ReaderConfig:
    beta: float = 8.0  # softmax sharpness over option supports

    def __post_init__(self) -> None:
        # Finite and bounded: support is at most K (20), so beta x support stays far from overflow and the softmax
        # finite; an infinite or huge beta made every utility NaN (exit 3 after all the work).
        ok = isinstance(self.beta, (int, float)) and not isinstance(self.beta, bool) and math.isfinite(self.beta)
        check(ok and 0 < self.beta <= MAX_BETA, "reader.beta", f"must be > 0 and <= {MAX_BETA:g}, got {self.beta!r}")


def _distinctive(options: Sequence[str], question_words: set[str]) -> list[set[str]]:
    words = [set(tokens(o)) - question_words for o in options]
    out = []
    for i, w in enumerate(words):
        others = set().union(*(x for j, x in enumerate(words) if j != i)) if len(words) > 1 else set()
        out.append(w - others)
    return out


def _utterance(text: str) -> str:
    """Drop a '[date] Speaker:' prefix so an open answer is the content itself."""
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    head, sep, tail = text.partition(": ")
    return tail if sep and len(head.split()) <= 3 else text


class ReaderAgent:
    name = "reader"
    version = 2  # bump whenever answers change: the fingerprint keys cached utilities


    def __init__(self, config: ReaderConfig | None = None):
        self.config = config or ReaderConfig()

    def fingerprint(self) -> str:
        return f"reader-v{self.version}-{fingerprint(self.config)}"

    def _answer(self, req: AgentRequest) -> AgentResponse:
        q = set(tokens(req.question))
        mem_words = [set(tokens(m)) for m in req.memories]
        rel = np.array([len(q & w) / max(len(q), 1) for w in mem_words])
        if not req.options:
            if not req.memories or rel.max() == 0:
                return AgentResponse((), "")
            return AgentResponse((), _utterance(req.memories[int(np.argmax(rel))]))
        dist = _distinctive(req.options, q)
        support = np.array(
            [sum(r * (len(d & w) / len(d)) for r, w in zip(rel, mem_words)) if d else 0.0 for d in dist]
        )
        z = self.config.beta * support
        p = np.exp(z - z.max())
        p /= p.sum()
        top = np.sort(p)[::-1]
        tied = len(top) > 1 and top[0] - top[1] <= 1e-12
        return AgentResponse(tuple(float(x) for x in p), "" if tied else req.options[int(np.argmax(p))])

    def answer_batch(self, requests: Sequence[AgentRequest]) -> list[AgentResponse]:
        return [self._answer(r) for r in requests]

    def close(self) -> None:
        pass
