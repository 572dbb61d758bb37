"""One rule per setting, validity included (issue 19, item 3): each shared setting has one declared check
(`pipeline.audit.settings.SETTING_RULES`); the audit's `AuditConfig` and the benchmark's `EvalConfig` and `MethodConfig`
all call it, and nothing else in the package checks these settings. NaN and infinities are refused everywhere."""

from __future__ import annotations

import ast
import math
import re
from pathlib import Path

import pytest

from pipeline.audit.settings import MAX_PERMUTATIONS, SETTING_RULES, AuditConfig
from pipeline.bench.builder import BuildConfig
from pipeline.bench.config import EvalConfig
from pipeline.bench.methods import MethodConfig
from pipeline.core.errors import ConfigError

PACKAGE = Path(__file__).resolve().parents[2] / "pipeline"
DECLARED = {"tau", "kappa", "top_k", "permutations", "utility", "seed", "budget"}

# Every call of a rule: (module, setting). A new config holding a shared setting adds its call here.
CHECKS = {
    ("audit/settings.py", "seed"), ("audit/settings.py", "top_k"), ("audit/settings.py", "tau"),
    ("audit/settings.py", "kappa"),
    ("audit/settings.py", "permutations"), ("audit/settings.py", "utility"), ("audit/settings.py", "budget"),
    ("bench/config.py", "budget"),
    ("bench/config.py", "permutations"), ("bench/config.py", "utility"),
    ("bench/methods.py", "tau"), ("bench/methods.py", "kappa"),
    ("bench/builder.py", "top_k"), ("bench/builder.py", "seed"), ("bench/reretrieval.py", "top_k"),
}
# Rules called directly, where `check_setting` cannot be imported: retrieval owns K's rule and sits below settings.
DIRECT = {("retrieval/frozen.py", "check_top_k")}
RULE_FUNCTIONS = {"check_tau", "check_kappa", "check_top_k", "check_permutations", "check_utility", "check_seed",
                  "check_budget_setting"}

# setting -> values every holder must refuse (NaN and infinities first: the defect of issue 19)
BAD = {
    "tau": [math.nan, math.inf, -math.inf, -0.1, True, "0.1", None],
    "kappa": [math.nan, math.inf, -1.0, False, "x"],
    "top_k": [0, 64, True, 2.0, math.nan],
    "permutations": [-1, MAX_PERMUTATIONS + 1, True, 1.5, math.inf],
    "utility": ["prob", "", None, 1],
    "seed": [-5, 2**63, True, 1.0, math.nan],
    "budget": [-1, 3, 6, (1 << 20) + 1, True, 64.0, math.inf],  # 6 < top_k+2 at the default K=5
}


def _holders(name: str, value):
    """Build every config that holds setting `name` with `value` (zero-argument callables)."""
    out = {"AuditConfig": lambda: AuditConfig(**{name: value})}
    if name == "budget":  # the benchmark's --budgets: agent evaluations per case
        out["EvalConfig.eval_budgets"] = lambda: EvalConfig(locomo="x", eval_budgets=(value,))
    elif name == "permutations":  # the benchmark's permutation budgets
        out["EvalConfig.budgets"] = lambda: EvalConfig(locomo="x", budgets=(value,))
    elif name == "utility":  # the benchmark runs a set of utility modes
        out["EvalConfig.utility"] = lambda: EvalConfig(locomo="x", utility=(value,))
    else:
        out["EvalConfig"] = lambda: EvalConfig(locomo="x", **{name: value})
    if name in ("tau", "kappa"):
        out["MethodConfig"] = lambda: MethodConfig(**{name: value})
    if name in ("top_k", "seed"):
        out["BuildConfig"] = lambda: BuildConfig(**{name: value})
    return out


def _name(func: ast.expr) -> str:
    return getattr(func, "id", getattr(func, "attr", ""))


def _calls() -> set[tuple[str, str]]:
    """(module, setting) of every `check_setting("<setting>", ...)` call in the package."""
    found = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and _name(node.func) == "check_setting":
                arg = node.args[0]
                assert isinstance(arg, ast.Constant), f"{path}: check_setting needs the setting's name as a literal"
                found.add((str(path.relative_to(PACKAGE)), arg.value))
    return found


def test_every_shared_setting_has_one_declared_rule():
    assert set(SETTING_RULES) == DECLARED


def test_every_check_of_a_shared_setting_is_a_call_of_its_rule():
    assert _calls() == CHECKS
    assert {name for _, name in CHECKS} == DECLARED  # every declared rule is used
    assert {f.__name__ for f in SETTING_RULES.values()} == RULE_FUNCTIONS
    # and no second rule: no other validator is handed one of these settings by name
    others = {"check_number", "check_integer"}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            func = _name(node.func)
            inside_rules = path.name == "settings.py"  # the rules themselves (check_tau calls check_number)
            direct = (str(path.relative_to(PACKAGE)), func) in DIRECT
            assert inside_rules or direct or func not in RULE_FUNCTIONS, f"{path}:{node.lineno} calls {func} directly"
            if func in others:
                names = {a.value for a in node.args if isinstance(a, ast.Constant)}
                assert inside_rules or not names & DECLARED, f"{path}:{node.lineno} checks {names & DECLARED} itself"


@pytest.mark.parametrize("name,value", [(n, v) for n, vs in BAD.items() for v in vs], ids=repr)
def test_every_holder_refuses_what_the_rule_refuses_with_the_same_words(name, value):
    messages = {}
    for holder, build in _holders(name, value).items():
        with pytest.raises(ConfigError) as err:
            build()
        messages[holder] = str(err.value).split(": ", 1)[1]  # without the "<which config>: " prefix
    assert len(messages) >= 2, messages  # the audit and the benchmark both hold every shared setting
    # one rule: one message wherever the setting is held, up to the lower bound a holder passes to it (the benchmark
    # needs K >= 2 for its redundant pairs; the audit's permutations=0 means the estimator's default)
    texts = {re.sub(r"allowed \d+\.\.", "allowed LOW..", m.replace("budgets=", f"{name}=" if name == "budget"
                                                                   else "permutations="))
             .replace(" (0: the estimator's default)", "").replace(", or 0 for none", "") for m in messages.values()}
    assert len(texts) == 1, messages


def test_the_rules_accept_the_defaults_and_the_bounds():
    for cfg in (AuditConfig(), EvalConfig(locomo="x"), MethodConfig()):
        assert cfg.tau == 0.05 and cfg.kappa == 0.05
    AuditConfig(seed=2**63 - 1, tau=0.0, kappa=0, permutations=MAX_PERMUTATIONS, top_k=63, estimator="permutation")
    EvalConfig(locomo="x", seed=0, budgets=(1, MAX_PERMUTATIONS), utility=("correct",), top_k=2)
    assert AuditConfig(permutations=0).permutations == 16  # 0: the estimator's default, resolved at construction
