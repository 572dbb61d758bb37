"""Re-retrieval over a pool with a few records added, without re-indexing the pool.

The benchmark re-runs retrieval (K=5) for every candidate fault set, on its own in-memory copy of the pool plus the
faults. `pipeline.retrieval.frozen.Retriever` would rebuild BM25 and re-embed the whole pool (~600 LoCoMo turns, ~10 s
of MiniLM on 2 cores) for each copy; `PoolIndex` keeps each pool's BM25 index (`BM25.extended` adds the records to a
copy) and embeddings, and only tokenises and embeds the added records. The scores are `Retriever`'s (the same `BM25`
over the extended pool, MiniLM cosine, reciprocal-rank fusion, ties in pool order, added records after
the pool), so the frozen context equals what `Retriever` would freeze on the extended pool (checked in the tests).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from pipeline.audit.settings import check_setting
from pipeline.io.records import Memory, Pool, Query
from pipeline.retrieval.frozen import (
    BM25,
    DEFAULT_TOP_K,
    FrozenContext,
    MiniLMEncoder,
    fuse_and_freeze,
    retrieval_mode,
    use_dense,
)


@dataclass
class _PoolStats:
    bm25: BM25
    emb: np.ndarray | None


class PoolIndex:
    """BM25 index and MiniLM embeddings of each pool, computed once; retrieval over pool + extra records.

    dense: "auto" (MiniLM when installed), "on" or "off", as for `Retriever`.
    """

    def __init__(self, pools: dict[str, Pool], top_k: int = DEFAULT_TOP_K, dense: str = "auto"):
        check_setting("top_k", top_k, "retrieval")
        self.pools, self.top_k = pools, top_k
        self.encoder = MiniLMEncoder() if use_dense(dense) else None
        self.mode = retrieval_mode(self.encoder is not None)
        self._stats: dict[str, _PoolStats] = {}

    def stats(self, pool_id: str) -> _PoolStats:
        if pool_id not in self._stats:
            texts = [m.text for m in self.pools[pool_id].memories]
            emb = self.encoder.encode(texts) if self.encoder is not None else None
            self._stats[pool_id] = _PoolStats(BM25(texts), emb)
        return self._stats[pool_id]

    def idf(self, pool_id: str) -> dict[str, float]:
        """BM25 idf of every term of the (clean) pool."""
        return self.stats(pool_id).bm25.idf

    def embed(self, texts: Sequence[str]) -> np.ndarray | None:
        return self.encoder.encode(texts) if self.encoder is not None else None

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
        bm25_scores = st.bm25.extended([m.text for m in extra]).scores(query.question)
        dense_scores = None
        if self.encoder is not None:
            if q_emb is None:
                q_emb = self.encoder.encode([query.question])[0]
            if extra and extra_emb is None:
                extra_emb = self.embed([m.text for m in extra])
            emb = st.emb if not extra else np.concatenate([st.emb, extra_emb])
            dense_scores = emb @ q_emb
        return fuse_and_freeze(query, (*memories, *extra), bm25_scores, dense_scores, self.top_k)
