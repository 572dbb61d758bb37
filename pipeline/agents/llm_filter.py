"""The direct LLM filter baseline: show the model the question and the numbered memories, ask which to drop.

Both LLM agents implement `drop_memories(question, options, memories) -> list[int]` with the same prompt
(`prompts.build_filter_prompt`). The answer is JSON `{"drop": [ids]}` with 1-based ids: vLLM constrains it with a JSON
schema (structured outputs), transformers with a token mask after a forced ' {"drop": [' prefix. Either way the text
goes through `parse_drop_positions`, which never trusts it: ids outside 1..K, duplicates and a truncated tail are
dropped, and unparseable text means "drop nothing" (the filter failing open is what the baseline would do in practice).
"""

from __future__ import annotations

import json
import re
from typing import Any, Protocol, Sequence

FORCED_PREFIX = ' {"drop": ['  # what the transformers agent feeds before constrained decoding of the id list
LIST_CHARS = frozenset("0123456789, ]")  # characters the constrained id list may contain

_INT = re.compile(r"\d+")


class MemoryFilter(Protocol):
    def drop_memories(self, question: str, options: Sequence[str], memories: Sequence[str]) -> list[int]: ...


def drop_schema(n_memories: int) -> dict[str, Any]:
    """JSON schema of the filter's answer: a bounded list of valid 1-based memory ids."""
    ids = list(range(1, n_memories + 1))
    return {
        "type": "object",
        "properties": {
            "drop": {"type": "array", "items": {"type": "integer", "enum": ids} if ids else {"type": "integer"},
                     "maxItems": n_memories},
        },
        "required": ["drop"],
        "additionalProperties": False,
    }


def max_answer_tokens(n_memories: int) -> int:
    """A token budget that fits '{"drop": [...]}' listing every id, with room for separators."""
    return 16 + 4 * n_memories


def parse_drop_positions(text: str, n_memories: int) -> list[int]:
    """0-based positions to drop, from the model's JSON answer (or whatever prefix of it came back)."""
    candidates: list[Any] = []
    start = text.find("{")
    if start >= 0:
        try:
            parsed = json.loads(text[start:])
            if isinstance(parsed, dict) and isinstance(parsed.get("drop"), list):
                candidates = parsed["drop"]
        except json.JSONDecodeError:
            candidates = []
    if not candidates:
        # Fallback for truncated or malformed JSON: the integers inside the first list, up to its end if it has one.
        bracket = text.find("[")
        if bracket >= 0:
            body = text[bracket + 1:]
            end = body.find("]")
            candidates = [int(m) for m in _INT.findall(body if end < 0 else body[:end])]
    positions = {c - 1 for c in candidates if isinstance(c, int) and not isinstance(c, bool) and 1 <= c <= n_memories}
    return sorted(positions)


def filter_memories(agent: MemoryFilter, question: str, options: Sequence[str], memories: Sequence[str]) -> list[int]:
    """0-based positions of the memories `agent` says to drop before answering `question`."""
    if not memories:
        return []
    return agent.drop_memories(question, tuple(options), tuple(memories))
