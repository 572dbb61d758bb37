"""Agents answer batches of coalitions. `checked_spec` makes an `AgentSpec` whose options were validated against the
agent's config class; `build_agent` turns a spec into an agent (lazily importing heavy engines only for the agent asked
for)."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Mapping

from pipeline.agents.base import Agent, AgentRequest, AgentResponse, AgentSpec
from pipeline.core.errors import ConfigError
from pipeline.core.validation import from_mapping

AGENTS = ("reader", "vllm", "transformers", "openai")


# Each agent's settings class, imported only when asked for (the modules around the engines are heavy).
AGENT_CONFIGS = {"reader": ("pipeline.agents.reader", "ReaderConfig"),
                 "vllm": ("pipeline.agents.vllm_agent", "VLLMConfig"),
                 "transformers": ("pipeline.agents.hf_agent", "TransformersConfig"),
                 "openai": ("pipeline.agents.openai_agent", "OpenAIConfig")}


def agent_config(spec: AgentSpec, where: str):
    """The agent's settings: `spec.options` validated against its config class (errors name `where`)."""
    if spec.name not in AGENT_CONFIGS:
        raise ConfigError(f"agent: {spec.name!r} is not an agent; allowed {AGENTS}")
    module, name = AGENT_CONFIGS[spec.name]
    return from_mapping(getattr(importlib.import_module(module), name), spec.options, where)


def checked_spec(name: str, options: Mapping[str, Any], source: str = "--agent-option") -> AgentSpec:
    """An AgentSpec whose options were validated against the agent's config class, in the driver: a bad option is one
    ConfigError naming `source` before Ray or an engine starts, not a traceback from inside an actor."""
    spec = AgentSpec(name, dict(options))
    model = getattr(agent_config(spec, f"agent {name!r} ({source})"), "model", None)
    if isinstance(model, str) and model.startswith(("/", "./", "../", "~")) and not Path(model).expanduser().is_dir():
        raise ConfigError(f"agent {name!r}: model {model!r} is not a folder")
    if name == "openai":  # a wrong base URL or model is one line here, before Ray starts or anything is written
        from pipeline.agents.openai_agent import check_endpoint

        check_endpoint(spec.options)
    return spec


def build_agent(spec: AgentSpec) -> Agent:
    config = agent_config(spec, f"agent {spec.name!r}")
    if spec.name == "reader":
        from pipeline.agents.reader import ReaderAgent

        return ReaderAgent(config)
    if spec.name == "vllm":
        from pipeline.agents.vllm_agent import VLLMAgent

        return VLLMAgent(config)
    if spec.name == "openai":
        from pipeline.agents.openai_agent import OpenAIAgent

        return OpenAIAgent(config)
    from pipeline.agents.hf_agent import TransformersAgent

    return TransformersAgent(config)


__all__ = ["AGENTS", "AGENT_CONFIGS", "Agent", "AgentRequest", "AgentResponse", "AgentSpec", "agent_config",
           "build_agent", "checked_spec"]
