"""Settings of a run, declared and validated once.

`RunSettings` holds what the audit (`AuditConfig`, here) and the benchmark (`pipeline.bench.config.EvalConfig`) share:
the retrieval budget and mode, the harm and screen tolerances, the seed, the agent and where it runs. Each default is
written once, in the module that owns the setting (K and the dense modes in `pipeline.retrieval.frozen`, the permutation
budget in `pipeline.game.plan`), and the command line reads its defaults from these dataclasses (`field_default`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable

from pipeline.agents import AGENTS, AgentSpec
from pipeline.agents.utility import UTILITY_MODES
from pipeline.core.validation import check
from pipeline.game.adaptive import DEFAULT_Z
from pipeline.game.plan import (
    ADAPTIVE_CAP,
    ADAPTIVE_PRIOR,
    ADAPTIVE_ROUND,
    ADAPTIVE_RULE,
    ADAPTIVE_RULES,
    DEFAULT_PERMUTATIONS,
    ESTIMATORS,
    min_budget,
)
from pipeline.retrieval.frozen import DEFAULT_TOP_K, check_dense, check_top_k

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


# A typo in --permutations (an extra zero or three) must not start an unbounded night: a case costs about L x K agent
# calls (200,000 at L=10,000, K=20); the adaptive estimator reaches its precision far below this cap.
MAX_PERMUTATIONS = 10_000
MAX_SEED = 2**63 - 1  # a seed is stored as a signed 64-bit integer; numpy's SeedSequence refuses negative ones


def check_tau(value: object, where: str) -> None:
    """The harm tolerance: a finite number >= 0 (a memory is harmful when its Shapley value is below -tau)."""
    check_number(value, where, "tau")


def check_kappa(value: object, where: str) -> None:
    """The LOO screen tolerance: a finite number >= 0."""
    check_number(value, where, "kappa")


def check_permutations(value: object, where: str, low: int = 1, field: str = "permutations") -> None:
    """A permutation budget L: an integer from `low` (the audit allows 0: the estimator's default) to
    MAX_PERMUTATIONS. The benchmark's budgets are permutation budgets too (`field` names the field)."""
    check_integer(value, where, field)
    check(low <= value <= MAX_PERMUTATIONS, where,  # type: ignore[operator]
          f"{field}={value!r}; allowed {low}..{MAX_PERMUTATIONS:,}"
          + (" (0: the estimator's default)" if low == 0 else ""))


def check_utility(value: object, where: str) -> None:
    """A utility mode v(S) of a coalition: one of UTILITY_MODES."""
    check(value in UTILITY_MODES, where, f"utility={value!r}; allowed {UTILITY_MODES}")


def check_seed(value: object, where: str) -> None:
    check_integer(value, where, "seed")
    check(0 <= value <= MAX_SEED, where, f"seed={value!r}; allowed 0..2**63-1")  # type: ignore[operator]


# A budget is distinct agent evaluations per query (pipeline.game.estimators.split_budget). The cap stops a typo from
# starting an unbounded night: 2^20 is exact enumeration at the largest K, and no estimator needs more.
MAX_BUDGET = 1 << 20


def check_budget_setting(value: object, where: str, top_k: int, field: str = "budget", none: bool = True) -> None:
    """An evaluation budget per query: an integer from top_k+2 (the empty set, the full context and the full context
    minus each memory, which every estimator asks first) to MAX_BUDGET; 0 means no budget where `none` allows it."""
    check_integer(value, where, field)
    low = min_budget(top_k) if isinstance(top_k, int) and top_k >= 1 else top_k + 2
    check((none and value == 0) or low <= value <= MAX_BUDGET, where,  # type: ignore[operator]
          f"{field}={value!r}; allowed {low}..{MAX_BUDGET:,} agent evaluations per query (top_k+2 = {low}: the empty "
          "set, the full context and the full context minus each memory)" + (", or 0 for none" if none else ""))


# One rule per setting, validity included: every config that holds one of these settings (the audit's `AuditConfig`,
# the benchmark's `EvalConfig`, `MethodConfig`, `BuildConfig` and `PoolIndex`) checks it through `check_setting`,
# nowhere else (tests/audit/test_setting_rules.py lists every declaration and every call). top_k's rule is declared by
# retrieval, which owns K and, sitting below this module, calls it directly.
SETTING_RULES: dict[str, Callable[..., None]] = {
    "tau": check_tau,
    "kappa": check_kappa,
    "top_k": check_top_k,
    "permutations": check_permutations,
    "utility": check_utility,
    "seed": check_seed,
    "budget": check_budget_setting,
}


def check_setting(name: str, value: object, where: str, **options: Any) -> None:
    """Check `value` of setting `name` by its one rule (`options`: the rule's keywords, e.g. top_k's `low`)."""
    SETTING_RULES[name](value, where, **options)


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
    gpus_per_actor: float = 0.0  # 0: for the vllm agent on a GPU cluster tensor_parallel_size (pipeline.exec.gpu)

    def check_run_settings(self, w: str, top_k_low: int = 1) -> None:
        check_integer(self.actors, w, "actors")
        check_setting("seed", self.seed, w)
        check_setting("top_k", self.top_k, w, low=top_k_low)
        check_setting("tau", self.tau, w)
        check_setting("kappa", self.kappa, w)
        check_number(self.gpus_per_actor, w, "gpus_per_actor")
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
    adaptive_prior: float = ADAPTIVE_PRIOR  # estimator "adaptive": variance pseudo-draws (pipeline.game.estimators)
    adaptive_rule: str = ADAPTIVE_RULE  # estimator "adaptive": "check" (default) or "separation" (ADAPTIVE_RULES)
    # Distinct agent evaluations per query, clearance checks included (pipeline.game.estimators.split_budget); 0: no
    # budget, the paper's setting (`permutations` decides). With a budget `permutations` is only the adaptive cap.
    budget: int = 0

    def __post_init__(self) -> None:
        w = "audit config"
        for name in ("batch_size", "embed_actors"):  # YAML `true` is no count
            check_integer(getattr(self, name), w, name)
        check_setting("permutations", self.permutations, w, low=0)
        self.check_run_settings(w)
        if self.permutations == 0:
            object.__setattr__(self, "permutations",
                               ADAPTIVE_CAP if self.estimator == "adaptive" else DEFAULT_PERMUTATIONS)
        check_number(self.cpus_per_actor, w, "cpus_per_actor")
        check(self.estimator != "exact" or self.top_k <= MAX_EXACT_K, w,
              f"estimator='exact' with top_k={self.top_k} needs 2^{self.top_k} = {1 << self.top_k:,} agent calls "
              "per query; "
              f"exact is allowed up to top_k={MAX_EXACT_K}, use estimator 'auto' or 'permutation' above")
        check(self.estimator in ESTIMATORS, w, f"estimator={self.estimator!r}; allowed {ESTIMATORS}")
        check_setting("budget", self.budget, w, top_k=self.top_k)
        check(self.budget == 0 or self.estimator != "exact" or self.budget >= 1 << self.top_k, w,
              f"estimator='exact' with budget={self.budget} at top_k={self.top_k}: exact needs 2^{self.top_k} = "
              f"{1 << self.top_k:,} evaluations per query; raise the budget or use estimator 'auto'")
        check(isinstance(self.adaptive_prior, (int, float)) and self.adaptive_prior >= 0, w,
              f"adaptive_prior={self.adaptive_prior!r}; must be >= 0")
        check(self.adaptive_rule in ADAPTIVE_RULES, w,
              f"adaptive_rule={self.adaptive_rule!r}; allowed {ADAPTIVE_RULES}")
        pairs = self.antithetic or self.estimator in ("adaptive", "antithetic")  # they always draw antithetic pairs
        check(not pairs or self.permutations % 2 == 0, w,
              f"permutations={self.permutations!r}; antithetic sampling (always on with estimators 'adaptive' and "
              "'antithetic') needs an even number")
        check_setting("utility", self.utility, w)
        check(isinstance(self.adaptive_round, int) and self.adaptive_round >= 2
              and (self.estimator != "adaptive" or self.adaptive_round % 2 == 0), w,
              f"adaptive_round={self.adaptive_round!r}; must be an even integer >= 2 (adaptive draws antithetic pairs)")
        # one rule, one message: finite (z = inf would never stop a case before the cap) and > 0
        ok = isinstance(self.adaptive_z, (int, float)) and not isinstance(self.adaptive_z, bool)
        check(ok and math.isfinite(self.adaptive_z), w, f"adaptive_z={self.adaptive_z!r}; must be a finite number")
        check(self.adaptive_z > 0, w, f"adaptive_z={self.adaptive_z!r}; must be a finite number > 0")
        check(self.cpus_per_actor > 0, w, f"cpus_per_actor={self.cpus_per_actor!r}; must be > 0")
        check(self.batch_size >= 1, w, f"batch_size={self.batch_size!r}; must be >= 1")
        check(self.embed_actors >= 0, w, f"embed_actors={self.embed_actors!r}; must be >= 0")
        check(self.embed_actors == 0 or self.executor == "ray", w,
              f"embed_actors={self.embed_actors} needs executor 'ray' (with 'local' the driver embeds)")


