"""Typed input records and their validation. Every problem names the file, the line or row, and the field."""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from pipeline.core.errors import InputError
from pipeline.core.text import gold_index, normalize_answer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Memory:
    memory_id: str
    text: str
    timestamp: str | None = None
    speaker: str | None = None
    metadata: dict | None = None


@dataclass(frozen=True)
class Pool:
    pool_id: str
    memories: tuple[Memory, ...]
    source: str  # file it came from


@dataclass(frozen=True)
class Query:
    query_id: str
    pool_id: str
    question: str
    answer: str
    options: tuple[str, ...] = ()
    category: str | None = None
    evidence: tuple[str, ...] = field(default=(), compare=False)  # memory ids that support the answer, when known


# Limits on what a user can make huge, each a one-line input error (exit 2) before anything is written. Each bounds a
# cost that grows with the input: the reader compares every option with every other (options squared: 10,000 options
# in one query had not finished after 300 s), retrieval and the prompts grow with the texts, ids and metadata are
# copied into every output row. The limits sit far above real data (LoCoMo: 4 options, questions under 200
# characters, turns under 1,000) and are listed in the README (Inputs: limits).
MAX_MEMORY_CHARS = 100_000  # default of --max-memory-chars: one memory's text
MAX_FIELD_CHARS = 1_000  # an id (memory, query, pool, LoCoMo sample/turn), timestamp, speaker or category
MAX_QUESTION_CHARS = 10_000  # a question
MAX_OPTION_CHARS = 1_000  # one option, and the answer
MAX_OPTIONS = 64  # options per query (also the most --locomo-options may ask for)
MAX_METADATA_DEPTH = 32  # nesting of a memory's metadata (carried into the outputs, never shown to the agent)


def regular_file(path: Path) -> Path:
    """`path` if it is a regular file (or a link to one): a FIFO, socket or device would block or never end."""
    if not path.exists():
        raise InputError(path, "", None, "does not exist")
    if path.is_dir():  # a folder whose name ends like an input file, inside a folder of inputs
        raise InputError(path, "", None, "is a folder; give a file")
    if not path.is_file():
        raise InputError(path, "", None, "is not a regular file (a FIFO, socket or device); give a file")
    return path


