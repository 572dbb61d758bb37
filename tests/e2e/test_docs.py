"""The docs keep up with the code: docs/cli.md is the parser rendered (regenerated and compared, as sqlite-utils checks
its documented commands), every `meclear` flag has help text, the module map in docs/architecture.md lists exactly the
modules under pipeline/, and the README stays a short front door linking every docs page."""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

import pytest

from pipeline.cli import clidoc
from pipeline.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
CLI_MD = ROOT / "docs" / "cli.md"
ARCHITECTURE = ROOT / "docs" / "architecture.md"


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


def test_docs_cli_md_is_current():
    assert CLI_MD.exists() and CLI_MD.read_text() == clidoc.render(), \
        f"docs/cli.md is out of date with the parser: run `{clidoc.REGENERATE}`"


@pytest.mark.parametrize("command", sorted(_subcommands()))
def test_every_subcommand_is_documented_in_docs_cli(command):
    assert f"## meclear {command}\n" in CLI_MD.read_text(), f"docs/cli.md has no section for `meclear {command}`"


@pytest.mark.parametrize("command,flag", _flags())
def test_every_flag_has_help_text_for_docs_cli(command, flag):
    parser = build_parser() if command == "meclear" else _subcommands()[command]
    action = next(a for a in parser._actions if flag in a.option_strings)
    assert action.help and action.help != argparse.SUPPRESS and action.help.strip(), \
        f"meclear {command} {flag} has no help text, so docs/cli.md cannot say what it does"
    # the whole flag: `--top` must not pass because `--top-k` is there
    assert re.search(re.escape(flag) + r"(?![\w-])", CLI_MD.read_text()), f"docs/cli.md never mentions {flag}"


def _module_map() -> list[str]:
    return re.findall(r"^- `(pipeline/[\w/]+\.py)`: \S", ARCHITECTURE.read_text(), flags=re.M)


def test_module_map_matches_the_tree():
    listed = _module_map()
    tree = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "pipeline").rglob("*.py") if p.name != "__init__.py")
    assert len(listed) == len(set(listed)), f"listed twice: {sorted({m for m in listed if listed.count(m) > 1})}"
    missing, extra = sorted(set(tree) - set(listed)), sorted(set(listed) - set(tree))
    assert not missing, f"modules missing from the module map in docs/architecture.md: {missing}"
    assert not extra, f"the module map in docs/architecture.md lists modules that do not exist: {extra}"


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
    assert not upward, f"imports that run up the module map in docs/architecture.md (reorder it, or fix the import): " \
                       f"{upward}"


def _docs_pages() -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")) + ["CHANGELOG.md"]


def test_readme_is_a_short_front_door_linking_every_docs_page():
    lines = README.splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; keep it a front door (at most 200), detail in docs/"
    unlinked = [p for p in _docs_pages() if not re.search(r"\]\(" + re.escape(p) + r"(#[^)]*)?\)", README)]
    assert not unlinked, f"README.md does not link {unlinked}: add each to its Documentation list"


def test_readme_quick_start_block_holds_the_ci_test_command():
    # .ci/run reads the second line of the Quick start's ```bash block as the test command
    section = README.split("\n## Quick start\n", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash\n", 1)[1].split("\n```", 1)[0].splitlines()
    assert len(block) == 2 and "pytest" in block[1], f"Quick start block: install+audit, then the tests: {block}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_relative_links_in_the_readme_and_docs_resolve():
    # docs/fi-*-summary.md are `meclear eval`'s summary.md copied as written (their figure link is relative to the
    # eval folder); every other page is checked, anchors included
    broken = []
    for page in ["README.md", *(p for p in _docs_pages() if not re.match(r"docs/fi-.*-summary\.md$", p))]:
        path = ROOT / page
        text = path.read_text()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                broken.append(f"{page}: {target} (no such file)")
            elif anchor and dest.suffix == ".md":
                heads = re.findall(r"^#+ (.*)$", dest.read_text(), flags=re.M)
                if anchor not in {_slug(h) for h in heads}:
                    broken.append(f"{page}: {target} (no such heading)")
    assert not broken, f"broken links: {broken}"
