"""The join module of a slave: its partition-groups and the per-epoch join (paper 003, IV-D).

Each epoch brings fresh R and S tuples.  In every bucket they are joined with
the opposite mini-window and with each other, then appended:

    fresh R x stored S  +  stored R x fresh S  +  fresh R x fresh S

so every pair is produced exactly once, by the epoch in which its later tuple
arrives (the paper's "fresh tuples of the head block" rule, done per epoch).
Then blocks that no on-time tuple can reach are expired and the buckets tuned.

Band and inequality joins (`join.predicate`) arrive range-partitioned: every S
tuple in the group of its key's range, every R tuple copied into each group
whose range may hold partners (left, semi and anti joins: the other way round),
with a table saying which rows belong to which group.  A pair is then produced
only in the group of its tuple that is stored once, by the same rule; those
groups are not split (hashing would scatter neighbouring keys).

Outer, semi and anti joins (`join.type`, issue 22) keep a matched flag beside every stored tuple of the kept
side(s) (slave.window): set whenever the tuple is part of a pair, in this epoch's join; a row still unmatched
once its ts is below the expiry threshold -- no on-time tuple can reach it any more, the rule that frees its
block -- is emitted after the epoch's join, once (`lone_r`, `lone_s`).  Semi emits an R row at its first match
instead.  The flags move, split, merge and are checkpointed with the rows, so each row is decided once wherever
it lives.
"""
from __future__ import annotations

import time

import numpy as np

from protocol import eventtime
from protocol.arrays import field_words, group_pairs, take_rows, words
from protocol.predicates import JOIN_TYPES, copied_stream, key_distance
from protocol.tuples import FIELDS, directory_hash, mix64, partition_of
from slave.exthash import PartitionGroup
from slave.kernel import batch_delays, gather_pairs, range_join, window_join
from slave.window import MATCHED, UNMATCHED

class Pairs:
    """One epoch's results as contiguous columns: pairs["r_id"][i] joined pairs["s_id"][i], and each side's other
    tuple fields (protocol.tuples.FIELDS: r_ts, r_key, r_value, r_arrival, s_ts, ...) beside them; results are
    written, sent and aggregated column by column."""

    def __init__(self, dtype: np.dtype, columns: np.ndarray):
        names = [f"{side}_{field}" for side in "rs" for field in FIELDS]
        self.columns = {name: col.view(dtype[field]) for name, field, col in zip(names, FIELDS * 2, columns)}

    def __len__(self) -> int:
        return len(self.columns["r_id"])

    def __getitem__(self, name: str) -> np.ndarray:
        return self.columns[name]

    def output(self, name: str) -> np.ndarray:
        """A column as results carry it: r_ts and s_ts in seconds, the user's time (protocol.eventtime)."""
        return eventtime.to_seconds(self.columns[name]) if name in ("r_ts", "s_ts") else self.columns[name]


