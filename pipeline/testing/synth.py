"""Synthetic memory pools for the scale benchmark, shaped like LoCoMo: about 200 queries and 600 memories per pool
(LoCoMo: 1,986 queries over 5,882 turns in 10 conversations), short first-person facts, multiple-choice questions.

Each query asks for one attribute of one person. Its pool holds the fact, sometimes a stale or wrong version of it
(the harm the audit should find), and filler about other people, so retrieval, evaluation and clearance all have work.
Seeded (numpy default_rng): the same N gives the same pools.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

QUERIES_PER_POOL = 200
MEMORIES_PER_QUERY = 3  # LoCoMo: 5,882 / 1,986 = 2.96

_NAMES = ("Ana Ben Carla Dev Emil Farah Gus Hana Ivo Jun Kira Lev Mina Nico Omar Pia Quin Rosa Sami Tess Uma Vik "
          "Wen Xavi Yara Zed").split()
_ATTRS = {
    "city": ("Which city does {p} live in now?", "{p} lives in {v} these days.",
             "Lisbon Porto Madrid Leeds Oslo Turin Lyon Graz Cork Split Bergen Ghent".split()),
    "drink": ("What is {p}'s favorite drink?", "{p}'s favorite drink is {v}.",
              "tea coffee cocoa lemonade kefir cider mate juice".split()),
    "pet": ("What pet does {p} have?", "{p} has a pet {v} at home.",
            "cat dog parrot rabbit turtle hamster ferret goldfish".split()),
    "hobby": ("Which hobby did {p} take up?", "{p} took up {v} last year.",
              "climbing pottery chess sailing knitting fencing archery rowing".split()),
    "job": ("What does {p} work as?", "{p} works as a {v}.",
            "nurse baker pilot teacher plumber chemist architect editor".split()),
}
_FILLER = ("{p} mentioned the weather was lovely on the weekend.", "{p} and a friend watched a film on {d}.",
           "{p} is planning a short trip in the spring.", "{p} said work has been busy since {d}.")


def synthesise(n_queries: int, seed: int = 0, harm_rate: float = 0.3) -> tuple[list[dict], list[dict]]:
    """(memory records, query records) as the JSONL loaders read them."""
    rng = np.random.default_rng(seed)
    memories, queries = [], []
    attrs = list(_ATTRS)
    for qi in range(n_queries):
        pool = f"syn-{qi // QUERIES_PER_POOL:05d}"
        person = f"{_NAMES[rng.integers(len(_NAMES))]}{qi % QUERIES_PER_POOL}"
        attr = attrs[rng.integers(len(attrs))]
        question, fact, values = _ATTRS[attr]
        opts = list(rng.choice(values, size=3, replace=False))
        gold = opts[0]
        rng.shuffle(opts)
        qid = f"{pool}:q{qi % QUERIES_PER_POOL}"
        queries.append({"pool_id": pool, "query_id": qid, "question": question.format(p=person), "answer": gold,
                        "options": opts})
        texts = [fact.format(p=person, v=gold)]
        if rng.random() < harm_rate:  # a stale or wrong version of the fact: a harmful memory for this query
            wrong = next(o for o in opts if o != gold)
            texts.append(fact.format(p=person, v=wrong) + " That was years ago, but it is how people remember it.")
        while len(texts) < MEMORIES_PER_QUERY:
            texts.append(_FILLER[rng.integers(len(_FILLER))].format(p=person, d=f"day {rng.integers(1, 365)}"))
        for j, t in enumerate(texts):
            memories.append({"pool_id": pool, "memory_id": f"{qid}-m{j}", "text": t})
    return memories, queries


def write_jsonl(folder: str | Path, n_queries: int, seed: int = 0) -> tuple[Path, Path]:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    memories, queries = synthesise(n_queries, seed)
    paths = folder / "memories.jsonl", folder / "queries.jsonl"
    for path, rows in zip(paths, (memories, queries)):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return paths
