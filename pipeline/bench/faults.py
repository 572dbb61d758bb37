"""Fault records for FI-LoCoMo: LoCoMo-style memories that state a distractor as the answer to a query.

A fault is written like a LoCoMo memory, "[date] Speaker: utterance", so the retriever and the agent see nothing that
marks it as injected. Its utterance comes from one of several templates and carries the question's content so that
retrieval brings it into the context:

- strong faults restate the whole question ("About when did Caroline go to the LGBTQ support group - it was 27 August
  2023."), so they are retrieved near the top and, for the reader, weigh as much as any memory can;
- weak faults carry only some of the question's content words (the rarest first, which keeps them retrievable with
  little lexical weight). Weak faults are what joint interactions need: for an additive reader one weak record alone
  must not overturn the answer while two together do. The builder tries strengths from weak to strong until the
  causal check passes.

Everything here is pure text manipulation; whether a fault set really has its mechanism is decided by the builder,
under the agent being evaluated.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

from pipeline.core.text import STOPWORDS, tokens
from pipeline.io.records import Memory, Pool, Query

MECHANISMS = ("direct", "redundant", "joint")

# Strong templates restate the question ("{topic}"); weak ones name a few of its content words ("{words}").
STRONG_TEMPLATES = (
    "About {topic} - it was {answer}.",
    "Just to correct what I said before about {topic}: the answer is {answer}.",
    "If anyone asks {topic}, it's {answer}. I double-checked.",
    "Quick update on {topic}. It was {answer}, not what I told you earlier.",
)
WEAK_TEMPLATES = (
    "Not sure, but I think the thing with {words} was {answer}.",
    "Someone mentioned {words} - maybe {answer}?",
    "I half remember {words}... {answer}, or so I heard.",
    "Random thought about {words}: {answer}.",
)

_WORD = re.compile(r"[A-Za-z0-9]+(?:'[A-Za-z]+)?")


@dataclass(frozen=True)
class FaultSpec:
    """How one case's faults are written: the mechanism, the strength, the templates, the wrong answer.

    strength: "strong", or "weak-<n>" for weak faults naming n of the question's content words.
    """

    mechanism: str
    strength: str
    templates: tuple[int, ...]  # one template index per record
    distractor: str
    speaker: str
    dates: tuple[str, ...]  # one session date per record

    @property
    def n_records(self) -> int:
        return len(self.templates)


def topic(question: str) -> str:
    """The question as a clause: trailing '?' dropped, first letter lower-cased unless it starts a name."""
    q = question.strip().rstrip("?").strip()
    first = q.split(" ", 1)[0]
    return q if first[:1].isupper() and first.lower() not in _QUESTION_WORDS else q[:1].lower() + q[1:]


_QUESTION_WORDS = frozenset("what when where who whom whose which why how did does do is are was were would could "
                            "can has have had in on at".split())


def content_words(question: str, idf: dict[str, float] | None = None) -> list[str]:
    """The question's distinct content words in surface form, rarest first (by the pool's BM25 idf when given).

    Words whose stemmed token is a stopword are dropped; ties keep question order, so the list is deterministic.
    """
    seen: set[str] = set()
    words: list[tuple[str, str]] = []
    for w in _WORD.findall(question):
        toks = tokens(w)
        if not toks or w.lower() in STOPWORDS or w.lower() in _QUESTION_WORDS:
            continue
        if toks[0] not in seen:
            seen.add(toks[0])
            words.append((w, toks[0]))
    if idf is not None:
        rank = sorted(range(len(words)), key=lambda i: (-idf.get(words[i][1], math.inf), i))
        words = [words[i] for i in rank]
    return [w for w, _ in words]


def _first_seen(values) -> list[str]:
    """Non-empty values, each once, in order of first appearance."""
    return list(dict.fromkeys(v for v in values if v))


def speakers(pool: Pool) -> list[str]:
    """The pool's speakers in order of first appearance."""
    return _first_seen(m.speaker for m in pool.memories)


