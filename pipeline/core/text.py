"""Text helpers on the ground floor: tokenising and stemming for retrieval and the reader, answer normalisation,
exact match, gold-option lookup and token-F1 for scoring. io, retrieval, agents and bench import them from here; this
module imports nothing of the project."""

from __future__ import annotations

import re
import string
from collections import Counter
from typing import Sequence

_WORD = re.compile(r"[a-z0-9]+(?:'[a-z]+)?")
STOPWORDS = frozenset(
    "a an the and or but if of to in on at by for with from as is are was were be been being do does did done "
    "have has had i me my we our you your he him his she her it its they them their this that these those what which "
    "who whom whose when where why how there here than then so not no can could would should will shall may might "
    "must about into over under up down out off again just also very too s t".split()
)
# ANSI/OSC escapes, other C0/C1 controls and DEL: ids and text from input files are printed through `safe`, so a
# crafted id cannot move the cursor, retitle the terminal or hide output. Bidirectional controls (U+202E, the
# right-to-left override, and its kin, the "Trojan Source" characters of Boucher and Anderson, 2021) and the Unicode
# line/paragraph separators are shown as \\uNNNN: they reorder or break what is printed after them.
_BIDI = (0x061C, 0x200E, 0x200F, 0x2028, 0x2029, *range(0x202A, 0x202F), *range(0x2066, 0x206A))
_CONTROL = {c: f"\\x{c:02x}" for c in (*range(0x00, 0x20), *range(0x7F, 0xA0))} | {c: f"\\u{c:04x}" for c in _BIDI}
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def safe(text: object) -> str:
    """`text` with every control character shown as a \\xNN escape and every bidi control as \\uNNNN (printable to
    any terminal or log). Every console line that can hold text from an input or a run folder goes through it."""
    return str(text).translate(_CONTROL)


_BIDI_VISIBLE = {c: f"\\u{c:04x}" for c in _BIDI}


def no_bidi(text: str) -> str:
    """`text` with each bidi control and line/paragraph separator shown as \\uNNNN, for a page: a browser applies
    them as a terminal does, reordering the text around them (the report's counterpart of `safe`)."""
    return text.translate(_BIDI_VISIBLE)


def stem(word: str) -> str:
    """A light suffix stripper (plural, -ing, -ed) so 'plays' meets 'play' and 'climbing' meets 'climb'."""
    if len(word) > 5 and word.endswith("ing"):
        return word[:-3]
    if len(word) > 4 and word.endswith("ies"):
        return word[:-3] + "y"
    if len(word) > 4 and word.endswith("ed"):
        return word[:-2]
    if len(word) > 3 and word.endswith("s") and not word.endswith(("ss", "us")):
        return word[:-1]
    return word


def tokens(text: str) -> list[str]:
    """Lower-cased, lightly stemmed content words; possessive 's folded into the word."""
    return [stem(w.removesuffix("'s")) for w in _WORD.findall(text.lower()) if w not in STOPWORDS]


def normalize_answer(text: str) -> str:
    """Lower-case, drop punctuation and articles, collapse whitespace (the usual QA answer normalisation)."""
    text = str(text).lower().translate(_PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def token_f1(prediction: str, gold: str) -> float:
    pred, ref = normalize_answer(prediction).split(), normalize_answer(gold).split()
    if not pred or not ref:
        return float(pred == ref)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def exact_match(prediction: str, gold: str) -> bool:
    return normalize_answer(prediction) == normalize_answer(gold)


def gold_index(options: Sequence[str], gold: str) -> int:
    """Index of the gold answer among the options (exact text first, then normalised); -1 if absent."""
    for i, opt in enumerate(options):
        if opt == gold:
            return i
    norm = normalize_answer(gold)
    for i, opt in enumerate(options):
        if normalize_answer(opt) == norm:
            return i
    return -1
