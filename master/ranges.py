"""Key-range partitioning for band and inequality joins (BiStream 3.2.2, ContRand; Squall's range partitioning).

Hash partitioning scatters neighbouring keys, so a band or inequality predicate
would have to probe every partition.  Here partition p holds the keys in
[bounds[p-1], bounds[p]), with bounds taken from the quantiles of the first
keys seen so the partitions start with about equal load (they are then moved
between slaves like any partition-group).  Every S tuple goes to the partition
of its key (its home, where its pairs are produced); every R tuple is copied to
each partition that may hold partners: those covering [key + low, key + high].
"""
from __future__ import annotations

import numpy as np


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

    def copies(self, keys: np.ndarray, low: int | None, high: int | None) -> tuple[np.ndarray, np.ndarray]:
        """(row index, partition) of every copy: each row to all partitions covering [key + low, key + high]."""
        first = np.zeros(len(keys), np.int64) if low is None else self.home(shifted(keys, low))
        last = np.full(len(keys), self.partitions - 1, np.int64) if high is None else self.home(shifted(keys, high))
        n = last - first + 1
        rows = np.repeat(np.arange(len(keys)), n)
        starts = np.cumsum(n) - n
        return rows, first[rows] + np.arange(len(rows)) - np.repeat(starts, n)
