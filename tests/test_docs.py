"""The README keeps up with the code: every `meclear` subcommand and flag is documented (as sqlite-utils' test of its
documented commands does), and the developer guide's module map lists exactly the modules under pipeline/."""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

import pytest

from pipeline.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _flags() -> list[tuple[str, str]]:
    out = [("meclear", f) for a in build_parser()._actions for f in a.option_strings if f.startswith("--")]
    for name, parser in _subcommands().items():
        out += [(name, f) for a in parser._actions for f in a.option_strings if f.startswith("--")]
    return sorted({(c, f) for c, f in out if f != "--help"})


def test_the_parser_has_flags_to_check():
    assert {"audit", "eval", "report", "curate", "probe"} <= set(_subcommands())
    assert ("audit", "--top-k") in _flags() and ("eval", "--permutation-budgets") in _flags()


@pytest.mark.parametrize("command", sorted(_subcommands()))
def test_every_subcommand_is_documented(command):
    assert f"meclear {command}" in README, f"README never shows `meclear {command}`"


@pytest.mark.parametrize("command,flag", _flags())
def test_every_flag_is_documented(command, flag):
    # the whole flag: `--top` must not pass because `--top-k` is there
    assert re.search(re.escape(flag) + r"(?![\w-])", README), f"README never mentions {flag} (meclear {command})"


def _module_map() -> list[str]:
    section = README.split("\n## Developer guide\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^- `(pipeline/[\w/]+\.py)`: \S", section, flags=re.M)


def test_module_map_matches_the_tree():
    listed = _module_map()
    tree = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "pipeline").rglob("*.py") if p.name != "__init__.py")
    assert len(listed) == len(set(listed)), f"listed twice: {sorted({m for m in listed if listed.count(m) > 1})}"
    assert not sorted(set(tree) - set(listed)), f"modules missing from the README's module map: {sorted(set(tree) - set(listed))}"
    assert not sorted(set(listed) - set(tree)), f"README's module map lists modules that do not exist: {sorted(set(listed) - set(tree))}"


def _imported_modules(path: Path) -> set[str]:
    """Module files under pipeline/ that `path` imports (lazy imports included), as repository paths."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pipeline"):
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.startswith("pipeline")]
        else:
            continue
        out |= {n.replace(".", "/") + ".py" for n in names if (ROOT / (n.replace(".", "/") + ".py")).exists()}
    return out


def test_module_map_runs_from_the_ground_floor_up():
    listed = _module_map()
    place = {m: i for i, m in enumerate(listed)}
    upward = [f"{m} imports {t}" for m in listed for t in sorted(_imported_modules(ROOT / m))
              if t in place and place[t] > place[m]]
    assert not upward, f"imports that run up the README's module map (reorder it, or fix the import): {upward}"
