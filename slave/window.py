"""A mini-window: the tuples of one stream in one mini-partition-group, kept in blocks.

Paper 003, IV-D: tuples are kept in arrival order in fixed-size blocks; the block
is the unit of expiry.  A block is dropped once its newest tuple can no longer
join any on-time tuple, i.e. its largest ts is below its stream's threshold (BiStream,
Theorem 1: watermark - upper for R, watermark + lower for S; slave.join.JoinModule.thresholds),
in integer microseconds (protocol.eventtime): a tuple exactly at the threshold stays, as the join
test lower <= s.ts - r.ts <= upper wants.  Rows live in one contiguous structured array (block b is rows
[start + b*B, start + (b+1)*B)) so the join kernel sees the whole mini-window
without copying; the last block is the head block that fills up with fresh tuples.
Expiry of the oldest blocks (the usual case: tuples arrive about in ts order)
only moves `start`; rows are copied when the tail is full, into storage of the
live rows plus a quarter (`SLACK`), when the expired rows in front outgrow that
quarter, and when out-of-order expiry drops blocks from the middle.

Beside the rows each window keeps a `matched` flag per tuple (uint8, the same positions; BiStream keeps no such
state, Flink's interval join keeps it per row for the same reason): outer, semi and anti joins set it
to MATCHED when a pair is produced, and `decide` emits each row still unmatched once its ts is below the
expiry threshold -- the moment no on-time tuple can match it any more -- and marks it DECIDED.  Only blocks
whose oldest ts is below the threshold are looked at (`block_min`): about one block per window when input
comes about in ts order.  A full join stores guest copies too (tuples copied into a range that is not their
key's, or into a hot key's sub-groups where they are not at home: slave.join): their flag is GUEST, which no
pair overwrites and `decide` never emits.
"""

from __future__ import annotations

import numpy as np

from protocol.arrays import records, take_rows


#: new storage holds the live rows plus 1/SLACK of them more, and expired rows in front are given back once
#: they outgrow that: rows are copied about once per live rows / SLACK appended or expired, and the storage
#: stays within about 1 + 2/SLACK of the live rows (window state at most 2x the raw tuple bytes)
SLACK = 4
#: values of a row's matched flag: no pair yet, in a pair, emitted without one (outer joins, `decide`), a guest
#: copy whose row alone is decided at its home range or sub-group, not here (a full join)
UNMATCHED, MATCHED, DECIDED, GUEST = 0, 1, 2, 3


class MiniWindow:
    def __init__(self, dtype: np.dtype, block_size: int):
        self.dtype, self.block_size = dtype, block_size
        self._store(np.empty(0, dtype=dtype), 0, np.empty(0, dtype=np.uint8))
        self.block_max = np.empty(0, dtype=np.int64)  #: newest ts of each block
        self.block_min = np.empty(0, dtype=np.int64)  #: oldest ts of each block

    def __len__(self) -> int:
        return self._end - self._start

    def _store(self, rows: np.ndarray, live: int, matched: np.ndarray) -> None:
        """New storage whose first `live` rows are the window, with their `matched` flags; kept as tuples and as
        records (two views)."""
        self._flags = np.zeros(len(rows), dtype=np.uint8)
        self._flags[:live] = matched
        self._rows, self._records = rows, records(rows)
        self._start, self._end = 0, live

    @property
    def rows(self) -> np.ndarray:
        """The stored tuples, oldest block first (a view)."""
        return self._rows[self._start : self._end]

    @property
    def matched(self) -> np.ndarray:
        """Each stored tuple's flag: MATCHED where it has been part of a pair, GUEST for a guest copy (a view: set
        it through this)."""
        return self._flags[self._start : self._end]

    @property
    def records(self) -> np.ndarray:
        """The same rows as opaque records (a view; protocol.arrays.records)."""
        return self._records[self._start : self._end]

    @property
    def blocks(self) -> int:
        return len(self.block_max)

    @property
    def nbytes(self) -> int:
        """Allocated bytes: the rows' storage (with its growth slack), their matched flags and the per-block
        newest and oldest ts."""
        return self._rows.nbytes + self._flags.nbytes + self.block_max.nbytes + self.block_min.nbytes

    def append(self, new: np.ndarray, matched: np.ndarray | None = None) -> None:
        """Add fresh tuples (and their matched flags, 0 if None) at the head; when the storage is full, the live
        rows and the fresh ones move into new storage with room for a quarter more (`SLACK`)."""
        k = len(new)
        if k == 0:
            return
        live = len(self)
        if self._end + k > len(self._rows):
            grown = np.empty(live + k + (live + k) // SLACK, dtype=self.dtype)
            records(grown)[:live] = self.records
            self._store(grown, live, self.matched)
        self._records[self._end : self._end + k] = records(new)
        self._flags[self._end : self._end + k] = 0 if matched is None else matched
        self._end += k
        self._refresh_block_max(live // self.block_size)  # the head block may have been partial

    def _refresh_block_max(self, first_block: int) -> None:
        ts = self.rows["ts"][first_block * self.block_size :]
        starts = np.arange(0, len(ts), self.block_size)
        high, low = (np.maximum.reduceat(ts, starts), np.minimum.reduceat(ts, starts)) if len(ts) else (ts, ts)
        self.block_max = np.concatenate([self.block_max[:first_block], high])
        self.block_min = np.concatenate([self.block_min[:first_block], low])

    def decide(self, threshold: int, unmatched: list) -> None:
        """Append to `unmatched` (one copied array) the rows still UNMATCHED whose ts is below `threshold`, and
        mark them DECIDED, so each is emitted once."""
        blocks = np.flatnonzero(self.block_min < threshold)
        if not len(blocks):
            return
        at = (blocks[:, None] * self.block_size + np.arange(self.block_size)).ravel()
        at = at[at < len(self)]
        at = at[(self.rows["ts"][at] < threshold) & (self.matched[at] == UNMATCHED)]
        if len(at):
            unmatched.append(take_rows(self.rows, at))
            self.matched[at] = DECIDED

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
                self._store(kept, len(kept), self.matched)
        else:  # out-of-order input: blocks die in the middle too
            keep = np.repeat(~dead, self.block_size)[:before]
            self._store(take_rows(self.rows, keep), int(keep.sum()), self.matched[keep])
        # all kept blocks but the last are full, so block boundaries are unchanged
        self.block_max, self.block_min = self.block_max[~dead], self.block_min[~dead]
        return before - len(self)

    def take(self, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Remove and return the rows where `mask` is true and their matched flags (used to split or hand over
        a group)."""
        rows, flags = self.rows, self.matched
        out = take_rows(rows, mask), flags[mask]
        self._store(take_rows(rows, ~mask), int(len(mask) - np.count_nonzero(mask)), flags[~mask])
        self.block_max, self.block_min = self.block_max[:0], self.block_min[:0]
        self._refresh_block_max(0)
        return out
