"""A mini-window: the tuples of one stream in one mini-partition-group, kept in blocks.

Paper 003, IV-D: tuples are kept in arrival order in fixed-size blocks; the block
is the unit of expiry.  A block is dropped once its newest tuple can no longer
join any on-time tuple, i.e. its largest ts is below watermark - window (BiStream,
Theorem 1), in integer microseconds (protocol.eventtime): a tuple exactly `window`
before the watermark stays, as the join test |r.ts - s.ts| <= window wants.  Rows live in one contiguous structured array (block b is rows
[start + b*B, start + (b+1)*B)) so the join kernel sees the whole mini-window
without copying; the last block is the head block that fills up with fresh tuples.
Expiry of the oldest blocks (the usual case: tuples arrive about in ts order)
only moves `start`; rows are copied when the tail is full, into storage of the
live rows plus a quarter (`SLACK`), when the expired rows in front outgrow that
quarter, and when out-of-order expiry drops blocks from the middle.
"""
from __future__ import annotations

import numpy as np

from protocol.arrays import records, take_rows


#: new storage holds the live rows plus 1/SLACK of them more, and expired rows in front are given back once
#: they outgrow that: rows are copied about once per live rows / SLACK appended or expired, and the storage
#: stays within about 1 + 2/SLACK of the live rows (issue 6: window state at most 2x the raw tuple bytes)
SLACK = 4


class MiniWindow:
    def __init__(self, dtype: np.dtype, block_size: int):
        self.dtype, self.block_size = dtype, block_size
        self._store(np.empty(0, dtype=dtype), 0)
        self.block_max = np.empty(0, dtype=np.int64)  #: newest ts of each block

    def __len__(self) -> int:
        return self._end - self._start

    def _store(self, rows: np.ndarray, live: int) -> None:
        """New storage whose first `live` rows are the window; kept as tuples and as records (two views)."""
        self._rows, self._records = rows, records(rows)
        self._start, self._end = 0, live

    @property
    def rows(self) -> np.ndarray:
        """The stored tuples, oldest block first (a view)."""
        return self._rows[self._start: self._end]

    @property
    def records(self) -> np.ndarray:
        """The same rows as opaque records (a view; protocol.arrays.records)."""
        return self._records[self._start: self._end]

    @property
    def blocks(self) -> int:
        return len(self.block_max)

    @property
    def nbytes(self) -> int:
        """Allocated bytes: the rows' storage (with its growth slack) and the per-block newest ts."""
        return self._rows.nbytes + self.block_max.nbytes

    def append(self, new: np.ndarray) -> None:
        """Add fresh tuples at the head; when the storage is full, the live rows and the fresh ones move into
        new storage with room for a quarter more (`SLACK`)."""
        k = len(new)
        if k == 0:
            return
        live = len(self)
        if self._end + k > len(self._rows):
            grown = np.empty(live + k + (live + k) // SLACK, dtype=self.dtype)
            records(grown)[:live] = self.records
            self._store(grown, live)
        self._records[self._end: self._end + k] = records(new)
        self._end += k
        self._refresh_block_max(live // self.block_size)  # the head block may have been partial

    def _refresh_block_max(self, first_block: int) -> None:
        ts = self.rows["ts"][first_block * self.block_size:]
        tail = np.maximum.reduceat(ts, np.arange(0, len(ts), self.block_size)) if len(ts) else ts
        self.block_max = np.concatenate([self.block_max[:first_block], tail])

    def expire(self, threshold: int) -> int:
        """Drop every block whose newest ts is below `threshold`; returns the tuples dropped."""
        dead = self.block_max < threshold
        if not dead.any():
            return 0
        before = len(self)
        oldest = len(dead) if dead.all() else int(np.argmin(dead))  # leading dead blocks
        if not dead[oldest:].any():
            self._start = min(self._start + oldest * self.block_size, self._end)
            if self._start * SLACK > len(self._rows):  # the dead rows in front outgrew the slack: give them back
                kept = np.empty(len(self), dtype=self.dtype)
                records(kept)[:] = self.records
                self._store(kept, len(kept))
        else:  # out-of-order input: blocks die in the middle too
            kept = take_rows(self.rows, np.repeat(~dead, self.block_size)[:before])
            self._store(kept, len(kept))
        # all kept blocks but the last are full, so block boundaries are unchanged
        self.block_max = self.block_max[~dead]
        return before - len(self)

    def take(self, mask: np.ndarray) -> np.ndarray:
        """Remove and return the rows where `mask` is true (used to split or hand over a group)."""
        rows = self.rows
        out, kept = take_rows(rows, mask), take_rows(rows, ~mask)
        self._store(kept, len(kept))
        self.block_max = self.block_max[:0]
        self._refresh_block_max(0)
        return out
