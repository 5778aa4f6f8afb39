"""The join module of a slave: its partition-groups and the per-epoch join (paper 003, IV-D).

Each epoch brings fresh R and S tuples.  In every bucket they are joined with
the opposite mini-window and with each other, then appended:

    fresh R x stored S  +  stored R x fresh S  +  fresh R x fresh S

so every pair is produced exactly once, by the epoch in which its later tuple
arrives (the paper's "fresh tuples of the head block" rule, done per epoch).
Then blocks that no on-time tuple can reach are expired and the buckets tuned.

Band and inequality joins (`join.predicate`) arrive range-partitioned: every S
tuple in the group of its key's range, every R tuple copied into each group
whose range may hold partners, with a table saying which rows belong to which
group.  A pair is then produced only in the group of its S tuple, by the same
rule; those groups are not split (hashing would scatter neighbouring keys).
"""
from __future__ import annotations

import time

import numpy as np

from protocol.arrays import group_pairs, records, take_rows
from protocol.predicates import key_distance
from protocol.tuples import directory_hash, mix64, partition_of
from slave.exthash import PartitionGroup
from slave.kernel import range_join, window_join


class JoinModule:
    def __init__(self, dtype: np.dtype, partitions: int, window: float, block_size: int,
                 theta_min: int, theta_max: int, max_depth: int, predicate: str = "equal", band: int = 0):
        self.dtype, self.partitions, self.window = dtype, partitions, window
        if predicate == "equal":
            self.kernel = lambda a, b: window_join(a["key"], a["ts"], b["key"], b["ts"], window)
        else:
            low, high = key_distance(predicate, band)
            self.kernel = lambda a, b: range_join(a["key"], a["ts"], b["key"], b["ts"], window, low, high)
            max_depth = 0  # one bucket per range: a split by hash would not narrow a band probe
        self._group_args = (dtype, block_size, theta_min, theta_max, max_depth)
        self.groups: dict[int, PartitionGroup] = {}

    def group(self, partition: int) -> PartitionGroup:
        if partition not in self.groups:
            self.groups[partition] = self.new_group()
        return self.groups[partition]

    def extract(self, partition: int) -> PartitionGroup:
        """Remove a partition-group for hand-over (an empty one if no tuple of it ever came here)."""
        return self.groups.pop(partition, None) or self.new_group()

    def install(self, partition: int, pg: PartitionGroup) -> None:
        if partition in self.groups:
            raise ValueError(f"partition-group {partition} is already installed here")
        self.groups[partition] = pg

    def split_hot_key(self, partition: int, key: int, first: int, size: int) -> int:
        """Move `key`'s stored tuples out of `partition` into sub-groups first..first+size-1 (master/hotkeys.py):
        each S tuple into the one its id hashes to, each R tuple into all.  Returns the tuples moved."""
        subs = [self.group(first + j) for j in range(size)]
        pg = self.groups.get(partition)
        if pg is None:
            return 0
        home = [sub.buckets[int(sub.directory.bucket_of(directory_hash(np.array([key])))[0])] for sub in subs]
        moved = 0
        for win_r, win_s in pg.buckets.values():
            r = win_r.take(win_r.rows["key"] == key)
            s = win_s.take(win_s.rows["key"] == key)
            which = (mix64(s["id"]) % np.uint64(size)).astype(np.int64)
            for j, (sub_r, sub_s) in enumerate(home):
                sub_r.append(r)
                sub_s.append(s[which == j])
            moved += len(r) + len(s)
        return moved

    def merge_hot_key(self, partition: int, key: int, first: int, size: int) -> int:
        """Inverse of `split_hot_key`: gather `key`'s sub-groups back into `partition`: every S tuple (each is in
        one sub-group) and the R tuples of the first sub-group only (every sub-group holds a copy of each).
        Returns the tuples gathered."""
        pg = self.group(partition)
        win_r, win_s = pg.buckets[int(pg.directory.bucket_of(directory_hash(np.array([key])))[0])]
        gathered = 0
        for j in range(size):
            sub = self.groups.pop(first + j, None)
            for sub_r, sub_s in (sub.buckets.values() if sub is not None else ()):
                if j == 0:
                    win_r.append(sub_r.rows)
                    gathered += len(sub_r)
                win_s.append(sub_s.rows)
                gathered += len(sub_s)
        return gathered

    def new_group(self) -> PartitionGroup:
        return PartitionGroup(*self._group_args)

    def process(self, fresh_r: np.ndarray, fresh_s: np.ndarray, watermark: float,
                groups: np.ndarray | None = None, stamps: list | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Join one epoch's fresh tuples; returns the matching (R rows, S rows) of all new results.

        `groups` is the (partition, R rows, S rows) table of a range-partitioned batch; without it the
        partition of each tuple is its key's hash partition.  `stamps`, if a list, gets (results so far,
        time.time()) after each partition-group: when its results were produced (the production delay).
        """
        out_r: list[np.ndarray] = []
        out_s: list[np.ndarray] = []
        if groups is None:
            for p, ri, si in group_pairs(partition_of(fresh_r["key"], self.partitions),
                                         partition_of(fresh_s["key"], self.partitions)):
                self._join_group(self.group(p), take_rows(fresh_r, ri), take_rows(fresh_s, si), out_r, out_s,
                                 stamps)
        else:
            ends = np.cumsum(groups[:, 1:], axis=0)
            for (p, n_r, n_s), (end_r, end_s) in zip(groups.tolist(), ends.tolist()):
                self._join_group(self.group(p), fresh_r[end_r - n_r: end_r], fresh_s[end_s - n_s: end_s],
                                 out_r, out_s, stamps)
        threshold = watermark - self.window
        for pg in self.groups.values():
            pg.expire(threshold)
            pg.tune()
        if not out_r:
            empty = np.empty(0, dtype=self.dtype)
            return empty, empty
        return np.concatenate(out_r).view(self.dtype), np.concatenate(out_s).view(self.dtype)

    def _join_group(self, pg: PartitionGroup, new_r: np.ndarray, new_s: np.ndarray, out_r: list, out_s: list,
                    stamps: list | None = None) -> None:
        """Join one group's fresh tuples; matching rows are gathered as records (protocol.arrays.records) into
        out_r and out_s."""
        if pg.directory.global_depth == 0:  # one bucket takes every tuple: no hashing or grouping needed
            buckets = [(int(pg.directory.entries[0]), new_r, new_s)]
        else:
            buckets = [(b, take_rows(new_r, ri), take_rows(new_s, si)) for b, ri, si in
                       group_pairs(pg.directory.bucket_of(directory_hash(new_r["key"])),
                                   pg.directory.bucket_of(directory_hash(new_s["key"])))]
        for b, nr, ns in buckets:
            win_r, win_s = pg.buckets[b]
            rec_r, rec_s = records(nr), records(ns)
            for side_r, side_s, from_r, from_s in ((nr, win_s.rows, rec_r, win_s.records),
                                                   (win_r.rows, ns, win_r.records, rec_s), (nr, ns, rec_r, rec_s)):
                ir, is_ = self.kernel(side_r, side_s)
                if len(ir):
                    out_r.append(from_r[ir])
                    out_s.append(from_s[is_])
            win_r.append(nr)
            win_s.append(ns)
        if stamps is not None:
            stamps.append((sum(map(len, out_r)), time.time()))

    def stored(self) -> tuple[int, int]:
        r = sum(len(w_r) for pg in self.groups.values() for w_r, _ in pg.buckets.values())
        s = sum(len(w_s) for pg in self.groups.values() for _, w_s in pg.buckets.values())
        return r, s

    @property
    def nbytes(self) -> int:
        return sum(pg.nbytes for pg in self.groups.values())

    @property
    def splits(self) -> int:
        return sum(pg.splits for pg in self.groups.values())

    @property
    def merges(self) -> int:
        return sum(pg.merges for pg in self.groups.values())
