"""Settings of a run, declared and validated once.

`RunSettings` holds what the audit (`AuditConfig`, here) and the benchmark (`pipeline.bench.config.EvalConfig`) share:
the retrieval budget and mode, the harm and screen tolerances, the seed, the agent and where it runs. Each default is
written once, in the module that owns the setting (K and the dense modes in `pipeline.retrieval`, the permutation
budget in `pipeline.game.plan`), and the command line reads its defaults from these dataclasses (`field_default`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from pipeline.agents import AGENTS, AgentSpec
from pipeline.agents.utility import UTILITY_MODES
from pipeline.game.adaptive import DEFAULT_Z
from pipeline.game.plan import ADAPTIVE_CAP, ADAPTIVE_ROUND, DEFAULT_PERMUTATIONS, ESTIMATORS
from pipeline.retrieval import DEFAULT_TOP_K, check_dense, check_top_k
from pipeline.validation import check

EXECUTORS = ("ray", "local")
DEFAULT_TAU = 0.05  # harm tolerance: a memory is harmful when its Shapley value is below -tau
DEFAULT_KAPPA = 0.05  # LOO screen: |loo| <= kappa is inconclusive

# Exact enumeration evaluates 2^K coalitions per query: 65,536 at K=16 (minutes per query for an LLM on a GPU). Beyond,
# a typo would start an unbounded night; the permutation estimator covers large K.
MAX_EXACT_K = 16


def field_default(cls: type, name: str) -> Any:
    """The default of dataclass field `name` of `cls` (for argparse, so that defaults are declared only here)."""
    f = {f.name: f for f in dataclasses.fields(cls)}[name]
    return f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]


def check_integer(value: object, where: str, name: str) -> None:
    check(isinstance(value, int) and not isinstance(value, bool), where, f"{name}={value!r}; must be an integer")


def check_number(value: object, where: str, name: str, low: float = 0.0) -> None:
    """A finite number (not a boolean) >= low."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    check(ok, where, f"{name}={value!r}; must be a finite number")
    check(value >= low, where, f"{name}={value!r}; must be >= {low:g}")  # type: ignore[operator]


@dataclass(frozen=True, kw_only=True)
class RunSettings:
    """The settings the audit and the benchmark share. Subclasses call `check_run_settings` from `__post_init__`."""

    top_k: int = DEFAULT_TOP_K
    tau: float = DEFAULT_TAU
    kappa: float = DEFAULT_KAPPA
    seed: int = 0
    dense: str = "auto"
    agent: str = "reader"
    agent_options: dict = field(default_factory=dict)
    executor: str = "ray"
    actors: int = 0  # 0: one per available CPU (reader) or per GPU (LLM agents with gpus_per_actor > 0)
    gpus_per_actor: float = 0.0  # 0: for the vllm agent on a GPU cluster tensor_parallel_size (pipeline.gpu_settings)

    def check_run_settings(self, w: str, top_k_low: int = 1) -> None:
        for name in ("seed", "actors"):
            check_integer(getattr(self, name), w, name)
        check_top_k(self.top_k, w, top_k_low)
        for name in ("tau", "kappa", "gpus_per_actor"):
            check_number(getattr(self, name), w, name)
        check_dense(self.dense, w)
        check(self.agent in AGENTS, w, f"agent={self.agent!r}; allowed {AGENTS}")
        check(isinstance(self.agent_options, dict), w, "agent_options must be a mapping")
        check(self.executor in EXECUTORS, w, f"executor={self.executor!r}; allowed {', '.join(map(repr, EXECUTORS))}")
        check(self.actors >= 0, w, f"actors={self.actors!r}; must be >= 0")

    @property
    def agent_spec(self) -> AgentSpec:
        return AgentSpec(self.agent, dict(self.agent_options))


@dataclass(frozen=True, kw_only=True)
class AuditConfig(RunSettings):
    """Every setting of an audit. Validated at construction; `run_id` is its fingerprint with the inputs' hashes."""

    # 0: the estimator's default, DEFAULT_PERMUTATIONS (16), or ADAPTIVE_CAP (96) for 'adaptive', whose L is a cap that
    # only undecided cases reach; resolved here, so the run's fingerprint and manifest hold the number used.
    permutations: int = 0
    estimator: str = "auto"
    antithetic: bool = False
    utility: str = "probability"
    cpus_per_actor: float = 1.0
    # --executor ray: Ray actors that embed the texts the embedding cache lacks (1 CPU each, started only when a text
    # is missing); 0 embeds in the driver. Not part of what a result depends on (same batches, same vectors).
    embed_actors: int = 0
    batch_size: int = 256  # coalitions per actor task (whole cases are never split across tasks)
    adaptive_round: int = ADAPTIVE_ROUND  # estimator "adaptive": permutations per round; `permutations` is the cap
    adaptive_z: float = DEFAULT_Z  # estimator "adaptive": stop when |phi + tau| > z * SE for every memory

    def __post_init__(self) -> None:
        w = "audit config"
        for name in ("top_k", "permutations", "batch_size", "embed_actors"):  # YAML `true` is no count
            check_integer(getattr(self, name), w, name)
        self.check_run_settings(w)
        if self.permutations == 0:
            object.__setattr__(self, "permutations",
                               ADAPTIVE_CAP if self.estimator == "adaptive" else DEFAULT_PERMUTATIONS)
        check_number(self.cpus_per_actor, w, "cpus_per_actor")
        check(self.estimator != "exact" or self.top_k <= MAX_EXACT_K, w,
              f"estimator='exact' with top_k={self.top_k} needs 2^{self.top_k} = {1 << self.top_k:,} agent calls per query; "
              f"exact is allowed up to top_k={MAX_EXACT_K}, use estimator 'auto' or 'permutation' above")
        check(self.permutations >= 1, w, f"permutations={self.permutations!r}; must be >= 1 (0: the estimator's default)")
        check(self.estimator in ESTIMATORS, w, f"estimator={self.estimator!r}; allowed {ESTIMATORS}")
        pairs = self.antithetic or self.estimator == "adaptive"  # adaptive always draws antithetic pairs
        check(not pairs or self.permutations % 2 == 0, w,
              f"permutations={self.permutations!r}; antithetic sampling (always on with estimator 'adaptive') needs an even number")
        check(self.utility in UTILITY_MODES, w, f"utility={self.utility!r}; allowed {UTILITY_MODES}")
        check(isinstance(self.adaptive_round, int) and self.adaptive_round >= 2
              and (self.estimator != "adaptive" or self.adaptive_round % 2 == 0), w,
              f"adaptive_round={self.adaptive_round!r}; must be an even integer >= 2 (adaptive draws antithetic pairs)")
        check(isinstance(self.adaptive_z, (int, float)) and self.adaptive_z > 0, w, f"adaptive_z={self.adaptive_z!r}; must be > 0")
        check(self.cpus_per_actor > 0, w, f"cpus_per_actor={self.cpus_per_actor!r}; must be > 0")
        check(self.batch_size >= 1, w, f"batch_size={self.batch_size!r}; must be >= 1")
        check(self.embed_actors >= 0, w, f"embed_actors={self.embed_actors!r}; must be >= 0")
        check(self.embed_actors == 0 or self.executor == "ray", w,
              f"embed_actors={self.embed_actors} needs executor 'ray' (with 'local' the driver embeds)")


