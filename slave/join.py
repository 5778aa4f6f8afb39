"""The join module of a slave: its partition-groups and the per-epoch join (paper 003, IV-D).

Each epoch brings fresh R and S tuples.  In every bucket they are joined with
the opposite mini-window and with each other, then appended:

    fresh R x stored S  +  stored R x fresh S  +  fresh R x fresh S

so every pair is produced exactly once, by the epoch in which its later tuple
arrives (the paper's "fresh tuples of the head block" rule, done per epoch).
Then blocks that no on-time tuple can reach are expired and the buckets tuned.

An epoch's results come out in chunks of at most `chunk_rows` pairs
(`output.result_chunk_rows`), each written and sent before the next is built:
the kernels count first and fill any slice of their pairs (slave.kernel.Matches),
so one hot key in a large window costs time, not memory.

Band and inequality joins (`join.predicate`) arrive range-partitioned: every S
tuple in the group of its key's range, every R tuple copied into each group
whose range may hold partners, with a table saying which rows belong to which
group.  A pair is then produced only in the group of its S tuple, by the same
rule; those groups are not split (hashing would scatter neighbouring keys).
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np

from protocol import eventtime
from protocol.config import DEFAULTS
from protocol.arrays import field_words, group_pairs, take_rows, words
from protocol.predicates import key_distance
from protocol.tuples import FIELDS, directory_hash, mix64, partition_of
from slave.exthash import PartitionGroup
from slave.kernel import batch_delays, gather_pairs, range_matches, window_matches

class Pairs:
    """An epoch's results (or a chunk of them) as contiguous columns: pairs["r_id"][i] joined pairs["s_id"][i],
    and each side's other tuple fields (protocol.tuples.FIELDS: r_ts, r_key, r_value, r_arrival, s_ts, ...)
    beside them; results are written, sent and aggregated column by column."""

    def __init__(self, dtype: np.dtype, columns: np.ndarray):
        names = [f"{side}_{field}" for side in "rs" for field in FIELDS]
        self.words = columns  #: the columns as one (2 x fields, n) int64 array (slave.kernel.gather_pairs)
        self.columns = {name: col.view(dtype[field]) for name, field, col in zip(names, FIELDS * 2, columns)}

    def __len__(self) -> int:
        return len(self.columns["r_id"])

    def __getitem__(self, name: str) -> np.ndarray:
        return self.columns[name]

    def output(self, name: str) -> np.ndarray:
        """A column as results carry it: r_ts and s_ts in seconds, the user's time (protocol.eventtime)."""
        return eventtime.to_seconds(self.columns[name]) if name in ("r_ts", "s_ts") else self.columns[name]

    @classmethod
    def concat(cls, dtype: np.dtype, parts: list[Pairs]) -> Pairs:
        if len(parts) == 1:
            return parts[0]
        return cls(dtype, np.concatenate([p.words for p in parts], axis=1))


class Chunk(NamedTuple):
    """Up to `chunk_rows` of an epoch's results.  `stamps`: (results of the chunk so far, time.time()) when
    each partition-group's join ended in it, and when the chunk was cut: when its results were produced.
    `last`: the epoch's last chunk (there is always one, empty if the epoch has no results)."""
    pairs: Pairs
    stamps: list[tuple[int, float]]
    last: bool

    def delays(self, sent: float, started: float) -> tuple[np.ndarray, np.ndarray]:
        """Every result's production delay and the histograms (slave.kernel.batch_delays): a result is produced
        when its partition-group's join or its chunk is done, not when the whole batch is (paper 003, VI-A).
        `sent` and `started` are the wall-clock times the batch was sent and its join began."""
        return batch_delays(self.pairs["r_arrival"], self.pairs["s_arrival"], [n for n, _ in self.stamps],
                            [t for _, t in self.stamps], sent, started)


