"""Agents answer batches of coalitions. `build_agent` turns a validated `AgentSpec` into an agent (lazily importing
heavy engines only for the agent asked for)."""

from __future__ import annotations

from pipeline.agents.base import Agent, AgentRequest, AgentResponse, AgentSpec
from pipeline.errors import ConfigError
from pipeline.validation import from_mapping

AGENTS = ("reader", "vllm", "transformers")


def build_agent(spec: AgentSpec) -> Agent:
    if spec.name == "reader":
        from pipeline.agents.reader import ReaderAgent, ReaderConfig

        return ReaderAgent(from_mapping(ReaderConfig, spec.options, "agent 'reader'"))
    if spec.name == "vllm":
        from pipeline.agents.vllm_agent import VLLMAgent, VLLMConfig

        return VLLMAgent(from_mapping(VLLMConfig, spec.options, "agent 'vllm'"))
    if spec.name == "transformers":
        from pipeline.agents.hf_agent import TransformersAgent, TransformersConfig

        return TransformersAgent(from_mapping(TransformersConfig, spec.options, "agent 'transformers'"))
    raise ConfigError(f"agent: {spec.name!r} is not an agent; allowed {AGENTS}")


__all__ = ["AGENTS", "Agent", "AgentRequest", "AgentResponse", "AgentSpec", "build_agent"]
