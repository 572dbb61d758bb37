"""`EvalConfig`: every setting of an FI-LoCoMo benchmark run, validated at construction (the shared fields and their
checks come from `pipeline.audit.settings.RunSettings`)."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.agents.utility import UTILITY_MODES
from pipeline.audit.settings import RunSettings, check_setting
from pipeline.bench.bootstrap import DEFAULT_REPLICATES
from pipeline.bench.builder import BuildConfig
from pipeline.bench.methods import (
    DEFAULT_BUDGETS,
    DEFAULT_METHODS,
    MethodConfig,
    expand_methods,
)
from pipeline.core.validation import check


@dataclass(frozen=True, kw_only=True)
class EvalConfig(RunSettings):
    """Every setting of a benchmark run; validated at construction. `methods` may use the CLI shorthands."""

    locomo: str
    conversations: tuple[str, ...] = ()  # sample_ids; empty = all
    max_cases: int = 0  # per mechanism, over the whole run; 0 = no cap
    max_queries: int = 0  # eligible queries tried per conversation, in file order; 0 = all
    methods: tuple[str, ...] = DEFAULT_METHODS
    utility: tuple[str, ...] = UTILITY_MODES
    budgets: tuple[int, ...] = DEFAULT_BUDGETS  # MeClear permutation budgets L (the paper's setting)
    # Evaluation budgets B (distinct agent calls per case, clearance included): non-empty = the budgeted benchmark,
    # every contract estimator, ContextCite and ProxySPEX at every B (`meclear eval --budgets`).
    eval_budgets: tuple[int, ...] = ()
    replicates: int = DEFAULT_REPLICATES
    redundancy: int | tuple[int, ...] | None = None  # r per redundant variant; None: (2,), or (2, 3) with eval_budgets
    filter_threshold: float = 0.5

    def __post_init__(self) -> None:
        w = "eval config"
        for name in ("conversations", "methods", "utility", "budgets", "eval_budgets"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        r = self.redundancy
        r = ((2, 3) if self.eval_budgets else (2,)) if r is None else ((r,) if isinstance(r, int) else tuple(r))
        object.__setattr__(self, "redundancy", r)
        check(isinstance(self.locomo, str) and bool(self.locomo), w, f"locomo={self.locomo!r}; a LoCoMo json path")
        check(bool(self.budgets), w, "budgets is empty")
        for b in self.budgets:  # each a permutation budget L of MeClear
            check_setting("permutations", b, w, field="budgets")
        for b in self.eval_budgets:  # agent evaluations per case, by the audit's one budget rule
            check_setting("budget", b, w, top_k=self.top_k, field="budgets", none=False)
        check(len(set(self.eval_budgets)) == len(self.eval_budgets), w,
              f"budgets={self.eval_budgets!r} repeats a value")
        object.__setattr__(self, "methods", expand_methods(self.methods, self.budgets, self.eval_budgets, self.top_k))
        check(bool(self.methods), w, "methods is empty")
        check(bool(self.utility), w, f"utility is empty; allowed a non-empty subset of {UTILITY_MODES}")
        for mode in self.utility:
            check_setting("utility", mode, w)
        check(len(set(self.utility)) == len(self.utility), w, f"utility={self.utility!r} repeats a mode")
        check(isinstance(self.replicates, int) and self.replicates >= 1, w, f"replicates={self.replicates!r}; >= 1")
        check(isinstance(self.max_cases, int) and self.max_cases >= 0, w, f"max_cases={self.max_cases!r}; must be >= 0")
        self.check_run_settings(w, top_k_low=2)  # fault cases need room for a redundant pair
        _ = (self.build_config, self.method_config)  # validate both now, not on a worker later

    @property
    def build_config(self) -> BuildConfig:
        return BuildConfig(top_k=self.top_k, redundancy=self.redundancy, max_cases=self.max_cases,
                           max_queries=self.max_queries, seed=self.seed)

    @property
    def method_config(self) -> MethodConfig:
        return MethodConfig(tau=self.tau, kappa=self.kappa, filter_threshold=self.filter_threshold)
