"""A value table stored sparsely: only the coalitions a sampled plan evaluated, not a dense array of 2^K entries.

Sampled plans (permutation, adaptive) touch at most L*(K-1)+2 of the 2^K coalitions: at K=10, L=16 that is 146 of
1,024, and at K=20 146 of 1,048,576 (8 MiB dense per case in flight). `SparseTable` answers the same fancy indexing
as the dense float array the game functions take (`table[masks]`, any shape, `fill` where a coalition is absent,
`.size` = 2^K), so `pipeline.game.attribution`, `adaptive` and `clearance` run on either unchanged. Keys are kept
sorted, so a lookup is one `searchsorted`.
"""

from __future__ import annotations

import numpy as np


class SparseTable:
    """`size` = 2^K virtual entries, `fill` (NaN for values, False for outcomes) wherever nothing was stored."""

    def __init__(self, k: int, fill: float | bool = np.nan, dtype: type = np.float64):
        self.size = 1 << k
        self.fill = fill
        self.dtype = np.dtype(dtype)
        self.keys = np.zeros(0, dtype=np.int64)
        self.stored = np.zeros(0, dtype=self.dtype)

    def __getitem__(self, masks) -> np.ndarray:
        m = np.asarray(masks, dtype=np.int64)
        out = np.full(m.shape, self.fill, dtype=self.dtype)
        if len(self.keys):
            idx = np.minimum(np.searchsorted(self.keys, m), len(self.keys) - 1)
            found = self.keys[idx] == m
            out[found] = self.stored[idx[found]]
        return out[()] if m.ndim == 0 else out

    def __setitem__(self, masks, values) -> None:
        """Store `values` at `masks`; a mask already stored takes the new value (as a dense assignment would)."""
        m = np.asarray(masks, dtype=np.int64).ravel()
        v = np.broadcast_to(np.asarray(values, dtype=self.dtype), np.asarray(masks).shape).ravel()
        keys, first = np.unique(np.concatenate([m, self.keys]), return_index=True)  # first occurrence: the new one
        self.stored = np.concatenate([v, self.stored])[first]
        self.keys = keys

    @property
    def nbytes(self) -> int:
        return int(self.keys.nbytes + self.stored.nbytes)
