"""Key-range partitioning for band and inequality joins (BiStream 3.2.2, ContRand; Squall's range partitioning).

Hash partitioning scatters neighbouring keys, so a band or inequality predicate
would have to probe every partition.  Here partition p holds the keys in
[bounds[p-1], bounds[p]), with bounds taken from the quantiles of the first
keys seen so the partitions start with about equal load (they are then moved
between slaves like any partition-group).  Every S tuple goes to the partition
of its key (its home, where its pairs are produced); every R tuple is copied to
each partition that may hold partners: those covering [key + low, key + high].
A full join copies both sides (S to those covering [key - high, key - low]), each
also to its own partition (`copy_offsets`); the slaves tell a tuple's home from
its guest copies by the span of keys each partition holds (`spans`, sent in
every batch's group table for both streams).
"""

from __future__ import annotations

import numpy as np

from protocol.messages import ALL_KEYS
from protocol.tuples import STREAM_R


_I64 = np.iinfo(np.int64)


def shifted(keys: np.ndarray, d: int) -> np.ndarray:
    """keys + d, saturating at the int64 limits instead of wrapping around (a key near the top plus a band
    would land in the lowest range and miss its partners); no key lies beyond a limit, so that is exact."""
    out = keys + np.int64(d)
    if d > 0:
        out[keys > _I64.max - d] = _I64.max
    elif d < 0:
        out[keys < _I64.min - d] = _I64.min
    return out


def copy_offsets(stream: int, low: int | None, high: int | None, home: bool) -> tuple[int | None, int | None]:
    """The key offsets (lo, hi) of the ranges a copied tuple of `stream` goes to, those covering [key + lo, key +
    hi] (None: open), for a predicate whose partners lie at s.key - r.key in [low, high]
    (protocol.predicates.key_distance): R's partners at key + [low, high], S's at key - [high, low].  With `home`
    (a full join, both sides copied) the tuple's own range too, where its row alone is decided: a less join's
    partners (low = 1) may all lie in the ranges above the tuple's."""
    lo, hi = (low, high) if stream == STREAM_R else ((None if high is None else -high), (None if low is None else -low))
    if home:
        lo, hi = (None if lo is None else min(lo, 0)), (None if hi is None else max(hi, 0))
    return lo, hi


def every_key(partitions: np.ndarray) -> np.ndarray:
    """The spans (R's first, last key, S's first, last key) of each of `partitions` with hash partitions: every
    key is at home in its group (no guest copies)."""
    return np.tile(np.array(ALL_KEYS * 2, np.int64), (len(partitions), 1))


class KeyRanges:
    def __init__(self, bounds):
        self.bounds = np.asarray(bounds, dtype=np.int64)  #: partitions - 1 split points, non-decreasing
        self.partitions = len(self.bounds) + 1

    @classmethod
    def from_sample(cls, keys: np.ndarray, partitions: int) -> "KeyRanges":
        """Split points at the quantiles of `keys`, a non-empty sample (repeated points leave empty partitions:
        a hot key stays whole)."""
        q = np.arange(1, partitions) / partitions
        return cls(np.quantile(keys, q, method="inverted_cdf").astype(np.int64))

    def home(self, keys: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.bounds, keys, side="right").astype(np.int64)

    def spans(self, partitions: np.ndarray) -> np.ndarray:
        """(first key, last key) of each of `partitions`: exactly the keys whose `home` it is (first > last where
        none is: a split point repeated)."""
        p = np.asarray(partitions, np.int64)
        first = np.concatenate([[_I64.min], self.bounds])[p]
        after = np.concatenate([self.bounds, [_I64.max]])[p]  # the next range's first key (the last: none)
        last = np.where(p == self.partitions - 1, _I64.max, after - (after != _I64.min))
        return np.column_stack([np.where(after == _I64.min, _I64.max, first), last]).astype(np.int64)

    def copies(self, keys: np.ndarray, low: int | None, high: int | None) -> tuple[np.ndarray, np.ndarray]:
        """(row index, partition) of every copy: each row to all partitions covering [key + low, key + high]."""
        first = np.zeros(len(keys), np.int64) if low is None else self.home(shifted(keys, low))
        last = np.full(len(keys), self.partitions - 1, np.int64) if high is None else self.home(shifted(keys, high))
        n = last - first + 1
        rows = np.repeat(np.arange(len(keys)), n)
        starts = np.cumsum(n) - n
        return rows, first[rows] + np.arange(len(rows)) - np.repeat(starts, n)
