"""Partition-groups tuned by extendible hashing (paper 003, IV-D).

A partition-group is the unit the master assigns to a slave.  Inside it, an
extendible-hash directory maps the least significant `global_depth` bits of a
key's directory hash to a bucket, the mini-partition-group; each bucket has a
local depth and one mini-window per stream.  A bucket above `theta_max` blocks
splits (doubling the directory first if its local depth equals the global
depth); a bucket below `theta_min` merges with its buddy when both have the same
local depth and together stay below `theta_max`.  This keeps every scan of a
mini-window short however skewed the partition-group is.
"""

from __future__ import annotations

import numpy as np

from protocol.tuples import directory_hash
from slave.window import MiniWindow


class ExtendibleDirectory:
    """The directory alone: depths and entry -> bucket id; no tuples (pure logic)."""

    def __init__(self) -> None:
        self.global_depth = 0
        self.entries = np.zeros(1, dtype=np.int64)  #: entry -> bucket id
        self.local_depth: dict[int, int] = {0: 0}
        self.next_id = 1

    def bucket_of(self, hashes: np.ndarray) -> np.ndarray:
        mask = np.uint64((1 << self.global_depth) - 1)
        return self.entries[(hashes & mask).astype(np.int64)]

    def split(self, bucket: int) -> tuple[int, int]:
        """Split `bucket`; returns (new bucket id, bit).  Keys whose hash has `bit` set move to the new bucket."""
        depth = self.local_depth[bucket]
        if depth == self.global_depth:
            self.entries = np.concatenate([self.entries, self.entries])
            self.global_depth += 1
        new = self.next_id
        self.next_id += 1
        idx = np.flatnonzero(self.entries == bucket)
        self.entries[idx[(idx >> depth) & 1 == 1]] = new
        self.local_depth[bucket] = self.local_depth[new] = depth + 1
        return new, depth

    def buddy(self, bucket: int) -> int | None:
        """The bucket that differs from `bucket` only in its highest local bit, if it has the same depth."""
        depth = self.local_depth[bucket]
        if depth == 0:
            return None
        first = int(np.flatnonzero(self.entries == bucket)[0])
        other = int(self.entries[first ^ (1 << (depth - 1))])
        return other if other != bucket and self.local_depth[other] == depth else None

    def merge(self, bucket: int, buddy: int) -> None:
        """Fold `buddy` into `bucket`, then halve the directory while no bucket needs its top bit."""
        self.entries[self.entries == buddy] = bucket
        del self.local_depth[buddy]
        self.local_depth[bucket] -= 1
        while self.global_depth > 0 and max(self.local_depth.values()) < self.global_depth:
            self.global_depth -= 1
            self.entries = self.entries[: 1 << self.global_depth].copy()


class PartitionGroup:
    """One partition-group: a directory and, per bucket, the mini-windows of R and S."""

    def __init__(self, dtype: np.dtype, block_size: int, theta_min: int, theta_max: int, max_depth: int):
        self.dtype, self.block_size = dtype, block_size
        self.theta_min, self.theta_max, self.max_depth = theta_min, theta_max, max_depth
        self.directory = ExtendibleDirectory()
        self.buckets: dict[int, tuple[MiniWindow, MiniWindow]] = {0: self.empty_bucket()}
        self.splits = 0
        self.merges = 0

    def empty_bucket(self) -> tuple[MiniWindow, MiniWindow]:
        return MiniWindow(self.dtype, self.block_size), MiniWindow(self.dtype, self.block_size)

    def bucket_blocks(self, bucket: int) -> int:
        r, s = self.buckets[bucket]
        return r.blocks + s.blocks

    def __len__(self) -> int:
        return sum(len(r) + len(s) for r, s in self.buckets.values())

    @property
    def nbytes(self) -> int:
        """The mini-windows' bytes and the directory's entries."""
        return sum(r.nbytes + s.nbytes for r, s in self.buckets.values()) + self.directory.entries.nbytes

    def expire(self, thresholds: tuple[int, int]) -> int:
        """Drop the blocks of R below thresholds[0] and of S below thresholds[1] (JoinModule.thresholds: each
        stream its own, as the time bounds may be asymmetric); returns the tuples dropped."""
        return sum(r.expire(thresholds[0]) + s.expire(thresholds[1]) for r, s in self.buckets.values())

    def decide(self, thresholds: tuple[int, int], unmatched_r: list | None, unmatched_s: list | None) -> None:
        """Every bucket's rows still unmatched below their stream's threshold (R, S) into the lists given
        (MiniWindow.decide)."""
        for r, s in self.buckets.values():
            if unmatched_r is not None:
                r.decide(thresholds[0], unmatched_r)
            if unmatched_s is not None:
                s.decide(thresholds[1], unmatched_s)

    def tune(self) -> None:
        """Split oversized buckets and merge undersized ones (called once per epoch)."""
        for bucket in list(self.buckets):
            while bucket in self.buckets and self.bucket_blocks(bucket) > self.theta_max and self._split(bucket):
                pass
        for bucket in list(self.buckets):
            if bucket not in self.buckets or self.bucket_blocks(bucket) >= self.theta_min:
                continue
            buddy = self.directory.buddy(bucket)
            if buddy is not None and self.bucket_blocks(bucket) + self.bucket_blocks(buddy) < self.theta_max:
                self._merge(bucket, buddy)

    def _split(self, bucket: int) -> bool:
        r, s = self.buckets[bucket]
        hashes = [directory_hash(w.rows["key"]) for w in (r, s)]
        both = np.concatenate(hashes)
        # a bucket whose tuples all share one hash (one hot key) cannot be split by any depth
        if self.directory.local_depth[bucket] >= self.max_depth or both.min() == both.max():
            return False
        new, bit = self.directory.split(bucket)
        moved = tuple(MiniWindow(self.dtype, self.block_size) for _ in range(2))
        for w, h, m in zip((r, s), hashes, moved):
            m.append(*w.take(((h >> np.uint64(bit)) & np.uint64(1)).astype(bool)))
        self.buckets[new] = moved
        self.splits += 1
        return True

    def _merge(self, bucket: int, buddy: int) -> None:
        for w, other in zip(self.buckets[bucket], self.buckets.pop(buddy)):
            w.append(other.rows, other.matched)
        self.directory.merge(bucket, buddy)
        self.merges += 1