class JoinModule:
    def __init__(self, dtype: np.dtype, partitions: int, window: int, block_size: int,
                 theta_min: int, theta_max: int, max_depth: int, predicate: str = "equal", band: int = 0,
                 chunk_rows: int = DEFAULTS["output"]["result_chunk_rows"][0]):
        """`window` in integer microseconds (protocol.eventtime.duration of join.window)."""
        self.dtype, self.partitions, self.window, self.chunk_rows = dtype, partitions, int(window), int(chunk_rows)
        window = self.window
        if predicate == "equal":
            self.kernel = lambda a, b: window_matches(a["key"], a["ts"], b["key"], b["ts"], window)
        else:
            low, high = key_distance(predicate, band)
            self.kernel = lambda a, b: range_matches(a["key"], a["ts"], b["key"], b["ts"], window, low, high)
            max_depth = 0  # one bucket per range: a split by hash would not narrow a band probe
        self._group_args = (dtype, block_size, theta_min, theta_max, max_depth)
        self._fields = field_words(dtype, FIELDS)
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

    def process(self, fresh_r: np.ndarray, fresh_s: np.ndarray, watermark: int,
                groups: np.ndarray | None = None, stamps: list | None = None) -> Pairs:
        """All of `chunks` as one Pairs (tests and tools; a slave takes the chunks one by one).  `stamps`, if a
        list, gets the chunks' stamps numbered over the whole epoch."""
        parts, done = [], 0
        for chunk in self.chunks(fresh_r, fresh_s, watermark, groups):
            if stamps is not None:
                stamps.extend((done + n, t) for n, t in chunk.stamps)
            parts.append(chunk.pairs)
            done += len(chunk.pairs)
        return Pairs.concat(self.dtype, parts)

    def chunks(self, fresh_r: np.ndarray, fresh_s: np.ndarray, watermark: int,
               groups: np.ndarray | None = None) -> Iterator[Chunk]:
        """Join one epoch's fresh tuples; yields its results in chunks of at most `chunk_rows` pairs, then
        expires and tunes once the last is taken.

        `groups` is the batch's (partition, R rows, S rows) table (the master sends one: the rows come grouped
        by partition, and with key ranges or hot-key grids R rows are copied into several); without it the
        partition of each tuple is its key's hash partition.  A chunk is cut only when more pairs follow, so
        the last one is known as it is yielded.
        """
        if groups is None:
            batches = ((p, take_rows(fresh_r, ri), take_rows(fresh_s, si)) for p, ri, si in
                       group_pairs(partition_of(fresh_r["key"], self.partitions),
                                   partition_of(fresh_s["key"], self.partitions)))
        else:
            ends = np.cumsum(groups[:, 1:], axis=0)
            batches = ((p, fresh_r[end_r - n_r: end_r], fresh_s[end_s - n_s: end_s])
                       for (p, n_r, n_s), (end_r, end_s) in zip(groups.tolist(), ends.tolist()))
        pieces: list[tuple] = []
        stamps: list[tuple[int, float]] = []
        filled = 0
        for p, new_r, new_s in batches:
            for rows_r, rows_s, matches in self._join_group(self.group(p), new_r, new_s):
                at = 0
                while at < matches.total:  # one slice per chunk: a single tuple's pairs are split too
                    if filled == self.chunk_rows:
                        yield self._chunk(pieces, filled, stamps, last=False)
                        pieces, stamps, filled = [], [], 0
                    n = min(matches.total - at, self.chunk_rows - filled)
                    ia, ib = matches.take(at, at + n)
                    pieces.append((rows_r, ia, rows_s, ib))
                    filled, at = filled + n, at + n
            stamps.append((filled, time.time()))
        yield self._chunk(pieces, filled, stamps, last=True)
        threshold = int(watermark) - self.window  # integers: the join test's own boundary
        for pg in self.groups.values():
            pg.expire(threshold)
            pg.tune()

    def _chunk(self, pieces: list, filled: int, stamps: list, last: bool) -> Chunk:
        """Gather the pieces' pairs: they are views of window storage, which appends never overwrite (and
        expiry waits for the last chunk)."""
        if filled > (stamps[-1][0] if stamps else 0):  # cut inside a partition-group: produced now
            stamps.append((filled, time.time()))
        return Chunk(Pairs(self.dtype, gather_pairs(pieces, self._fields, filled)), stamps, last)

    def _join_group(self, pg: PartitionGroup, new_r: np.ndarray, new_s: np.ndarray) -> Iterator[tuple]:
        """Join one group's fresh tuples: yields (R rows, S rows, slave.kernel.Matches) for each of the three
        joins of each bucket, the rows as words (protocol.arrays.words) for `gather_pairs`; a bucket's fresh
        tuples are appended once its joins are counted."""
        if pg.directory.global_depth == 0:  # one bucket takes every tuple: no hashing or grouping needed
            buckets = [(int(pg.directory.entries[0]), new_r, new_s)]
        else:
            buckets = [(b, take_rows(new_r, ri), take_rows(new_s, si)) for b, ri, si in
                       group_pairs(pg.directory.bucket_of(directory_hash(new_r["key"])),
                                   pg.directory.bucket_of(directory_hash(new_s["key"])))]
        for b, nr, ns in buckets:
            win_r, win_s = pg.buckets[b]
            for side_r, side_s in ((nr, win_s.rows), (win_r.rows, ns), (nr, ns)):
                matches = self.kernel(side_r, side_s)
                if matches.total:
                    yield words(side_r), words(side_s), matches
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
