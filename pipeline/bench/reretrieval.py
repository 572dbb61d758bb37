"""Re-retrieval over a pool with a few records added, without re-indexing the pool.

The benchmark re-runs retrieval (K=5) for every candidate fault set, on its own in-memory copy of the pool plus the
faults. `pipeline.retrieval.Retriever` would rebuild BM25 and re-embed the whole pool (~600 LoCoMo turns, ~10 s of
MiniLM on 2 cores) for each copy; `PoolIndex` keeps the pool's term counts, document frequencies and embeddings, and
only tokenises and embeds the added records. The scores are the same formulas as `Retriever` (Okapi BM25 with
k1=1.5, b=0.75 over the extended pool, MiniLM cosine, reciprocal-rank fusion, ties in pool order, added records after
the pool), so the frozen context equals what `Retriever` would freeze on the extended pool (checked in the tests).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from pipeline.errors import ConfigError
from pipeline.io.records import Memory, Pool, Query
from pipeline.retrieval import BM25_DECIMALS, FrozenContext, MiniLMEncoder, fuse_and_freeze
from pipeline.text import tokens

K1, B = 1.5, 0.75  # pipeline.retrieval.BM25 defaults


def encode_sorted(encoder: MiniLMEncoder, texts: Sequence[str]) -> np.ndarray:
    """Embed texts in batches of similar length (much less padding than input order), returned in input order."""
    if not texts:
        return np.zeros((0, 384), dtype=np.float32)
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    emb = encoder.encode([texts[i] for i in order])
    out = np.empty_like(emb)
    out[order] = emb
    return out


@dataclass
class _PoolStats:
    tfs: list[Counter]
    lengths: np.ndarray
    df: Counter
    emb: np.ndarray | None


class PoolIndex:
    """BM25 statistics and MiniLM embeddings of each pool, computed once; retrieval over pool + extra records.

    dense: "auto" (MiniLM when installed), "on" or "off", as for `Retriever`.
    """

    def __init__(self, pools: dict[str, Pool], top_k: int = 5, dense: str = "auto"):
        if dense not in ("auto", "on", "off"):
            raise ConfigError(f"retrieval: dense={dense!r}; allowed 'auto', 'on', 'off'")
        if top_k < 1:
            raise ConfigError(f"retrieval: top_k={top_k}; must be >= 1")
        self.pools, self.top_k = pools, top_k
        use_dense = dense == "on" or (dense == "auto" and MiniLMEncoder.available())
        self.encoder = MiniLMEncoder() if use_dense else None
        self.mode = "bm25+minilm" if self.encoder else "bm25"
        self._stats: dict[str, _PoolStats] = {}

    def stats(self, pool_id: str) -> _PoolStats:
        if pool_id not in self._stats:
            texts = [m.text for m in self.pools[pool_id].memories]
            tfs = [Counter(tokens(t)) for t in texts]
            df: Counter = Counter()
            for tf in tfs:
                df.update(tf.keys())
            emb = encode_sorted(self.encoder, texts) if self.encoder is not None else None
            self._stats[pool_id] = _PoolStats(tfs, np.array([sum(tf.values()) for tf in tfs], dtype=float), df, emb)
        return self._stats[pool_id]

    def idf(self, pool_id: str) -> dict[str, float]:
        """BM25 idf of every term of the (clean) pool."""
        st = self.stats(pool_id)
        n = len(st.tfs)
        return {t: math.log(1 + (n - c + 0.5) / (c + 0.5)) for t, c in st.df.items()}

    def embed(self, texts: Sequence[str]) -> np.ndarray | None:
        return encode_sorted(self.encoder, texts) if self.encoder is not None else None

    def _bm25(self, st: _PoolStats, extra_tfs: list[Counter], question: str) -> np.ndarray:
        tfs = st.tfs + extra_tfs
        lengths = np.concatenate([st.lengths, np.array([sum(tf.values()) for tf in extra_tfs], dtype=float)])
        n = len(tfs)
        df = st.df.copy()
        for tf in extra_tfs:
            df.update(tf.keys())
        q = [t for t in set(tokens(question)) if t in df]
        idf = {t: math.log(1 + (n - df[t] + 0.5) / (df[t] + 0.5)) for t in q}
        avg = float(lengths.mean()) if n else 0.0
        norm = K1 * (1 - B + B * lengths / max(avg, 1e-9))
        out = np.zeros(n)
        for i, tf in enumerate(tfs):
            s = 0.0
            for t in q:
                f = tf.get(t)
                if f:
                    s += idf[t] * f * (K1 + 1) / (f + norm[i])
            out[i] = s
        return np.round(out, BM25_DECIMALS)  # as pipeline.retrieval.BM25: equal scores tie whatever the sum order

    def freeze(
        self,
        query: Query,
        q_emb: np.ndarray | None = None,
        extra: Sequence[Memory] = (),
        extra_emb: np.ndarray | None = None,
    ) -> FrozenContext:
        """The top-K context of `query` over its pool plus `extra` records (appended after the pool).

        q_emb / extra_emb: MiniLM embeddings of the question and the extra texts (computed here when missing).
        """
        st = self.stats(query.pool_id)
        memories = self.pools[query.pool_id].memories
        bm25_scores = self._bm25(st, [Counter(tokens(m.text)) for m in extra], query.question)
        dense_scores = None
        if self.encoder is not None:
            if q_emb is None:
                q_emb = self.encoder.encode([query.question])[0]
            if extra and extra_emb is None:
                extra_emb = self.embed([m.text for m in extra])
            emb = st.emb if not extra else np.concatenate([st.emb, extra_emb])
            dense_scores = emb @ q_emb
        return fuse_and_freeze(query, (*memories, *extra), bm25_scores, dense_scores, self.top_k)