class JoinModule:
    def __init__(self, dtype: np.dtype, partitions: int, window: int, block_size: int,
                 theta_min: int, theta_max: int, max_depth: int, predicate: str = "equal", band: int = 0,
                 join_type: str = "inner"):
        """`window` in integer microseconds (protocol.eventtime.duration of join.window); `join_type` one of
        protocol.predicates.JOIN_TYPES."""
        if join_type not in JOIN_TYPES:
            raise ValueError(f"join type {join_type!r}: must be one of {', '.join(JOIN_TYPES)}")
        self.dtype, self.partitions, self.window = dtype, partitions, int(window)
        self.join_type = join_type
        self.keep_r = join_type in ("left", "full", "semi", "anti")  #: R rows carry matched flags
        self.keep_s = join_type in ("right", "full")
        self.emit_pairs = join_type in ("inner", "left", "right", "full")
        self.copied = copied_stream(join_type)  #: the stream a hot key copies into every sub-group
        #: rows without a partner the last `process` emitted (semi: R rows at their first match), copies
        self.lone_r = self.lone_s = np.empty(0, dtype)
        window = self.window
        if predicate == "equal":
            self.kernel = lambda a, b: window_join(a["key"], a["ts"], b["key"], b["ts"], window)
        else:
            low, high = key_distance(predicate, band)
            self.kernel = lambda a, b: range_join(a["key"], a["ts"], b["key"], b["ts"], window, low, high)
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
        each tuple of the spread stream (S, or R for left, semi, anti) into the one its id hashes to, each of the
        copied stream into all, each with its matched flag.  Returns the tuples moved."""
        subs = [self.group(first + j) for j in range(size)]
        pg = self.groups.get(partition)
        if pg is None:
            return 0
        home = [sub.buckets[int(sub.directory.bucket_of(directory_hash(np.array([key])))[0])] for sub in subs]
        moved = 0
        for win_r, win_s in pg.buckets.values():
            taken = [w.take(w.rows["key"] == key) for w in (win_r, win_s)]  # (rows, matched) per stream
            which = (mix64(taken[1 - self.copied][0]["id"]) % np.uint64(size)).astype(np.int64)
            for j, sub in enumerate(home):
                for stream, (rows, matched) in enumerate(taken):
                    mine = slice(None) if stream == self.copied else which == j
                    sub[stream].append(rows[mine], matched[mine])
            moved += sum(len(rows) for rows, _ in taken)
        return moved

    def merge_hot_key(self, partition: int, key: int, first: int, size: int) -> int:
        """Inverse of `split_hot_key`: gather `key`'s sub-groups back into `partition`: every tuple of the spread
        stream (each is in one sub-group) and those of the copied stream from the first sub-group only (every
        sub-group holds a copy of each; the copies' matched flags are not used: the join types that keep the
        copied stream, full, are refused with hot keys, protocol.config).  Returns the tuples gathered."""
        pg = self.group(partition)
        home = pg.buckets[int(pg.directory.bucket_of(directory_hash(np.array([key])))[0])]
        gathered = 0
        for j in range(size):
            sub = self.groups.pop(first + j, None)
            for windows in (sub.buckets.values() if sub is not None else ()):
                for stream, w in enumerate(windows):
                    if j == 0 or stream != self.copied:
                        home[stream].append(w.rows, w.matched)
                        gathered += len(w)
        return gathered

    def new_group(self) -> PartitionGroup:
        return PartitionGroup(*self._group_args)

    def process_with_delays(self, fresh_r: np.ndarray, fresh_s: np.ndarray, watermark: int,
                            groups: np.ndarray | None, sent: float, started: float) -> tuple[Pairs, np.ndarray, np.ndarray]:
        """`process`, and every result's production delay with the batch's delay histograms
        (slave.kernel.batch_delays): a result is produced when its partition-group's join is done, not when the
        whole batch is (paper 003, VI-A).  `sent` and `started` are the wall-clock times the batch was sent and
        its join began."""
        stamps: list[tuple[int, float]] = []
        pairs = self.process(fresh_r, fresh_s, watermark, groups, stamps)
        delay, hists = batch_delays(pairs["r_arrival"], pairs["s_arrival"], [n for n, _ in stamps],
                                    [t for _, t in stamps], sent, started)
        return pairs, delay, hists

    def process(self, fresh_r: np.ndarray, fresh_s: np.ndarray, watermark: int,
                groups: np.ndarray | None = None, stamps: list | None = None) -> Pairs:
        """Join one epoch's fresh tuples; returns all new results.

        `groups` is the batch's (partition, R rows, S rows) table (the master sends one: the rows come grouped
        by partition, and with key ranges or hot-key grids R rows are copied into several); without it the
        partition of each tuple is its key's hash partition.  `stamps`, if a list, gets (results so far,
        time.time()) after each partition-group: when its results were produced (the production delay).
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
        lone_r: list[np.ndarray] = []  # semi: R rows at their first match; else rows decided unmatched
        lone_s: list[np.ndarray] = []
        produced = 0
        for p, new_r, new_s in batches:
            produced += self._join_group(self.group(p), new_r, new_s, pieces, lone_r)
            if stamps is not None:
                stamps.append((produced, time.time()))
        # gathered before expiry: the pieces are views of window storage, which appends never overwrite
        pairs = Pairs(self.dtype, gather_pairs(pieces, self._fields, produced))
        threshold = int(watermark) - self.window  # integers: the join test's own boundary
        alone_r = lone_r if self.keep_r and self.join_type != "semi" else None
        alone_s = lone_s if self.keep_s else None
        for pg in self.groups.values():
            if alone_r is not None or alone_s is not None:
                pg.decide(threshold, alone_r, alone_s)
            pg.expire(threshold)
            pg.tune()
        self.lone_r, self.lone_s = (np.concatenate(lone) if lone else np.empty(0, self.dtype)
                                    for lone in (lone_r, lone_s))
        return pairs

    def _join_group(self, pg: PartitionGroup, new_r: np.ndarray, new_s: np.ndarray, pieces: list,
                    semi: list) -> int:
        """Join one group's fresh tuples; each matching (R rows, R indices, S rows, S indices) goes to `pieces`,
        the rows as words (protocol.arrays.words) for `gather_pairs`, and every tuple of a pair is flagged
        matched; with a semi join R rows matched for the first time go to `semi` instead.  Returns the results
        found."""
        found = 0
        if pg.directory.global_depth == 0:  # one bucket takes every tuple: no hashing or grouping needed
            buckets = [(int(pg.directory.entries[0]), new_r, new_s)]
        else:
            buckets = [(b, take_rows(new_r, ri), take_rows(new_s, si)) for b, ri, si in
                       group_pairs(pg.directory.bucket_of(directory_hash(new_r["key"])),
                                   pg.directory.bucket_of(directory_hash(new_s["key"])))]
        for b, nr, ns in buckets:
            win_r, win_s = pg.buckets[b]
            fresh_r = np.zeros(len(nr), np.uint8) if self.keep_r else None
            fresh_s = np.zeros(len(ns), np.uint8) if self.keep_s else None
            for side_r, side_s, flags_r, flags_s in ((nr, win_s.rows, fresh_r, win_s.matched),
                                                     (win_r.rows, ns, win_r.matched, fresh_s),
                                                     (nr, ns, fresh_r, fresh_s)):
                ir, is_ = self.kernel(side_r, side_s)
                if not len(ir):
                    continue
                if self.keep_r:
                    if self.join_type == "semi" and flags_r is not fresh_r:  # stored R matched the first time
                        semi.append(take_rows(side_r, np.unique(ir[flags_r[ir] == UNMATCHED])))
                    flags_r[ir] = MATCHED
                if self.keep_s:
                    flags_s[is_] = MATCHED
                if self.emit_pairs:
                    pieces.append((words(side_r), ir, words(side_s), is_))
                    found += len(ir)
            if self.join_type == "semi" and fresh_r.any():
                semi.append(take_rows(nr, fresh_r == MATCHED))
            win_r.append(nr, fresh_r)
            win_s.append(ns, fresh_s)
        return found

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
