"""The LLM agents' configs, pinned: the fingerprint of each default config (it keys caches and run ids, so an unchanged
config must keep its fingerprint), the unknown-key and missing-model errors, and the shared validation messages.
Pinned before the shared fields were declared once (`pipeline.agents.llm_config.LLMConfig`) and unchanged by it."""

from __future__ import annotations

import pytest

from pipeline.agents.hf_agent import TransformersAgent, TransformersConfig
from pipeline.agents.llm_config import agent_fingerprint_fields
from pipeline.agents.vllm_agent import VLLMAgent, VLLMConfig
from pipeline.core.errors import ConfigError
from pipeline.core.validation import fingerprint

AGENTS = [
    (TransformersAgent, TransformersConfig, "5d74970705ae", "b380ba7c4aa5",
     ["batch_size", "cloze_norm", "device", "dtype", "max_options", "max_tokens", "model", "n_samples", "scoring",
      "seed", "temperature"]),
    (VLLMAgent, VLLMConfig, "fa64e0682a9c", "831fd93dc922",
     ["block_size", "cloze_norm", "dtype", "enable_prefix_caching", "enforce_eager", "gpu_memory_utilization",
      "kv_cache_gib", "max_model_len", "max_num_seqs", "max_options", "max_tokens", "model", "n_samples", "scoring",
      "seed", "temperature", "tensor_parallel_size"]),
]


@pytest.mark.parametrize("agent,config,agent_fp,config_fp,allowed", AGENTS)
def test_default_config_fingerprints_are_pinned(agent, config, agent_fp, config_fp, allowed):
    # what the agent's fingerprint covers before the engine's resolved settings (dtype, ...) are added on top
    cfg = config(model="/models/m")
    assert fingerprint(agent_fingerprint_fields(agent.name, cfg, "/models/m", "letter")) == agent_fp
    assert fingerprint(cfg) == config_fp


@pytest.mark.parametrize("agent,config,agent_fp,config_fp,allowed", AGENTS)
def test_config_errors_are_unchanged(agent, config, agent_fp, config_fp, allowed):
    where = f"{agent.name} agent config"
    with pytest.raises(ConfigError) as err:
        config.from_mapping({"model": "m", "temprature": 1})
    assert str(err.value) == f"{where}: unknown key(s) ['temprature']; allowed: {allowed}"
    with pytest.raises(ConfigError) as err:
        config.from_mapping({})
    assert str(err.value) == f"{where}: {config.__name__}.__init__() missing 1 required positional argument: 'model'"
    for bad, says in [({"seed": -1}, "seed must be an integer from 0 to 2**32-1, got -1"),
                      ({"dtype": "fp8"}, "dtype 'fp8' is not one of ('auto', 'float32', 'bfloat16', 'float16')"),
                      ({"max_options": 0}, "max_options must be an integer >= 1, got 0"),
                      ({"temperature": 0}, "temperature must be > 0, got 0"),
                      ({"cloze_norm": "max"}, "cloze_norm 'max' is not one of ('sum', 'mean')")]:
        with pytest.raises(ConfigError) as err:
            config.from_mapping({"model": "m", **bad})
        assert str(err.value).startswith(where) and str(err.value).endswith(says), str(err.value)
