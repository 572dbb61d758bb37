"""Validation shared by the LLM agents' configs (vLLM and transformers): the fields both have mean the same thing."""

from __future__ import annotations

from typing import Any, Sequence

from pipeline.agents import prompts
from pipeline.configs import check

DTYPES = ("auto", "float32", "bfloat16", "float16")


def check_common(cfg: Any, where: str, positive_ints: Sequence[str]) -> None:
    """model, dtype, max_options, n_samples, temperature, seed, and every field in `positive_ints` (integers >= 1)."""
    check(isinstance(cfg.model, str) and bool(cfg.model), where, f"model must be a path or hub name, got {cfg.model!r}")
    check(cfg.dtype in DTYPES, where, f"dtype {cfg.dtype!r} is not one of {DTYPES}")
    for name in positive_ints:
        value = getattr(cfg, name)
        check(isinstance(value, int) and not isinstance(value, bool) and value >= 1, where,
              f"{name} must be an integer >= 1, got {value!r}")
    check(cfg.max_options <= len(prompts.LETTERS), where, f"max_options must be <= {len(prompts.LETTERS)}")
    check(isinstance(cfg.n_samples, int) and cfg.n_samples >= 0, where, f"n_samples must be >= 0, got {cfg.n_samples!r}")
    check(isinstance(cfg.temperature, (int, float)) and cfg.temperature > 0, where,
          f"temperature must be > 0, got {cfg.temperature!r}")
    check(isinstance(cfg.seed, int), where, f"seed must be an integer, got {cfg.seed!r}")
