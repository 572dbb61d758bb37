"""LoCoMo (Maharana et al., ACL 2024) as memory pools and queries.

Each dialogue turn becomes a memory whose text is prefixed with its session date and speaker (an image's BLIP caption is
kept in the text). Each QA item becomes a query: categories 1-4 read `answer`, category 5 (adversarial) reads
`adversarial_answer`. LoCoMo has open answers; for multiple-choice scoring each query gets type-consistent options:
the gold answer plus distractors drawn from other answers of the same category in the same conversation, in an order
fixed by the seed.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from pipeline.core.errors import InputError
from pipeline.core.text import normalize_answer
from pipeline.io.records import (
    MAX_FIELD_CHARS,
    MAX_MEMORY_CHARS,
    MAX_OPTION_CHARS,
    MAX_QUESTION_CHARS,
    Memory,
    Pool,
    Query,
    check_length,
    loads_json,
    regular_file,
)

_SESSION = re.compile(r"^session_(\d+)$")


def turn_text(date: str, speaker: str, text: str, caption: str | None) -> str:
    body = text.strip()
    if caption:
        body = f"{body} [shares a photo: {caption.strip()}]".strip()
    return f"[{date}] {speaker}: {body}"


def pick_distractors(gold: str, candidates: list[str], n: int, rng: np.random.Generator) -> list[str]:
    """Up to n distinct candidates whose normalised text differs from the gold answer's and from each other's."""
    seen = {normalize_answer(gold)}
    unique: list[str] = []
    for c in candidates:
        key = normalize_answer(c)
        if key and key not in seen:
            seen.add(key)
            unique.append(c)
    if len(unique) <= n:
        return unique
    idx = rng.choice(len(unique), size=n, replace=False)
    return [unique[i] for i in sorted(idx)]


def _answer(qa: dict) -> str | None:
    value = qa.get("adversarial_answer") if qa.get("category") == 5 else qa.get("answer")
    return None if value is None else str(value)


def load_locomo(
    path: str | Path, n_options: int = 4, seed: int = 0, conversations: list[str] | None = None,
    max_chars: int = MAX_MEMORY_CHARS,
) -> tuple[dict[str, Pool], list[Query]]:
    """Pools keyed by LoCoMo sample_id, and queries (query_id = '<sample_id>:q<index>').

    n_options: options per query (gold + n_options-1 distractors); 0 keeps open answers.
    conversations: sample_ids to keep (all when None).
    max_chars: the longest turn text accepted (with its date, speaker and caption); ids, questions and answers have
    the limits of `pipeline.io.records`.
    """
    path = Path(path)
    if path.is_dir():
        raise InputError(path, "", None, "is a folder; give the LoCoMo json file (e.g. locomo10.json)")
    try:
        with open(regular_file(path), "rb") as fh:
            text = fh.read().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(path, f"byte {exc.start}", None, "is not UTF-8 text") from None
    data = loads_json(text, path)
    if not isinstance(data, list):
        raise InputError(path, "", None, "must be a JSON list of LoCoMo conversations")
    if not data:
        raise InputError(path, "", None, "holds no conversations")
    _check_types(path, data)
    pools: dict[str, Pool] = {}
    queries: list[Query] = []
    for ci, conv in enumerate(data):
        where = f"conversation {ci}"
        sid = str(conv["sample_id"])
        if conversations is not None and sid not in conversations:
            continue
        dialogue = conv["conversation"]
        memories: list[Memory] = []
        first: dict[str, str] = {}  # dia_id -> where it first stood: one memory id is one position in a context
        sessions = sorted((int(m.group(1)), k) for k in dialogue if (m := _SESSION.match(k)))
        for num, key in sessions:
            date = str(dialogue.get(f"{key}_date_time", f"session {num}"))
            for ti, turn in enumerate(dialogue[key]):
                for f in ("dia_id", "speaker", "text"):
                    if f not in turn:
                        raise InputError(path, f"{where} {key} turn {ti}", f, "is missing")
                if turn["dia_id"] in first:
                    raise InputError(path, f"{where} {key} turn {ti}", "dia_id",
                                     f"{turn['dia_id']!r} repeats in conversation {sid!r} (first at "
                                     f"{first[turn['dia_id']]}); each turn needs its own dia_id")
                first[turn["dia_id"]] = f"{key} turn {ti}"
                text = turn_text(date, turn["speaker"], turn["text"], turn.get("blip_caption"))
                check_length(path, f"{where} {key} turn {ti}", "text", text, max_chars, " (--max-memory-chars)")
                memories.append(Memory(str(turn["dia_id"]), text, date, turn["speaker"], {"session": num}))
        if not memories:
            raise InputError(path, where, "conversation", "holds no turns (no non-empty session_N list); "
                                                          "give at least one session with turns")
        pools[sid] = Pool(sid, tuple(memories), f"{path}#{sid}")
        by_category: dict[int, list[str]] = {}
        for qa in conv["qa"]:
            ans = _answer(qa)
            if ans is not None:
                by_category.setdefault(qa.get("category"), []).append(ans)
        rng = np.random.default_rng([seed, ci])
        for qi, qa in enumerate(conv["qa"]):
            ans = _answer(qa)
            if ans is None or not str(qa.get("question", "")).strip():
                continue  # LoCoMo has a few QA items without an answer; they cannot be scored
            check_length(path, f"{where} qa {qi}", "question", str(qa["question"]), MAX_QUESTION_CHARS)
            check_length(path, f"{where} qa {qi}", "answer", ans, MAX_OPTION_CHARS)
            options: tuple[str, ...] = ()
            if n_options > 1:
                distractors = pick_distractors(ans, by_category.get(qa.get("category"), []), n_options - 1, rng)
                if distractors:
                    opts = [ans, *distractors]
                    order = rng.permutation(len(opts))
                    options = tuple(opts[i] for i in order)
            queries.append(
                Query(
                    query_id=f"{sid}:q{qi}",
                    pool_id=sid,
                    question=str(qa["question"]),
                    answer=ans,
                    options=options,
                    category=str(qa.get("category")),
                    evidence=tuple(str(e) for e in qa.get("evidence", [])),
                )
            )
    if conversations is not None:
        missing = sorted(set(conversations) - set(pools))
        if missing:
            raise InputError(path, "", "sample_id",
                             f"conversations {missing} not found; have {[c['sample_id'] for c in data]}")
    if not queries:
        raise InputError(path, "", "qa", "holds no answerable questions")
    return pools, queries


def _type_name(value) -> str:
    return type(value).__name__


def _check_types(path: Path, data: list) -> None:
    """LoCoMo's structure, checked before use: one line naming the conversation, session, turn or QA and the field."""
    first: dict[str, int] = {}  # sample_id -> its conversation index: a conversation given twice is audited once
    for ci, conv in enumerate(data):
        where = f"conversation {ci}"
        if not isinstance(conv, dict):
            raise InputError(path, where, None, f"must be an object, got {_type_name(conv)}")
        for key in ("sample_id", "conversation", "qa"):
            if key not in conv:
                raise InputError(path, where, key, "is missing")
        if not isinstance(conv["sample_id"], (str, int)) or isinstance(conv["sample_id"], bool):
            raise InputError(path, where, "sample_id", f"must be a string, got {_type_name(conv['sample_id'])}")
        check_length(path, where, "sample_id", str(conv["sample_id"]), MAX_FIELD_CHARS)
        sid = str(conv["sample_id"])
        if sid in first:
            raise InputError(path, where, "sample_id", f"{sid!r} repeats (first at conversation {first[sid]}); give "
                                                       "each conversation once")
        first[sid] = ci
        if not isinstance(conv["conversation"], dict):
            raise InputError(path, where, "conversation", f"must be an object, got {_type_name(conv['conversation'])}")
        if not isinstance(conv["qa"], list):
            raise InputError(path, where, "qa", f"must be a list, got {_type_name(conv['qa'])}")
        for key, turns in conv["conversation"].items():
            if not _SESSION.match(key):
                continue
            if not isinstance(turns, list):
                raise InputError(path, f"{where} {key}", None, f"must be a list of turns, got {_type_name(turns)}")
            for ti, turn in enumerate(turns):
                if not isinstance(turn, dict):
                    raise InputError(path, f"{where} {key} turn {ti}", None,
                                     f"must be an object, got {_type_name(turn)}")
                for f in ("dia_id", "speaker", "text"):
                    if f in turn and not isinstance(turn[f], str):
                        raise InputError(path, f"{where} {key} turn {ti}", f,
                                         f"must be a string, got {_type_name(turn[f])}")
                for f in ("dia_id", "speaker"):  # ids and names are copied into every row
                    check_length(path, f"{where} {key} turn {ti}", f, turn.get(f, ""), MAX_FIELD_CHARS)
        for qi, qa in enumerate(conv["qa"]):
            if not isinstance(qa, dict):
                raise InputError(path, f"{where} qa {qi}", None, f"must be an object, got {_type_name(qa)}")
            if "question" in qa and not isinstance(qa["question"], str):
                raise InputError(path, f"{where} qa {qi}", "question",
                                 f"must be a string, got {_type_name(qa['question'])}")
