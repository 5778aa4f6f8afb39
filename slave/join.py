"""The join module of a slave: its partition-groups and the per-epoch join (paper 003, IV-D).

Each epoch brings fresh R and S tuples.  In every bucket they are joined with
the opposite mini-window and with each other, then appended:

    fresh R x stored S  +  stored R x fresh S  +  fresh R x fresh S

so every pair is produced exactly once, by the epoch in which its later tuple
arrives (the paper's "fresh tuples of the head block" rule, done per epoch).
Then blocks that no on-time tuple can reach are expired and the buckets tuned.
With the time bounds lower <= s.ts - r.ts <= upper (join.lower / join.upper, or
+-join.window) and the watermark W (every later on-time tuple has ts >= W:
BiStream, Theorem 1), an R tuple can still meet a future S only if r.ts >= W -
upper, an S tuple a future R only if s.ts >= W + lower: each stream has its own
threshold (`thresholds`).

An epoch's results come out in chunks of at most `chunk_rows` pairs
(`output.result_chunk_rows`), each written and sent before the next is built:
the kernels count first and fill any slice of their pairs (slave.kernel.Matches),
so one hot key in a large window costs time, not memory.

Band and inequality joins (`join.predicate`) arrive range-partitioned: every S
tuple in the group of its key's range, every R tuple copied into each group
whose range may hold partners (left, semi and anti joins: the other way round),
with a table saying which rows belong to which group.  A pair is then produced
only in the group of its tuple that is stored once, by the same rule; those
groups are not split (hashing would scatter neighbouring keys).  A full join
copies both sides: each tuple is at its *home* in the group of its key's range
(the table gives each group's span of keys) and a *guest* in the others, its
flag GUEST (slave.window).  Each pair is emitted in its R tuple's home only (all
of r's partners are there, at home or guests) and each tuple flagged matched
in its own home only (all its partners are there too), so a pair is flagged
at S's home but emitted at R's; a guest is never decided alone.  A pair of two
guests is of no use anywhere: the kernel does not search for it (slave.kernel,
range_matches' `home`).

Hot keys of the equi-join get a grid of sub-groups (Streaming HyperCube, paper
000; master/state/hot_key_router.py): one stream spread over it, each tuple in one, the
other copied into all.  A full join's hot key has two grids, S spread and R
copied, then R spread and S copied, and the copies are guests by the same
rule (the table's span of a copied stream is empty there): each pair is
emitted in the second grid, at its R's home, each S flagged at its home in
the first (protocol.predicates.hot_grids).

Outer, semi and anti joins (`join.type`) keep a matched flag beside every stored tuple of the kept
side(s) (slave.window): set whenever the tuple is part of a pair, in this epoch's join; a row still unmatched
once its ts is below its stream's expiry threshold -- no on-time tuple can reach it any more, the rule that
frees its block -- is emitted after the epoch's join, once (`lone_r`, `lone_s`).  Semi emits an R row at its first match
instead.  The flags move, split, merge and are checkpointed with the rows, so each row is decided once wherever
it lives.  On the result stream a row alone has a stream time (`stream_times`): when it became final
(protocol.predicates.final_time; decided iff that is below the watermark, as the threshold below says), and a
semi row the later ts of its first pair (the earliest of its pairs in the slice of pairs that first matched it).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from protocol import eventtime
from protocol.config import DEFAULTS
from protocol.arrays import field_words, group_pairs, take_rows, words
from protocol.predicates import JOIN_TYPES, final_time, hot_grids, hot_homes, key_distance
from protocol.tuples import FIELDS, STREAM_R, STREAM_S, TERMS, directory_hash, mix64, partition_of
from slave.exthash import PartitionGroup
from slave.kernel import batch_delays, gather_pairs, range_matches, window_matches
from slave.window import GUEST, MATCHED, UNMATCHED

if TYPE_CHECKING:
    from protocol.query import Node


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
        return batch_delays(
            self.pairs["r_arrival"],
            self.pairs["s_arrival"],
            [n for n, _ in self.stamps],
            [t for _, t in self.stamps],
            sent,
            started,
        )


class Join(NamedTuple):
    """One of a bucket's three joins (fresh R x stored S, stored R x fresh S, fresh R x fresh S): the rows of
    each side, their matched flags (None where the join type keeps no flags on that side), whether the R side
    is stored (not fresh), the kernel's count of its pairs, and with a semi join and fresh R the stream time of
    each fresh R row's first pair (set as it first matches)."""

    rows_r: np.ndarray
    rows_s: np.ndarray
    flags_r: np.ndarray | None
    flags_s: np.ndarray | None
    stored_r: bool
    matches: object
    first_r: np.ndarray | None = None


