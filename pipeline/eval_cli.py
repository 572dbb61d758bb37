"""`meclear eval`: the FI-LoCoMo benchmark (filled in by the benchmark module)."""

from __future__ import annotations


def add_parser(sub, add_agent_args, agent_options) -> None:
    pass
