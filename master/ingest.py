"""Turning source chunks into wire tuples, and the lateness rule (`Lateness`).

A tuple is late iff its ts is below (the largest ts of all tuples before it in
arrival order, both streams together) minus `join.max_delay`; with two declared
streams each is judged against its own largest ts and its own max_delay, and
against the join's watermark.  Late tuples are set aside, never joined; every
later on-time tuple has ts >= the watermark sent, which is what makes watermark
expiry safe (BiStream, Theorem 1).  Event time and delays are integer
microseconds (protocol.eventtime): the rule is an exact integer comparison.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from protocol.arrays import field_words, words
from protocol.eventtime import NEG_INF
from protocol.tuples import MIX_M1, MIX_M2, FIELDS


@njit(cache=True, nogil=True, inline="always")
def partition_one(key, partitions):  # pragma: no cover - compiled
    """protocol.tuples.partition_of of one key, for compiled loops that route tuples without a pass per hashing
    step (here, not in protocol/: the Spark side imports protocol/ in Python workers without numba)."""
    z = np.uint64(key)
    z = (z ^ (z >> np.uint64(30))) * MIX_M1
    z = (z ^ (z >> np.uint64(27))) * MIX_M2
    z = z ^ (z >> np.uint64(31))
    return np.int64((z >> np.uint64(32)) % np.uint64(partitions))


_LATE_SIG = "void(int64[:], int8[:], int8[::1], int64[::1], int64[::1], int64, boolean[::1], int64[::1])"


@njit(_LATE_SIG, cache=True, nogil=True)
def _late(ts, stream, group, running, delay, floor, late, own):  # pragma: no cover - compiled
    """Each tuple's own bound (its group's largest ts before it minus the group's delay) and whether it is late:
    below that bound or below `floor`; one compiled pass, not a numpy running maximum that cost a fifth of the
    master's work (docs/benchmark-history.md)."""
    for i in range(len(ts)):
        g = group[stream[i]]
        own[i] = running[g] - delay[g]
        late[i] = ts[i] < max(own[i], floor)
        running[g] = max(running[g], ts[i])


