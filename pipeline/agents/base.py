"""The agent contract: a batch of (question, options, ordered memory texts) in, per-option probabilities and an answer
out.

Every agent (the lexical reader, vLLM, transformers) implements `Agent`. The pipeline never looks inside an agent: it
builds `AgentRequest`s for coalitions, and turns `AgentResponse`s into task utilities with `pipeline.agents.utility`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence, runtime_checkable


@dataclass(frozen=True)
class AgentRequest:
    """One coalition of one case. `memories` are the coalition's memory texts in frozen-context order."""

    case_key: str  # groups the coalitions of one case; LLM agents route a case to one engine for its prefix cache
    question: str
    options: tuple[str, ...]  # empty for open-answer questions
    memories: tuple[str, ...]


@dataclass(frozen=True)
class AgentResponse:
    """The agent's answer to one request.

    option_probs: probabilities over `options`, summing to 1 (empty for open answers).
    answer: the agent's answer (the argmax option text for multiple choice; generated text otherwise).
    samples: extra sampled answers for open questions scored in expectation (may be empty).
    prompt_tokens / cached_tokens / latency_s: engine accounting where the agent has it (None otherwise).
    """

    option_probs: tuple[float, ...]
    answer: str
    samples: tuple[str, ...] = ()
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    latency_s: float | None = None


@runtime_checkable
class Agent(Protocol):
    """What the pipeline needs from an agent. Heavy set-up happens in the constructor, once per actor."""

    name: str

    def fingerprint(self) -> str:
        """A short stable string that changes whenever the agent would answer differently (model, settings)."""
        ...

    def answer_batch(self, requests: Sequence[AgentRequest]) -> list[AgentResponse]:
        """Answer every request, in order. Requests of one case arrive together in one batch."""
        ...

    def close(self) -> None:
        """Release engines and processes. Safe to call twice."""
        ...


@dataclass(frozen=True)
class AgentSpec:
    """Which agent to build, and its settings, as validated plain data that can travel to Ray actors."""

    name: str = "reader"
    options: dict = field(default_factory=dict)
