"""The join module of a slave: its partition-groups and the per-epoch join (paper 003, IV-D).

Each epoch brings fresh R and S tuples.  In every bucket they are joined with
the opposite mini-window and with each other, then appended:

    fresh R x stored S  +  stored R x fresh S  +  fresh R x fresh S

so every pair is produced exactly once, by the epoch in which its later tuple
arrives (the paper's "fresh tuples of the head block" rule, done per epoch).
Then blocks that no on-time tuple can reach are expired and the buckets tuned.
"""
from __future__ import annotations

import numpy as np

from protocol.arrays import group_pairs
from protocol.tuples import directory_hash, partition_of
from slave.exthash import PartitionGroup
from slave.kernel import window_join


def _pairs(a: np.ndarray, b: np.ndarray, window: float, out_a: list, out_b: list) -> None:
    ia, ib = window_join(a["key"], a["ts"], b["key"], b["ts"], window)
    if len(ia):
        out_a.append(a[ia])
        out_b.append(b[ib])


class JoinModule:
    def __init__(self, dtype: np.dtype, partitions: int, window: float, block_size: int,
                 theta_min: int, theta_max: int, max_depth: int):
        self.dtype, self.partitions, self.window = dtype, partitions, window
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

    def new_group(self) -> PartitionGroup:
        return PartitionGroup(*self._group_args)

    def process(self, fresh_r: np.ndarray, fresh_s: np.ndarray, watermark: float) -> tuple[np.ndarray, np.ndarray]:
        """Join one epoch's fresh tuples; returns the matching (R rows, S rows) of all new results."""
        out_r: list[np.ndarray] = []
        out_s: list[np.ndarray] = []
        for p, ri, si in group_pairs(partition_of(fresh_r["key"], self.partitions),
                                     partition_of(fresh_s["key"], self.partitions)):
            self._join_group(self.group(p), fresh_r[ri], fresh_s[si], out_r, out_s)
        threshold = watermark - self.window
        for pg in self.groups.values():
            pg.expire(threshold)
            pg.tune()
        if not out_r:
            empty = np.empty(0, dtype=self.dtype)
            return empty, empty
        return np.concatenate(out_r), np.concatenate(out_s)

    def _join_group(self, pg: PartitionGroup, new_r: np.ndarray, new_s: np.ndarray, out_r: list, out_s: list) -> None:
        w = self.window
        for b, ri, si in group_pairs(pg.directory.bucket_of(directory_hash(new_r["key"])),
                                     pg.directory.bucket_of(directory_hash(new_s["key"]))):
            win_r, win_s = pg.buckets[b]
            nr, ns = new_r[ri], new_s[si]
            _pairs(nr, win_s.rows, w, out_r, out_s)
            _pairs(win_r.rows, ns, w, out_r, out_s)
            _pairs(nr, ns, w, out_r, out_s)
            win_r.append(nr)
            win_s.append(ns)

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
