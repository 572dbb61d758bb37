"""docs/cli.md, rendered from the argparse parser (`pipeline.cli.main.build_parser`), so the CLI reference cannot drift
from the code: `python -m pipeline.cli.clidoc > docs/cli.md`. tests/e2e/test_docs.py regenerates it and compares.

The rendering uses a fixed width and no terminal size, so the file is the same on every machine."""

from __future__ import annotations

import argparse

WIDTH = 100  # the usage block's line width; fixed so the output does not depend on $COLUMNS
REGENERATE = "python -m pipeline.cli.clidoc > docs/cli.md"


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, tuple[argparse.ArgumentParser, str]]:
    """Subcommand name -> (its parser, its one-line help from `add_parser(help=...)`)."""
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not actions:
        return {}
    helps = {c.dest: c.help or "" for c in actions[0]._choices_actions}
    return {name: (p, helps.get(name, "")) for name, p in actions[0].choices.items()}


def _formatter(parser: argparse.ArgumentParser) -> argparse.HelpFormatter:
    return argparse.HelpFormatter(parser.prog, width=WIDTH, max_help_position=40)


def _default(action: argparse.Action) -> str | None:
    """The default as a user would type it, or None when there is nothing to show (flags off, empty lists)."""
    value = action.default
    # `is` for the flags: 0 == False, and a default of 0 is worth showing
    if value is None or value is False or value in ([], "", argparse.SUPPRESS) or isinstance(
            action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return None
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _help(formatter: argparse.HelpFormatter, action: argparse.Action) -> str:
    if not action.help or action.help == argparse.SUPPRESS:
        return ""
    return " ".join(formatter._expand_help(action).split())  # %(default)s expanded, argparse's own way


def _section(parser: argparse.ArgumentParser, title: str, summary: str = "") -> list[str]:
    formatter = _formatter(parser)
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups)
    out = [f"## {title}", ""] + ([summary[:1].upper() + summary[1:] + ".", ""] if summary else [])
    out += ["```", formatter.format_help().strip(), "```", ""]
    if parser.description:
        out += [" ".join(parser.description.split()), ""]
    rows = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)) or action.help == argparse.SUPPRESS:
            continue
        invocation = formatter._format_action_invocation(action)
        default = _default(action)
        text = _help(formatter, action)
        required = " (required)" if action.required and action.option_strings else ""
        shown = f" (default: `{default}`)" if default is not None else ""
        rows.append(f"- `{invocation}`{required}{shown}: {text}".rstrip(": "))
    return out + rows + [""]


def render() -> str:
    """The whole docs/cli.md: the top-level parser, then every subcommand in the parser's order."""
    from pipeline.cli.main import build_parser

    parser = build_parser()
    subs = _subparsers(parser)
    out = ["# The `meclear` command line", "",
           f"Generated from `pipeline.cli.main.build_parser` by `{REGENERATE}`; do not edit by hand "
           "(`tests/e2e/test_docs.py` fails when this file is out of date).", "",
           "Subcommands: " + ", ".join(f"[`meclear {name}`](#meclear-{name})" for name in subs) + ".", ""]
    out += _section(parser, "meclear")
    for name, (sub, summary) in subs.items():
        out += _section(sub, f"meclear {name}", summary)
    return "\n".join(out).rstrip("\n") + "\n"


if __name__ == "__main__":
    print(render(), end="")
