"""A mini-window: the tuples of one stream in one mini-partition-group, kept in blocks.

Paper 003, IV-D: tuples are kept in arrival order in fixed-size blocks; the block
is the unit of expiry.  A block is dropped once its newest tuple can no longer
join any on-time tuple, i.e. its largest ts is below watermark - window (BiStream,
Theorem 1).  Rows live in one contiguous structured array (block b is rows
[b*B, (b+1)*B)) so the join kernel sees the whole mini-window without copying;
the last block is the head block that fills up with fresh tuples.
"""
from __future__ import annotations

import numpy as np


class MiniWindow:
    def __init__(self, dtype: np.dtype, block_size: int):
        self.block_size = block_size
        self._rows = np.empty(0, dtype=dtype)
        self._n = 0
        self.block_max = np.empty(0, dtype=np.float64)  #: newest ts of each block

    def __len__(self) -> int:
        return self._n

    @property
    def rows(self) -> np.ndarray:
        """The stored tuples, oldest block first (a view)."""
        return self._rows[: self._n]

    @property
    def blocks(self) -> int:
        return len(self.block_max)

    @property
    def nbytes(self) -> int:
        """Allocated bytes: the rows' storage (with its growth slack) and the per-block newest ts."""
        return self._rows.nbytes + self.block_max.nbytes

    def append(self, new: np.ndarray) -> None:
        """Add fresh tuples at the head; grows the storage geometrically."""
        k = len(new)
        if k == 0:
            return
        need = self._n + k
        if need > len(self._rows):
            grown = np.empty(max(need, 2 * len(self._rows), self.block_size), dtype=self._rows.dtype)
            grown[: self._n] = self._rows[: self._n]
            self._rows = grown
        self._rows[self._n: need] = new
        first = self._n // self.block_size  # the head block may have been partial
        self._n = need
        self._refresh_block_max(first)

    def _refresh_block_max(self, first_block: int) -> None:
        ts = self._rows["ts"][first_block * self.block_size: self._n]
        tail = np.maximum.reduceat(ts, np.arange(0, len(ts), self.block_size)) if len(ts) else ts
        self.block_max = np.concatenate([self.block_max[:first_block], tail])

    def expire(self, threshold: float) -> int:
        """Drop every block whose newest ts is below `threshold`; returns the tuples dropped."""
        dead = self.block_max < threshold
        if not dead.any():
            return 0
        keep_rows = np.repeat(~dead, self.block_size)[: self._n]
        kept = self._rows[: self._n][keep_rows]
        dropped = self._n - len(kept)
        # all kept blocks but the last are full, so block boundaries are unchanged
        self.block_max = self.block_max[~dead]
        self._rows, self._n = kept, len(kept)
        return dropped

    def take(self, mask: np.ndarray) -> np.ndarray:
        """Remove and return the rows where `mask` is true (used to split or hand over a group)."""
        rows = self.rows
        out, kept = rows[mask], rows[~mask]
        self._rows, self._n = kept, len(kept)
        self.block_max = self.block_max[:0]
        self._refresh_block_max(0)
        return out