def loads_json(text: str, path: Path, where: str | None = None):
    """`json.loads`, every failure one InputError: bad syntax (at `where`, or the line the parser names), a nesting
    deeper than Python's recursion limit, a number with more digits than Python converts (4,300)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(path, where or f"line {exc.lineno}", None, f"is not valid JSON ({exc.msg})") from None
    except RecursionError:
        raise InputError(path, where or "", None, "is JSON nested too deeply to read (deeper than about "
                                                  "1,000 levels)") from None
    except ValueError:  # int('9' * 5000): Python refuses integers of more than sys.get_int_max_str_digits() digits
        raise InputError(path, where or "", None, "holds a number with more than 4,300 digits") from None
    if _ESCAPED_SURROGATE.search(text):  # only a \uD800-\uDFFF escape makes one: decoded UTF-8 bytes never do
        check_encodable(value, path, where or "")
    return value


# A JSON escape of a UTF-16 surrogate. A pair (\ud83d\ude00) decodes to one character; a lone one stays a surrogate,
# which no UTF-8 writer (Parquet, the terminal, the report) can encode: refused at load time, not mid-run.
_ESCAPED_SURROGATE = re.compile(r"\\[uU][dD][89a-fA-F]")


def check_encodable(value, path: Path, where: str) -> None:
    """Every string (keys included) of a parsed JSON value encodes as UTF-8; otherwise one InputError naming the
    field by its path in the record (`text`, `conversation.session_1[3].text`). Walked without recursion."""
    stack: list[tuple[str, object]] = [("", value)]
    while stack:
        at, v = stack.pop()
        if isinstance(v, str):
            items: list[tuple[str, object]] = []
            _encodable(v, path, where, at)
        elif isinstance(v, dict):
            for k in v:  # a bad key is named by the record it sits in
                _encodable(k, path, where, f"{at} (a key)".lstrip())
            items = [(f"{at}.{k}".lstrip("."), child) for k, child in v.items()]
        elif isinstance(v, list):
            items = [(f"{at}[{i}]", child) for i, child in enumerate(v)]
        else:
            items = []
        stack.extend(reversed(items))


def _encodable(s: str, path: Path, where: str, at: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = s[exc.start]
        raise InputError(path, where, at or None, f"holds a lone surrogate escape (\\u{ord(bad):04x}) at character "
                                                  f"{exc.start}, which is not UTF-8 text; fix or drop it") from None


def check_metadata(path: Path, where: str, metadata: object) -> None:
    """An object (or None) nested at most MAX_METADATA_DEPTH levels (walked without recursion)."""
    if metadata is None:
        return
    if not isinstance(metadata, dict):
        raise InputError(path, where, "metadata", f"must be an object, got {type(metadata).__name__}")
    stack = [(metadata, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_METADATA_DEPTH:
            raise InputError(path, where, "metadata", f"is nested more than {MAX_METADATA_DEPTH} levels deep")
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))


def iter_records(path: Path) -> Iterator[tuple[str, dict]]:
    """Yield (where, record) from a JSONL or Parquet file. `where` is 'line N' (1-based) or 'row N' (0-based)."""
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json", ".ndjson"):
        with open(regular_file(path), "rb") as fh:  # read-only: the memory bank is never opened for writing
            for n, raw in enumerate(fh, start=1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise InputError(path, f"line {n}", None, f"is not UTF-8 text (byte {exc.start})") from None
                if not line.strip():
                    continue
                rec = loads_json(line, path, f"line {n}")
                if not isinstance(rec, dict):
                    raise InputError(path, f"line {n}", None, f"must be a JSON object, got {type(rec).__name__}")
                yield f"line {n}", rec
    elif suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(regular_file(path))
        except Exception as exc:  # pyarrow raises several types for a corrupt file
            raise InputError(path, "", None, f"cannot be read as Parquet ({exc})") from None
        for n, rec in enumerate(table.to_pylist()):
            yield f"row {n}", rec
    else:
        raise InputError(path, "", None, f"has unsupported extension {suffix!r}; allowed .jsonl, .json, .parquet")


def text_field(path: Path, where: str, rec: dict, name: str, required: bool = True, numbers: bool = False,
               limit: int | None = MAX_FIELD_CHARS) -> str | None:
    """A non-empty string field (integers accepted and turned into text where `numbers`) of at most `limit`
    characters (None: the caller checks the length)."""
    value = rec.get(name)
    if value is None:
        if required:
            raise InputError(path, where, name, "is missing (required)")
        return None
    if numbers and isinstance(value, float) and not isinstance(value, bool):
        # 1 and 1.0 are one id; NaN, infinities and fractions are no id at all
        if not value.is_integer():
            raise InputError(path, where, name, f"must be a string or an integer, got {value!r}")
        value = int(value)
    if numbers and isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str):
        raise InputError(path, where, name, f"must be a string, got {type(value).__name__}")
    if required and not value.strip():
        raise InputError(path, where, name, "is empty")
    check_length(path, where, name, value, limit)
    return value


def check_length(path: Path, where: str, name: str, value: str, limit: int | None, flag: str = "") -> None:
    if limit is not None and len(value) > limit:
        raise InputError(path, where, name, f"has {len(value):,} characters; the limit is {limit:,}{flag}")


def parse_memory(path: Path, where: str, rec: dict, max_chars: int = MAX_MEMORY_CHARS) -> Memory:
    metadata = rec.get("metadata")
    if isinstance(metadata, str):  # Parquet exports often carry metadata as a JSON string
        try:
            metadata = json.loads(metadata)
        except RecursionError:
            raise InputError(path, where, "metadata", f"is nested more than {MAX_METADATA_DEPTH} levels deep") from None
        except ValueError:
            raise InputError(path, where, "metadata", "is a string but not a JSON object") from None
    check_metadata(path, where, metadata)
    text = text_field(path, where, rec, "text", limit=None)
    check_length(path, where, "text", text, max_chars, " (--max-memory-chars)")  # type: ignore[arg-type]
    return Memory(
        memory_id=text_field(path, where, rec, "memory_id", numbers=True),  # type: ignore[arg-type]
        text=text,  # type: ignore[arg-type]
        timestamp=text_field(path, where, rec, "timestamp", required=False, numbers=True),
        speaker=text_field(path, where, rec, "speaker", required=False),
        metadata=metadata,
    )


def parse_query(path: Path, where: str, rec: dict, default_pool: str | None) -> Query:
    pool_id = text_field(path, where, rec, "pool_id", required=default_pool is None, numbers=True) or default_pool
    answer = text_field(path, where, rec, "answer", numbers=True, limit=MAX_OPTION_CHARS)
    options_raw = rec.get("options")
    options: tuple[str, ...] = ()
    if options_raw is not None:
        if not isinstance(options_raw, (list, tuple)) or not all(isinstance(o, str) for o in options_raw):
            raise InputError(path, where, "options", "must be a list of strings")
        options = tuple(options_raw)
        if len(options) < 2:
            raise InputError(path, where, "options", f"needs at least 2 options, got {len(options)}")
        if len(options) > MAX_OPTIONS:  # the reader's cost grows with the square of the options
            raise InputError(path, where, "options", f"has {len(options):,} options; the limit is {MAX_OPTIONS}")
        for i, o in enumerate(options):
            check_length(path, where, f"options[{i}]", o, MAX_OPTION_CHARS)
        if len(set(options)) != len(options):
            raise InputError(path, where, "options", "has duplicate options")
        normal = [normalize_answer(o) for o in options]
        if len(set(normal)) != len(normal):  # scoring compares normalised text: the query could never be answered
            raise InputError(path, where, "options", "has options that are equal after normalisation "
                                                     "(case, punctuation, articles)")
        if gold_index(options, answer) < 0:  # type: ignore[arg-type]
            raise InputError(path, where, "options", f"does not include the answer {answer!r}")
    evidence = rec.get("evidence") or ()
    if not isinstance(evidence, (list, tuple)):
        raise InputError(path, where, "evidence", "must be a list of memory ids")
    return Query(
        query_id=text_field(path, where, rec, "query_id", numbers=True),  # type: ignore[arg-type]
        pool_id=pool_id,  # type: ignore[arg-type]
        question=text_field(path, where, rec, "question", limit=MAX_QUESTION_CHARS),  # type: ignore[arg-type]
        answer=answer,  # type: ignore[arg-type]
        options=options,
        category=text_field(path, where, rec, "category", required=False, numbers=True),
        evidence=tuple(str(e) for e in evidence),
    )


def warn_unknown(path: Path, rec: dict, known: set[str], seen: set[str]) -> None:
    extra = set(rec) - known - seen
    if extra:
        seen |= extra
        log.warning("%s: ignoring field(s) %s (not used by the audit)", path, sorted(extra))


class PoolGrouper:
    """Memories grouped into pools in input order, each (pool, memory id) once; a pool's source is its first file.

    `id_field` and `owner` word the repeat error as the input format names them ("id" / "for user" in mem0 exports).
    """

    def __init__(self, id_field: str = "memory_id", owner: str = "in pool"):
        self.id_field, self.owner = id_field, owner
        self._memories: dict[str, list[Memory]] = {}
        self._sources: dict[str, str] = {}
        self._first: dict[tuple[str, str], str] = {}

    def add(self, path: Path, where: str, pool_id: str, memory: Memory) -> None:
        key = (pool_id, memory.memory_id)
        if key in self._first:
            raise InputError(path, where, self.id_field,
                             f"{memory.memory_id!r} repeats {self.owner} {pool_id!r} (first at {self._first[key]})")
        self._first[key] = f"{path.name} {where}"
        self._memories.setdefault(pool_id, []).append(memory)
        self._sources.setdefault(pool_id, str(path))

    def pools(self) -> dict[str, Pool]:
        return {pid: Pool(pid, tuple(mems), self._sources[pid]) for pid, mems in self._memories.items()}
