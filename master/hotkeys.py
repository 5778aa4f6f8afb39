"""Hot keys of the equi-join: a frequent-items sketch at the master and a grid of partition-groups per hot key.

Streaming HyperCube (paper 000) gives a heavy hitter a grid of workers instead
of one.  A key's pairs are R x S of that key, so here a hot key gets `g`
sub-groups: each S tuple of it is stored in one sub-group (chosen by a hash of
its id) and each R tuple is copied into all `g`; a pair is produced in the
sub-group of its S tuple, once.  The sub-groups are ordinary partition-groups
(ids after the hash partitions), created on the slave that owns the key's
partition by splitting the key out of it, and then moved to other slaves with
the balancing protocol.  Which keys are hot comes from a Misra-Gries summary
of bounded size, updated with whole batches.  For the joins that decide R rows
alone (left, semi, anti) the roles swap: R spread, S copied
(protocol.predicates.copied_stream), so each R tuple has one matched flag.
"""
from __future__ import annotations

import math

import numpy as np

from protocol.tuples import STREAM_R, mix64, partition_of


class FrequentKeys:
    """Misra-Gries summary with `capacity` counters: every key of frequency > n / capacity is kept, and its
    count is at most n / capacity below its true count (n: keys seen since the last reset)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.keys = np.empty(0, np.int64)
        self.counts = np.empty(0, np.int64)
        self.seen = 0

    def update(self, keys: np.ndarray) -> None:
        if len(keys) == 0:
            return
        self.seen += len(keys)
        uniq, counts = np.unique(keys, return_counts=True)
        allk = np.concatenate([self.keys, uniq])
        allc = np.concatenate([self.counts, counts])
        merged, inverse = np.unique(allk, return_inverse=True)
        total = np.bincount(inverse, weights=allc).astype(np.int64)
        if len(merged) > self.capacity:  # decrement by the (capacity+1)-th largest count: Misra-Gries
            cut = np.partition(total, len(total) - self.capacity - 1)[len(total) - self.capacity - 1]
            total = total - cut
        keep = total > 0
        self.keys, self.counts = merged[keep], total[keep]

    def heavy(self, share: float) -> list[tuple[int, float]]:
        """Keys whose (lower-bound) share of what was seen is at least `share`, hottest first."""
        if not self.seen:
            return []
        shares = self.counts / self.seen
        order = np.argsort(-shares)
        return [(int(self.keys[i]), float(shares[i])) for i in order if shares[i] >= share]

    def share(self, key: int) -> float:
        """A lower bound on `key`'s share of what was seen (0 when it is not among the counters)."""
        mine = self.counts[self.keys == key]
        return float(mine[0]) / self.seen if len(mine) and self.seen else 0.0

    def reset(self) -> None:
        self.keys, self.counts, self.seen = self.keys[:0], self.counts[:0], 0


class HotKeyRouter:
    """Partition ids of tuples: hash partitions, except for hot keys, which go to their grid of sub-groups."""

    def __init__(self, partitions: int, max_keys: int, grid: int, copied: int = STREAM_R):
        """`copied`: the stream whose tuples of a hot key go to every sub-group; the other's are spread."""
        self.partitions, self.max_keys, self.grid, self.copied = partitions, max_keys, grid, copied
        self.hot: dict[int, tuple[int, int]] = {}  #: key -> (first sub-group id, grid size)

    @property
    def total_partitions(self) -> int:
        return self.partitions + self.max_keys * self.grid

    def grid_for(self, share: float, active: int) -> int:
        """Sub-groups for a key with this share of the input: enough that each holds about one slave's share."""
        return max(2, min(self.grid, active, math.ceil(share * active * 2)))

    def promote(self, key: int, size: int) -> int:
        """Make `key` hot with `size` sub-groups in a free slot of ids; returns the first sub-group's id."""
        used = {(first - self.partitions) // self.grid for first, _ in self.hot.values()}
        slot = min(set(range(self.max_keys)) - used)
        first = self.partitions + slot * self.grid
        self.hot[key] = (first, size)
        return first

    def demote(self, key: int) -> tuple[int, int]:
        """`key` is no longer hot: its tuples go to its hash partition again; returns (first sub-group, size)."""
        return self.hot.pop(key)

    def home(self, key: int) -> int:
        return int(partition_of(np.array([key]), self.partitions)[0])

    def route(self, stream: int, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(row index, partition) of every copy of the rows of `stream`: `copies` or `spread`."""
        if stream == self.copied:
            return self.copies(rows)
        return np.arange(len(rows)), self.spread(rows)

    def spread(self, rows: np.ndarray) -> np.ndarray:
        """Partition of each row of the stream stored once: a hot key's row in one sub-group, by its id."""
        part = partition_of(rows["key"], self.partitions)
        for key, (first, size) in self.hot.items():
            mine = rows["key"] == key
            part[mine] = first + (mix64(rows["id"][mine]) % np.uint64(size)).astype(np.int64)
        return part

    def copies(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(row index, partition) of every copy of the copied stream's rows: one, `size` for a hot key's."""
        part = partition_of(rows["key"], self.partitions)
        copies = np.ones(len(rows), np.int64)
        first = np.zeros(len(rows), np.int64)
        for key, (start, size) in self.hot.items():
            mine = rows["key"] == key
            copies[mine], first[mine] = size, start
        index = np.repeat(np.arange(len(rows)), copies)
        offset = np.arange(len(index)) - np.repeat(np.cumsum(copies) - copies, copies)
        hot = copies[index] > 1
        out = part[index]
        out[hot] = first[index][hot] + offset[hot]
        return index, out
