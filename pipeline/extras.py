"""Optional dependencies, checked before any work starts: a run must not fail for a missing package at its very end."""

from __future__ import annotations

import importlib.util
from typing import Iterable

from pipeline.errors import MissingDependencyError


def require(extra: str, modules: Iterable[tuple[str, str]], what: str) -> None:
    """Raise one MissingDependencyError naming every missing (import name, package) and the install command."""
    missing = [pkg for mod, pkg in modules if importlib.util.find_spec(mod) is None]
    if missing:
        raise MissingDependencyError(f"{what} needs {', '.join(missing)} (the '{extra}' extra): "
                                     f"pip install -e '.[{extra}]'  (or: pip install 'meclear[{extra}]')")


def require_eval(methods: Iterable[str]) -> None:
    """`meclear eval`: matplotlib draws figure.png; scikit-learn fits ContextCite and ProxySPEX surrogates."""
    modules = [("matplotlib", "matplotlib")]
    if any(m.startswith(("contextcite", "proxyspex")) for m in methods):
        modules.append(("sklearn", "scikit-learn"))
    require("eval", modules, "meclear eval")