def pick_speaker(query: Query, pool: Pool) -> str:
    """The speaker the question is about when it names one, else the speaker of its first evidence turn."""
    names = speakers(pool)
    for name in names:
        if re.search(rf"\b{re.escape(name)}\b", query.question):
            return name
    by_id = {m.memory_id: m for m in pool.memories}
    for e in query.evidence:
        if e in by_id and by_id[e].speaker:
            return str(by_id[e].speaker)
    return names[0] if names else "User"


def session_dates(pool: Pool) -> list[str]:
    return _first_seen(m.timestamp for m in pool.memories)


def fault_text(spec: FaultSpec, j: int, question: str, words: list[str]) -> str:
    """The text of record j of a fault set, in LoCoMo's "[date] Speaker: utterance" form."""
    t = spec.templates[j]
    if spec.strength == "strong":
        body = STRONG_TEMPLATES[t].format(topic=topic(question), answer=spec.distractor)
    else:
        n = int(spec.strength.split("-", 1)[1])
        body = WEAK_TEMPLATES[t].format(words=" ".join(words[:n]), answer=spec.distractor)
    return f"[{spec.dates[j]}] {spec.speaker}: {body}"


def fault_memories(pool_id: str, case_id: str, spec: FaultSpec, question: str, words: list[str]) -> tuple[Memory, ...]:
    """The fault records of one case as memories (ids '<case_id>#f<j>'), to append to a copy of the pool."""
    return tuple(
        Memory(
            memory_id=f"{case_id}#f{j}",
            text=fault_text(spec, j, question, words),
            timestamp=spec.dates[j],
            speaker=spec.speaker,
            metadata={"fault": True, "mechanism": spec.mechanism, "strength": spec.strength, "pool": pool_id},
        )
        for j in range(spec.n_records)
    )


def strengths(mechanism: str, n_words: int) -> list[str]:
    """Strength variants to try, in order. Direct and redundant conflicts start strong (a redundant copy must overturn
    the answer on its own); joint interactions start weak and grow until the pair, not each record, flips it."""
    # weak-<n_words> names every content word without restating the question: a step between the weak ones and
    # "strong", added so the position balancing (builder) has a candidate that lands lower than a restatement.
    weak = [f"weak-{n}" for n in range(1, n_words + 1)]
    if mechanism == "joint":
        return weak + ["strong"]
    return ["strong"] + weak[::-1]


def fault_specs(
    mechanism: str,
    query: Query,
    pool: Pool,
    n_words: int,
    redundancy: int,
    rng: np.random.Generator,
    max_distractors: int = 2,
) -> list[FaultSpec]:
    """Every fault set the builder may try for one (query, mechanism), in the order it tries them.

    The records of one set use distinct templates (so redundant copies are paraphrases, not duplicates) and are dated
    with session dates of the pool; templates, dates and the distractor order come from `rng`.
    """
    if mechanism not in MECHANISMS:
        raise ValueError(f"fault mechanism {mechanism!r}; allowed {MECHANISMS}")
    n_records = {"direct": 1, "redundant": redundancy, "joint": 2}[mechanism]
    distractors = [o for o in query.options if o != query.answer]
    order = rng.permutation(len(distractors))[:max_distractors]
    speaker = pick_speaker(query, pool)
    dates = session_dates(pool) or ["unknown date"]
    specs = []
    for di in order:
        for strength in strengths(mechanism, n_words):
            pool_size = len(STRONG_TEMPLATES) if strength == "strong" else len(WEAK_TEMPLATES)
            templates = tuple(int(t) for t in rng.permutation(pool_size)[:n_records])
            when = tuple(dates[int(i)] for i in rng.integers(0, len(dates), size=n_records))
            specs.append(FaultSpec(mechanism, strength, templates, distractors[int(di)], speaker, when))
    return specs
