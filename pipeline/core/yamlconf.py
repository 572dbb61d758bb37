"""YAML for settings (job configs, `--agent-option KEY=VALUE`), read with bounds so that a small hostile file can
neither hang a run nor blow up its error message.

PyYAML's safe loader shares an aliased node instead of copying it, but the constructed Python value is walked by every
later step (validation, fingerprints, `json.dumps` of the config), so a few hundred bytes of nested aliases (the
"billion laughs") expanded into minutes of work and a 39 MB error line. Here the composed node graph is measured
first, counting each alias as the nodes it stands for, without building anything; then:

- a document over MAX_BYTES, or over MAX_NODES nodes after alias expansion, or with a recursive alias, is refused;
- a key given twice in one mapping is refused (PyYAML silently keeps the last one; a merge `<<` may still override);
- an integer of more than MAX_INT_DIGITS digits is refused, the limit Python applies to JSON numbers too;
- every error is one short line (at most ERROR_CHARS characters of the parser's own words).
"""

from __future__ import annotations

from typing import Any

from pipeline.core.errors import ConfigError
from pipeline.core.text import safe

MAX_BYTES = 1 << 20  # a job config is a few hundred bytes; a flag's value a few
MAX_NODES = 100_000  # scalars, sequences and mappings after alias expansion
MAX_INT_DIGITS = 4_300  # sys.get_int_max_str_digits()'s default: the same limit as a JSON number (pipeline.io.records)
ERROR_CHARS = 160

_INT = "tag:yaml.org,2002:int"
_MERGE = "tag:yaml.org,2002:merge"


def load_yaml(text: str | bytes, where: str) -> Any:
    """The value of YAML document `text` (bytes are read as UTF-8). Raises ConfigError with one line starting with
    `where` (a file, or a flag and its value) for anything the module docstring refuses."""
    import yaml

    if isinstance(text, bytes):
        if len(text) > MAX_BYTES:
            raise ConfigError(f"{where}: is {len(text):,} bytes; the limit is {MAX_BYTES:,}")
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{where}: is not UTF-8 text (byte {exc.start})") from None
    elif len(text.encode("utf-8", "surrogatepass")) > MAX_BYTES:
        raise ConfigError(f"{where}: is more than {MAX_BYTES:,} bytes; the limit is {MAX_BYTES:,}")
    loader = yaml.SafeLoader(text)
    try:
        try:
            node = loader.get_single_node()
        except RecursionError:
            raise ConfigError(f"{where}: is nested too deeply to read") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"{where}: not valid YAML ({_short(exc)})") from None
        if node is None:
            return None
        _check(node, where)
        try:
            return loader.construct_document(node)
        except RecursionError:
            raise ConfigError(f"{where}: is nested too deeply to read") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"{where}: not valid YAML ({_short(exc)})") from None
    finally:
        loader.dispose()


def _short(exc: Exception) -> str:
    """The parser's problem and position, never the (possibly huge) snippet it quotes."""
    problem = getattr(exc, "problem", None) or getattr(exc, "context", None) or type(exc).__name__
    mark = getattr(exc, "problem_mark", None)
    at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    text = " ".join(safe(str(problem)).split())
    if len(text) > ERROR_CHARS:
        text = text[:ERROR_CHARS] + "..."
    return text + at


def _check(root, where: str) -> None:
    """Walk the node graph once (iteratively: depth is bounded by the composer, not by Python's stack); each node's
    expanded size is memoised, so shared nodes cost one visit and the total is exact."""
    import yaml

    size: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        if done:
            on_path.discard(key)
            children = _children(node)
            size[key] = 1 + sum(size[id(c)] for c in children)
            if size[key] > MAX_NODES:
                raise ConfigError(f"{where}: expands to more than {MAX_NODES:,} values (nested aliases); the limit "
                                  f"is {MAX_NODES:,}")
            continue
        if key in size:
            continue
        if key in on_path:
            raise ConfigError(f"{where}: holds a recursive alias (a value that contains itself)")
        if isinstance(node, yaml.ScalarNode):
            if node.tag == _INT and sum(ch.isdigit() for ch in node.value) > MAX_INT_DIGITS:
                line = node.start_mark.line + 1
                raise ConfigError(f"{where}: line {line}: holds an integer with more than {MAX_INT_DIGITS:,} digits")
            size[key] = 1
            continue
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for k, _ in node.value:
                if isinstance(k, yaml.ScalarNode) and k.tag != _MERGE:
                    ident = (k.tag, k.value)
                    if ident in seen:
                        raise ConfigError(f"{where}: line {k.start_mark.line + 1}: key {safe(k.value)[:80]!r} is "
                                          f"given twice in one mapping (first at line {seen[ident]}); keep one")
                    seen[ident] = k.start_mark.line + 1
        on_path.add(key)
        stack.append((node, True))
        stack.extend((c, False) for c in _children(node) if id(c) not in size)


def _children(node) -> list:
    import yaml

    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []
