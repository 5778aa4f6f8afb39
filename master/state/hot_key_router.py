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
(protocol.predicates.copied_stream), so each R tuple has one matched flag.  A
full join keeps both sides' flags, so its hot key gets two grids: S spread and
R copied, then R spread and S copied (protocol.predicates.hot_grids); a copy
is a guest, flagged and emitted only at its tuple's home (slave.join).
"""

from __future__ import annotations

import math

import numpy as np

from master.state.ranges import every_key
from protocol.messages import NO_KEYS
from protocol.predicates import hot_grids, hot_homes
from protocol.tuples import STREAM_R, STREAM_S, mix64, partition_of


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
        self.add(*np.unique(keys, return_counts=True), len(keys))

    def add(self, keys: np.ndarray, counts: np.ndarray, seen: int) -> None:
        """Add counters over `seen` keys: another summary's (summaries of the same capacity merge into one with
        the same bound over the keys both saw: Agarwal et al., mergeable summaries), or a batch's exact counts."""
        self.seen += seen
        allk = np.concatenate([self.keys, keys.astype(np.int64)])
        allc = np.concatenate([self.counts, counts.astype(np.int64)])
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

    def __init__(self, partitions: int, max_keys: int, grid: int, join_type: str = "inner"):
        """`join_type` says which stream is spread over a hot key's grid and which copied into it, and whether
        it has one grid or two (a full join: protocol.predicates.hot_grids)."""
        self.partitions, self.max_keys, self.grid, self.join_type = partitions, max_keys, grid, join_type
        self.grids = 2 if join_type == "full" else 1  #: grids per hot key
        self.hot: dict[int, tuple[int, int]] = {}  #: key -> (first sub-group id, sub-groups)

    @property
    def total_partitions(self) -> int:
        return self.partitions + self.max_keys * self.grid * self.grids

    def grid_for(self, share: float, active: int) -> int:
        """Sub-groups for a key with this share of the input: enough that each holds about one slave's share."""
        return max(2, min(self.grid, active, math.ceil(share * active * 2)))

    def free_slot(self) -> int:
        """The first sub-group id of a slot of ids no hot key uses."""
        width = self.grid * self.grids
        used = {(first - self.partitions) // width for first, _ in self.hot.values()}
        return self.partitions + min(set(range(self.max_keys)) - used) * width

    def promote(self, key: int, size: int, first: int | None = None) -> int:
        """Make `key` hot with a grid of `size` sub-groups (two with a full join) from sub-group `first` (a free
        slot if None: several dispatchers use the slot rank 0 chose); returns the first sub-group's id."""
        first = self.free_slot() if first is None else first
        self.hot[key] = (first, size * self.grids)
        return first

    def demote(self, key: int) -> tuple[int, int]:
        """`key` is no longer hot: its tuples go to its hash partition again; returns (first sub-group, count)."""
        return self.hot.pop(key)

    def home(self, key: int) -> int:
        return int(partition_of(np.array([key]), self.partitions)[0])

    def homes(self, stream: int, key: int) -> range:
        """The sub-groups of hot `key` that hold each tuple of `stream` once (protocol.predicates.hot_homes)."""
        return hot_homes(self.join_type, stream, *self.hot[key])

    def route(self, stream: int, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(row index, partition) of every copy of the rows of `stream`: a hot key's row in the one sub-group
        its id hashes to of those it is spread over, and in every one it is copied into (`hot_grids`); any
        other row once, in its hash partition."""
        once = partition_of(rows["key"], self.partitions)
        placed = np.ones(len(rows), bool)  #: rows in `once`
        copies, start = np.zeros(len(rows), np.int64), np.zeros(len(rows), np.int64)
        for key, (first, count) in self.hot.items():
            mine = rows["key"] == key
            spread, copied = hot_grids(self.join_type, stream, first, count)
            if spread:
                once[mine] = spread.start + (mix64(rows["id"][mine]) % np.uint64(len(spread))).astype(np.int64)
            placed[mine] = bool(spread)
            copies[mine], start[mine] = len(copied), copied.start
        index = np.repeat(np.arange(len(rows)), copies)
        offset = np.arange(len(index)) - np.repeat(np.cumsum(copies) - copies, copies)
        return (np.concatenate([np.flatnonzero(placed), index]), np.concatenate([once[placed], start[index] + offset]))

    def spans(self, partitions: np.ndarray) -> np.ndarray:
        """The spans of `partitions` for the batches' group table (protocol.messages.GROUP_ROW): every key at home
        (master.state.ranges.every_key), but NO_KEYS for a stream a full join copies into a sub-group as guests."""
        spans = every_key(partitions)
        for first, count in self.hot.values():
            for stream in (STREAM_R, STREAM_S):
                spread, copied = hot_grids(self.join_type, stream, first, count)
                if spread:
                    spans[np.isin(partitions, copied), 2 * stream : 2 * stream + 2] = NO_KEYS
        return spans