class JoinModule:
    def __init__(
        self,
        dtype: np.dtype,
        partitions: int,
        bounds: tuple[int, int],
        block_size: int,
        theta_min: int,
        theta_max: int,
        max_depth: int,
        predicate: str = "equal",
        band: int = 0,
        join_type: str = "inner",
        chunk_rows: int = DEFAULTS["output"]["result_chunk_rows"][0],
        condition: Node | None = None,
    ):
        """`bounds`: (lower, upper) in integer microseconds, r and s join iff lower <= s.ts - r.ts <= upper
        (protocol.plan.Join.bounds); `join_type` one of
        protocol.predicates.JOIN_TYPES; `condition`: a query's condition on the pair (protocol.query), over the
        terms the tuples carry: a candidate pair of the kernel is a pair, and flags its tuples matched, only where
        it holds."""
        if join_type not in JOIN_TYPES:
            raise ValueError(f"join type {join_type!r}: must be one of {', '.join(JOIN_TYPES)}")
        lower, upper = map(int, bounds)
        self.lower, self.upper = lower, upper
        self.dtype, self.partitions, self.chunk_rows = dtype, partitions, int(chunk_rows)
        self.join_type, self.condition = join_type, condition
        if condition is not None:  # Arrow's compute functions: imported by the ranks whose query has a condition
            from protocol.condition import pair_mask

            self._pair_mask = pair_mask
        self.keep_r = join_type in ("left", "full", "semi", "anti")  #: R rows carry matched flags
        self.keep_s = join_type in ("right", "full")
        self.emit_pairs = join_type in ("inner", "left", "right", "full")
        #: a full join: both sides copied (key ranges, hot-key grids), each tuple a guest outside its stream's span
        self.guests = join_type == "full"
        #: rows without a partner the last epoch emitted (semi: R rows at their first match), copies; set once
        #: its last chunk is taken
        self.lone_r = self.lone_s = np.empty(0, dtype)
        self.semi_time = np.empty(0, np.int64)  #: semi: the stream time of each row of `lone_r` (its first pair's)
        if predicate == "equal":  # a is R, b is S: the bounds as configured
            self.kernel = lambda a, b, spans: window_matches(a["key"], a["ts"], b["key"], b["ts"], lower, upper)
        else:
            low, high = key_distance(predicate, band)
            self.kernel = lambda a, b, spans: range_matches(
                a["key"], a["ts"], b["key"], b["ts"], lower, upper, low, high, spans and spans[0]
            )  # a range: R's span is S's
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

    def split_hot_key(self, partition: int, key: int, first: int, count: int) -> int:
        """Move `key`'s stored tuples out of `partition` into sub-groups first..first+count-1
        (master/state/hot_key_router.py),
        each into the one its id hashes to of those its stream is spread over, with its matched flag, and into
        every one its stream is copied into (protocol.predicates.hot_grids): as a guest (flag GUEST) where it
        is at home in another (a full join), else with its flag.  Returns the tuples moved."""
        subs = [self.group(first + j) for j in range(count)]
        pg = self.groups.get(partition)
        if pg is None:
            return 0
        home = [sub.buckets[int(sub.directory.bucket_of(directory_hash(np.array([key])))[0])] for sub in subs]
        moved = 0
        for windows in pg.buckets.values():
            for stream, w in enumerate(windows):
                rows, matched = w.take(w.rows["key"] == key)
                spread, copied = hot_grids(self.join_type, stream, first, count)
                which = (mix64(rows["id"]) % np.uint64(len(spread))).astype(np.int64) if spread else None
                for j, g in enumerate(spread):
                    home[g - first][stream].append(rows[which == j], matched[which == j])
                guest = np.full(len(rows), GUEST, np.uint8) if spread else matched
                for g in copied:
                    home[g - first][stream].append(rows, guest)
                moved += len(rows)
        return moved

    def merge_hot_key(self, partition: int, key: int, first: int, count: int) -> int:
        """Inverse of `split_hot_key`: gather `key`'s sub-groups back into `partition`, each tuple once with its
        flag (protocol.predicates.hot_homes: every tuple of a spread stream from its home, one copy of each of a
        copied one from the first sub-group; a guest is dropped).  Returns the tuples gathered."""
        pg = self.group(partition)
        home = pg.buckets[int(pg.directory.bucket_of(directory_hash(np.array([key])))[0])]
        subs = {g: self.groups.pop(g, None) for g in range(first, first + count)}
        gathered = 0
        for stream in (STREAM_R, STREAM_S):
            for g in hot_homes(self.join_type, stream, first, count):
                for windows in subs[g].buckets.values() if subs[g] is not None else ():
                    home[stream].append(windows[stream].rows, windows[stream].matched)
                    gathered += len(windows[stream])
        return gathered

    def new_group(self) -> PartitionGroup:
        return PartitionGroup(*self._group_args)

    def process(
        self,
        fresh_r: np.ndarray,
        fresh_s: np.ndarray,
        watermark: int,
        groups: np.ndarray | None = None,
        stamps: list | None = None,
    ) -> Pairs:
        """All of `chunks` as one Pairs (tests and tools; a slave takes the chunks one by one).  `stamps`, if a
        list, gets the chunks' stamps numbered over the whole epoch."""
        parts, done = [], 0
        for chunk in self.chunks(fresh_r, fresh_s, watermark, groups):
            if stamps is not None:
                stamps.extend((done + n, t) for n, t in chunk.stamps)
            parts.append(chunk.pairs)
            done += len(chunk.pairs)
        return Pairs.concat(self.dtype, parts)

    def chunks(
        self, fresh_r: np.ndarray, fresh_s: np.ndarray, watermark: int, groups: np.ndarray | None = None
    ) -> Iterator[Chunk]:
        """Join one epoch's fresh tuples; yields its results in chunks of at most `chunk_rows` pairs, then
        expires and tunes once the last is taken.

        `groups` is the batch's (partition, R rows, S rows[, R's first key, last key, S's first key, last key])
        table (the master sends one: the rows come grouped by partition, and with key ranges or hot-key grids
        rows are copied into several; protocol.messages.GROUP_ROW); without it the partition of each tuple is its
        key's hash partition.  With `guests`, a row whose key is outside its stream's span is a guest copy.  A
        chunk is cut only when more pairs follow, so the last one is known as it is yielded (with guests it may
        be empty: the pairs that followed were a guest R's).
        """
        if groups is None:
            batches = (
                (p, take_rows(fresh_r, ri), take_rows(fresh_s, si), None)
                for p, ri, si in group_pairs(
                    partition_of(fresh_r["key"], self.partitions), partition_of(fresh_s["key"], self.partitions)
                )
            )
        else:
            ends = np.cumsum(groups[:, 1:3], axis=0)
            spans = groups[:, 3:7].reshape(-1, 2, 2).tolist() if self.guests else [None] * len(groups)
            batches = (
                (p, fresh_r[end_r - n_r : end_r], fresh_s[end_s - n_s : end_s], mine)
                for (p, n_r, n_s, *_), (end_r, end_s), mine in zip(groups.tolist(), ends.tolist(), spans)
            )
        pieces: list[tuple] = []
        lone_r: list[np.ndarray] = []  # rows decided unmatched
        lone_s: list[np.ndarray] = []
        semi: list[tuple[np.ndarray, np.ndarray]] = []  # semi: (R rows at their first match, their stream times)
        stamps: list[tuple[int, float]] = []
        filled = 0
        for p, new_r, new_s, spans in batches:
            for join in self._join_group(self.group(p), new_r, new_s, semi, spans):
                at, matches = 0, join.matches
                while at < matches.total:  # one slice per chunk: a single tuple's pairs are split too
                    if filled == self.chunk_rows:
                        yield self._chunk(pieces, filled, stamps, last=False)
                        pieces, stamps, filled = [], [], 0
                    n = min(matches.total - at, self.chunk_rows - (filled if self.emit_pairs else 0))
                    ia, ib = matches.take(at, at + n)
                    if self.condition is not None:
                        held = self._pair_mask(self.condition, join.rows_r[TERMS][ia], join.rows_s[TERMS][ib])
                        ia, ib = ia[held], ib[held]
                    if self.guests:
                        ia, ib = self._flag_at_home(join, ia, ib)
                    else:
                        self._flag(join, ia, ib, semi)
                    if self.emit_pairs and len(ia):
                        pieces.append((words(join.rows_r), ia, words(join.rows_s), ib))
                        filled += len(ia)
                    at += n
            stamps.append((filled, time.time()))
        yield self._chunk(pieces, filled, stamps, last=True)
        thresholds = self.thresholds(watermark)
        alone_r = lone_r if self.keep_r and self.join_type != "semi" else None
        alone_s = lone_s if self.keep_s else None
        for pg in self.groups.values():
            if alone_r is not None or alone_s is not None:
                pg.decide(thresholds, alone_r, alone_s)
            pg.expire(thresholds)
            pg.tune()
        if semi:
            lone_r = [rows for rows, _ in semi]
        self.semi_time = np.concatenate([times for _, times in semi]) if semi else np.empty(0, np.int64)
        self.lone_r, self.lone_s = (
            np.concatenate(lone) if lone else np.empty(0, self.dtype) for lone in (lone_r, lone_s)
        )

    def thresholds(self, watermark: int) -> tuple[int, int]:
        """(R's, S's) expiry threshold at watermark W: a stored tuple whose ts is below its stream's can join no
        later on-time tuple (ts >= W), so its row alone is final and its block may go.  R: a future s has s.ts
        - r.ts >= W - r.ts, which exceeds upper once r.ts < W - upper; S: a future r has s.ts - r.ts <= s.ts -
        W, below lower once s.ts < W + lower.  Integers: the join test's own boundaries, so a tuple exactly
        at a bound from W stays."""
        return int(watermark) - self.upper, int(watermark) + self.lower

    def stream_times(self) -> tuple[np.ndarray, np.ndarray]:
        """The stream time of each row of `lone_r` and `lone_s` (integer microseconds): a semi row's first pair's,
        else the time the row became final (master.punctuation)."""
        bounds = (self.lower, self.upper)
        times_r = self.semi_time if self.join_type == "semi" else final_time(STREAM_R, self.lone_r["ts"], bounds)
        return times_r, final_time(STREAM_S, self.lone_s["ts"], bounds)

    def _chunk(self, pieces: list, filled: int, stamps: list, last: bool) -> Chunk:
        """Gather the pieces' pairs: they are views of window storage, which appends never overwrite (and
        expiry waits for the last chunk)."""
        if filled > (stamps[-1][0] if stamps else 0):  # cut inside a partition-group: produced now
            stamps.append((filled, time.time()))
        return Chunk(Pairs(self.dtype, gather_pairs(pieces, self._fields, filled)), stamps, last)

    def _flag(self, join: Join, ir: np.ndarray, is_: np.ndarray, semi: list) -> None:
        """Flag the tuples of a slice of pairs matched; with a semi join, stored R rows matched for the first
        time go to `semi` with their first pair's stream time (fresh ones once their bucket's joins are done:
        `_join_group`)."""
        if self.keep_r:
            if self.join_type == "semi":
                new = join.flags_r[ir] == UNMATCHED
                ir_new, later = ir[new], np.maximum(join.rows_r["ts"][ir[new]], join.rows_s["ts"][is_[new]])
                order = np.lexsort((later, ir_new))  # per R row its earliest pair first
                first = order[np.r_[True, ir_new[order][1:] != ir_new[order][:-1]]] if len(order) else order
                if join.stored_r:
                    semi.append((take_rows(join.rows_r, ir_new[first]), later[first]))
                else:
                    join.first_r[ir_new[first]] = later[first]
            join.flags_r[ir] = MATCHED
        if self.keep_s:
            join.flags_s[is_] = MATCHED

    @staticmethod
    def _flag_at_home(join: Join, ir: np.ndarray, is_: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A full join: flag the tuples of a slice of pairs matched where they are at home (a guest's flag stays
        GUEST), and return the slice's pairs whose R tuple is at home: those alone are emitted here (a pair whose
        R is a guest is emitted at its R's home, which holds its S as well)."""
        home_r = join.flags_r[ir] != GUEST
        ir, is_home = ir[home_r], is_[home_r]
        join.flags_r[ir] = MATCHED
        join.flags_s[is_[join.flags_s[is_] != GUEST]] = MATCHED
        return ir, is_home

    def _join_group(
        self, pg: PartitionGroup, new_r: np.ndarray, new_s: np.ndarray, semi: list, spans: list | None = None
    ) -> Iterator[Join]:
        """Join one group's fresh tuples: yields a Join (its sides, matched flags and slave.kernel.Matches) for
        each of the three joins of each bucket; a bucket's fresh tuples are appended, with their flags, once
        its joins are taken, and with a semi join its fresh R rows matched go to `semi` with their first
        pair's stream time.  `spans`: per stream the [first, last] key whose home the group is (`guests`): a
        fresh tuple whose key is outside its stream's is a guest copy, flagged GUEST."""
        if pg.directory.global_depth == 0:  # one bucket takes every tuple: no hashing or grouping needed
            buckets = [(int(pg.directory.entries[0]), new_r, new_s)]
        else:
            buckets = [
                (b, take_rows(new_r, ri), take_rows(new_s, si))
                for b, ri, si in group_pairs(
                    pg.directory.bucket_of(directory_hash(new_r["key"])),
                    pg.directory.bucket_of(directory_hash(new_s["key"])),
                )
            ]
        for b, nr, ns in buckets:
            win_r, win_s = pg.buckets[b]
            fresh_r = np.zeros(len(nr), np.uint8) if self.keep_r else None
            fresh_s = np.zeros(len(ns), np.uint8) if self.keep_s else None
            first_r = np.zeros(len(nr), np.int64) if self.join_type == "semi" else None
            if spans is not None:
                for fresh, rows, (first, last) in zip((fresh_r, fresh_s), (nr, ns), spans):
                    fresh[(rows["key"] < first) | (rows["key"] > last)] = GUEST
            for side_r, side_s, flags_r, flags_s in (
                (nr, win_s.rows, fresh_r, win_s.matched),
                (win_r.rows, ns, win_r.matched, fresh_s),
                (nr, ns, fresh_r, fresh_s),
            ):
                matches = self.kernel(side_r, side_s, spans)  # with spans: no pair of two guests
                if matches.total:
                    stored = flags_r is not fresh_r
                    yield Join(side_r, side_s, flags_r, flags_s, stored, matches, None if stored else first_r)
            if self.join_type == "semi" and fresh_r.any():
                semi.append((take_rows(nr, fresh_r == MATCHED), first_r[fresh_r == MATCHED]))
            win_r.append(nr, fresh_r)
            win_s.append(ns, fresh_s)

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
