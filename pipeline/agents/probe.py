"""Context-sensitivity probe: does an LLM agent's answer follow a memory that states it?

Hand-made single-fact queries ship as package data (pipeline/data/probe/single_fact.jsonl, our own text). Each has a
question, a few options and a memory template naming one option; for every option in turn the agent sees a neutral
distractor memory and the memory stating that option. The agent *follows* when its answer is the stated option; the
follow rate is the share of (query, stated option) pairs it follows. An agent that ignores its memories answers the
same option whatever the memory says and scores about 1/len(options). `meclear probe` prints the rate under letter and
cloze scoring and the scoring it recommends; `scoring: auto` applies the recommendation recorded per model in
`pipeline.agents.llm_config.CLOZE_BY_DEFAULT` (decided by this probe, a documented default rather than a probe at
every start-up: the probe builds the agent once per scoring, minutes for a vLLM engine on CPU).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from typing import Any, Sequence

from pipeline.agents.base import Agent, AgentRequest

PROBE_FILE = "single_fact.jsonl"


@dataclass(frozen=True)
class ProbeItem:
    question: str
    options: tuple[str, ...]
    memory: str  # holds "{answer}"
    distractor: str


def load_items() -> list[ProbeItem]:
    text = (resources.files("pipeline") / "data" / "probe" / PROBE_FILE).read_text(encoding="utf-8")
    items = []
    for line in text.splitlines():
        if line.strip():
            d = json.loads(line)
            items.append(ProbeItem(d["question"], tuple(d["options"]), d["memory"], d["distractor"]))
    return items


def probe_requests(items: Sequence[ProbeItem]) -> tuple[list[AgentRequest], list[int]]:
    """One request per (item, stated option) and the index of the stated option in each."""
    requests, stated = [], []
    for n, item in enumerate(items):
        for k, option in enumerate(item.options):
            memories = (item.distractor, item.memory.format(answer=option))
            requests.append(AgentRequest(f"probe-{n}", item.question, item.options, memories))
            stated.append(k)
    return requests, stated


def follow_rate(agent: Agent, items: Sequence[ProbeItem] | None = None) -> dict[str, Any]:
    """The agent's follow rate on the probe items, and how many items it answers identically whatever the memory."""
    items = load_items() if items is None else list(items)
    requests, stated = probe_requests(items)
    responses = agent.answer_batch(requests)
    chosen = [max(range(len(r.option_probs)), key=r.option_probs.__getitem__) for r in responses]
    followed = sum(c == s for c, s in zip(chosen, stated))
    blind, pos = 0, 0
    for item in items:
        answers = chosen[pos:pos + len(item.options)]
        blind += len(set(answers)) == 1
        pos += len(item.options)
    return {"follow_rate": followed / len(requests), "followed": followed, "requests": len(requests),
            "blind_items": blind, "items": len(items),
            "stated_prob": sum(r.option_probs[s] for r, s in zip(responses, stated)) / len(requests)}


def recommend(results: dict[str, dict[str, Any]]) -> str:
    """The scoring with the higher follow rate (letter on a tie: it costs one request per coalition)."""
    letter = results.get("letter", {}).get("follow_rate", -1.0)
    cloze = results.get("cloze", {}).get("follow_rate", -1.0)
    return "cloze" if cloze > letter else "letter"
