"""The reader agent, utility scoring and frozen retrieval, without Ray."""

from __future__ import annotations

import re

import numpy as np
import pytest

from pipeline.agents.base import AgentRequest, AgentResponse
from pipeline.agents.reader import ReaderAgent, ReaderConfig
from pipeline.agents.utility import score
from pipeline.cli.main import build_parser
from pipeline.core.errors import ConfigError
from pipeline.core.text import token_f1
from pipeline.io.records import Memory, Pool, Query
from pipeline.retrieval.frozen import BM25, Retriever, context_hash


def ask(memories, options=("green tea", "black coffee", "orange juice")):
    return ReaderAgent().answer_batch(
        [AgentRequest("c", "What is Ben's favorite drink?", tuple(options), tuple(memories))])[0]


def test_reader_masking_structure():
    truth = "Ben switched to green tea in January and says it is his drink now."
    copy1 = "Ben's favorite drink is black coffee, two cups every morning."
    copy2 = "Favorite drink for Ben: black coffee, no sugar."
    empty = ask([])
    assert empty.option_probs == pytest.approx((1 / 3,) * 3)
    assert empty.answer == ""  # no strict argmax: the reader abstains
    assert score(empty, ("green tea", "black coffee", "orange juice"), "green tea", "correct") == (0.0, False)
    assert ask([truth]).answer == "green tea"
    for ctx in ([truth, copy1, copy2], [truth, copy1], [truth, copy2]):
        assert ask(ctx).answer == "black coffee"  # either copy alone still masks the truth
    p = [ask(c).option_probs[0] for c in ([truth], [truth, copy1], [truth, copy1, copy2])]
    assert p[0] > p[1] > p[2]  # in probability mode each copy still costs something
    assert sum(ask([truth, copy1]).option_probs) == pytest.approx(1.0)


def test_scoring_modes_and_open_answers():
    resp = AgentResponse((0.2, 0.5, 0.3), "b")
    assert score(resp, ("a", "b", "c"), "b", "probability") == (0.5, True)
    assert score(resp, ("a", "b", "c"), "c", "correct") == (0.0, False)
    tie = AgentResponse((0.5, 0.5), "a")
    assert score(tie, ("a", "b"), "a", "correct") == (0.0, False)  # a tie is not knowing the answer
    open_resp = AgentResponse((), "The Physics building", samples=("physics building room 214",))
    util, correct = score(open_resp, (), "the Physics building, room 214", "probability")
    assert not correct and util == pytest.approx(
        (token_f1("The Physics building", "Physics building room 214") + 1.0) / 2)
    with pytest.raises(ConfigError):
        ReaderConfig(beta=0)


def test_bm25_and_frozen_context_hash():
    docs = ["Ana lives in Lisbon", "Ana likes tea", "Ben lives in Leeds"]
    s = BM25(docs).scores("Where does Ana live?")
    assert int(np.argmax(s)) == 0
    pool = Pool("p", tuple(Memory(f"m{i}", d) for i, d in enumerate(docs)), "x")
    q = Query("q", "p", "Where does Ana live?", "Lisbon", ("Lisbon", "Leeds"))
    r = Retriever({"p": pool}, top_k=2, dense="off")
    ctx = r.freeze_all([q])[0]
    assert ctx.memory_ids[0] == "m0" and ctx.k == 2 and ctx.dense_ranks == (None, None)
    assert r.freeze_all([q])[0] == ctx  # deterministic
    changed = context_hash(q, ctx.memory_ids, ("Ana lives in Porto", ctx.texts[1]))
    assert changed != ctx.context_hash  # the hash covers the exact texts the agent sees
    with pytest.raises(ConfigError):
        Retriever({"p": pool}, dense="maybe")


def test_every_cli_option_is_documented_in_docs_cli():
    from pathlib import Path

    cli_md = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text()
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for name, p in sub.choices.items():
        assert f"meclear {name}" in cli_md, name
        for action in p._actions:
            for flag in action.option_strings:
                if flag.startswith("--") and flag != "--help":
                    assert re.search(re.escape(flag) + r"\b", cli_md), f"meclear {name} {flag} is not in docs/cli.md"