class Lateness:
    """The lateness rule and the join's watermark W over one dispatcher's arrival order (pure: the wall clock
    comes in as seconds since the run's start, `now`; whole arrays).  Event time and delays are integer
    microseconds (protocol.eventtime): every comparison is exact.

    Joint (one delay: the single file, the generator, ZeroMQ): a tuple is late iff its ts is below (the largest
    ts of all tuples before it, both streams together) minus `join.max_delay`; W = largest ts - max_delay.

    Per stream (two delays, R's and S's: `[streams.NAME]`): stream X's bound is X's largest ts so far minus X's
    max_delay; a tuple of X is late iff its ts is below X's bound before it, or below W as it stood before its
    batch.  W is the lowest bound of the streams that count -- not one that has ended, nor one without a tuple
    for its idle timeout (wall clock, > 0) -- the largest when none counts, and never falls: a stream idle while
    W passed its bound finds its tuples below W late when it resumes (Flink's `withIdleness`).  Each idle
    period is logged: when it began and ended and W then."""

    def __init__(self, delays: list[int], idle_timeouts: list[float] | None = None):
        n = len(delays)
        if n not in (1, 2):
            raise ValueError(f"one delay (both streams together) or two (R's, S's), got {delays}")
        self.group = np.array([0, n - 1], dtype=np.int8)  #: stream -> the group whose running max judges it
        self.delays = np.array(delays, dtype=np.int64)
        self.timeouts = np.array(idle_timeouts or [0.0] * n, dtype=np.float64)
        self.running = np.full(n, NEG_INF, dtype=np.int64)  #: per group: largest ts taken
        self.watermark = NEG_INF - int(self.delays.max())
        self.late = np.zeros(2, dtype=np.int64)  #: late tuples per stream (R, S)
        self.last_input = np.zeros(n)  #: per group: when its last tuple came (seconds since the start)
        self.ended = np.zeros(n, dtype=bool)
        self.periods: list[dict] = []  #: idle periods, open ones with "ended": None
        self._open: list[dict | None] = [None] * n  #: per group: its open idle period

    def start(self, now: float) -> None:
        """The run (or a resumed run) starts: every stream counts as having had input now."""
        self.last_input[:] = now

    def judge(self, ts: np.ndarray, stream: np.ndarray, now: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A batch in arrival order: (late flags, the bound each late-or-not tuple was held to, whether a late
        tuple was late only for being below W); then W moves on."""
        ts, stream = np.asarray(ts, dtype=np.int64), np.asarray(stream, dtype=np.int8)
        late = np.empty(len(ts), dtype=np.bool_)
        own = np.empty(len(ts), dtype=np.int64)
        floor = self.watermark
        _late(ts, stream, self.group, self.running, self.delays, floor, late, own)
        self.late += np.bincount(stream[late], minlength=2)
        came = np.bincount(self.group[stream], minlength=len(self.running)) > 0
        self.last_input[came] = now
        for g in np.flatnonzero(came):
            self._close(int(g), now, resumed=True)
        self._advance(now)
        return late, np.maximum(own, floor), late & (ts >= own)

    def tick(self, now: float, ended: list[bool] | None = None) -> int:
        """The wall clock moved (and the streams in `ended` have no tuple left): open the idle periods due, and
        move W on; returns W."""
        if ended is not None:
            self.ended |= np.asarray(ended, dtype=bool)
        idle = ~self.ended & (self.timeouts > 0) & (now - self.last_input >= self.timeouts)
        for g in np.flatnonzero(idle):
            if self._open[g] is None:
                self._open[g] = {"stream": "RS"[g], "began": now, "ended": None,
                                 "watermark": self.watermark, "watermark_ended": None, "resumed": False}
                self.periods.append(self._open[g])
        for g in np.flatnonzero(self.ended):
            self._close(int(g), now, resumed=False)
        self._advance(now)
        return self.watermark

    def _close(self, g: int, now: float, resumed: bool) -> None:
        p = self._open[g]
        if p is not None:
            p.update(ended=now, watermark_ended=self.watermark, resumed=resumed)
            self._open[g] = None

    def _advance(self, now: float) -> None:
        bounds = self.running - self.delays
        counts = ~self.ended & np.array([p is None for p in self._open])
        self.watermark = max(self.watermark, int(bounds[counts].min() if counts.any() else bounds.max()))

    @property
    def idle(self) -> list[bool]:
        """Per group: in an idle period now."""
        return [p is not None for p in self._open]

    def finish(self, now: float) -> None:
        """The run ends: close the idle periods still open."""
        for g in range(len(self._open)):
            self._close(g, now, resumed=False)

    def state(self) -> dict:
        """For a checkpoint: what judging goes on from (an open idle period stays open)."""
        return {"running": self.running.tolist(), "watermark": self.watermark, "late": self.late.tolist(),
                "ended": self.ended.tolist(), "periods": [dict(p) for p in self.periods],
                "open": [None if p is None else self.periods.index(p) for p in self._open]}

    def restore(self, m: dict) -> None:
        self.running = np.array(m["running"], dtype=np.int64)
        self.watermark, self.late = m["watermark"], np.array(m["late"], dtype=np.int64)
        self.ended = np.array(m["ended"], dtype=bool)
        self.periods = [dict(p) for p in m["periods"]]
        self._open = [None if i is None else self.periods[i] for i in m["open"]]


_PACK_SIG = "void(int64[:], int64[:], int64[:], int64[:], int64[:], int64[::1], int64[::1], int64[::1], int64[:, ::1])"
_COUNT_SIG = "void(int8[:], int64[:], boolean[::1], int64, int64[::1], int64[:, ::1])"
_ROUTE_SIG = ("void(int8[:], int64[:], int64[:], int64[:], int64[:], int64[:], boolean[::1], int64[::1], int64[:, ::1], "
              "int64[::1], int64[::1], int64[:, ::1], int64[:, ::1])")


@njit(cache=True, nogil=True, inline="always")
def _put(out, d, ids, ts, keys, values, arrival, j, fields, pad):  # pragma: no cover - compiled
    """Column row j into record d; its padding words zero (nothing of this process's memory goes on the wire)."""
    out[d, fields[0]] = ids[j]
    out[d, fields[1]] = ts[j]
    out[d, fields[2]] = keys[j]
    out[d, fields[3]] = values[j]
    out[d, fields[4]] = arrival[j]
    for w in pad:
        out[d, w] = 0


@njit(_PACK_SIG, cache=True, nogil=True)
def _pack(ids, ts, keys, values, arrival, index, fields, pad, out):  # pragma: no cover - compiled
    for i in range(len(index)):
        _put(out, i, ids, ts, keys, values, arrival, index[i], fields, pad)


@njit(_COUNT_SIG, cache=True, nogil=True)
def _count_hashed(stream, keys, late, partitions, part, sizes):  # pragma: no cover - compiled
    """Each on-time tuple's hash partition, and the tuples per stream and partition."""
    for i in range(len(keys)):
        if not late[i]:
            part[i] = partition_one(keys[i], partitions)
            sizes[stream[i], part[i]] += 1


@njit(_ROUTE_SIG, cache=True, nogil=True)
def _pack_hashed(stream, ids, ts, keys, values, arrival, late, part, starts, fields, pad, out_r,
                 out_s):  # pragma: no cover - compiled
    """Each on-time tuple into the next free record of its stream's group of its partition (the groups start
    at `starts`): the columns are read in order and written to one place per group, where gathering them in
    group order missed the cache on every column of every tuple."""
    for i in range(len(keys)):
        if late[i]:
            continue
        s, p = stream[i], part[i]
        d = starts[s, p]
        starts[s, p] += 1
        _put(out_r if s == 0 else out_s, d, ids, ts, keys, values, arrival, i, fields, pad)


def _columns(dtype: np.dtype, columns: tuple) -> tuple:
    """Each column in its field's type, then as int64 words (floats as their bits), as the packers read them.
    ts must be integer microseconds already: a float cast to int64 here would drop its fraction unseen."""
    if np.asarray(columns[1]).dtype.kind not in "iu":
        raise TypeError(f"ts must be integer microseconds (protocol.eventtime), got {np.asarray(columns[1]).dtype}")
    return tuple(np.asarray(c, dtype=dtype[f]).view(np.int64) for f, c in zip(FIELDS, columns))


def _padding(dtype: np.dtype) -> np.ndarray:
    taken = set(field_words(dtype, FIELDS).tolist())
    return np.array([w for w in range(dtype.itemsize // 8) if w not in taken], dtype=np.int64)


def to_wire(dtype: np.dtype, ids, ts, keys, values, arrival, index: np.ndarray | None = None) -> np.ndarray:
    """Pack columns into the protocol's tuple records: rows `index` of them (all if None), in that order, in one
    compiled pass (gathering each column and then writing it into the records field by field cost the master
    about 100 ns a tuple, as much as generating it)."""
    n = len(ids) if index is None else len(index)
    rows = np.empty(n, dtype=dtype)
    index = np.arange(n, dtype=np.int64) if index is None else np.asarray(index, dtype=np.int64)
    _pack(*_columns(dtype, (ids, ts, keys, values, arrival)), index, field_words(dtype, FIELDS), _padding(dtype),
          words(rows))
    return rows


def to_wire_hashed(dtype: np.dtype, stream, ids, ts, keys, values, arrival, late: np.ndarray,
                   partitions: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per stream (R, S): (the records of its on-time tuples grouped by hash partition, arrival order kept
    within a partition; the records per partition), what MiniBuffers.add_ordered takes.  Two compiled passes
    (count, then pack) in place of a selection, a hash and a gather per stream."""
    part = np.empty(len(keys), dtype=np.int64)
    sizes = np.zeros((2, partitions), dtype=np.int64)
    stream, keys = np.asarray(stream, dtype=np.int8), np.asarray(keys, dtype=np.int64)
    _count_hashed(stream, keys, late, partitions, part, sizes)
    rows = [np.empty(int(n), dtype=dtype) for n in sizes.sum(axis=1)]
    starts = np.cumsum(sizes, axis=1) - sizes
    _pack_hashed(stream, *_columns(dtype, (ids, ts, keys, values, arrival)), late, part,
                 starts, field_words(dtype, FIELDS), _padding(dtype), words(rows[0]), words(rows[1]))
    return [(rows[0], sizes[0]), (rows[1], sizes[1])]
