"""The lateness rule (`Lateness`): which tuples are late, and the join's watermark.

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

from protocol.compiled import kernels
from protocol.eventtime import NEG_INF


_LATE_SIG = "void(int64[:], int8[:], int8[::1], int64[::1], int64[::1], int64, boolean[::1], int64[::1])"


def _late(ts, stream, group, running, delay, floor, late, own):  # pragma: no cover - compiled
    """Each tuple's own bound (its group's largest ts before it minus the group's delay) and whether it is late:
    below that bound or below `floor`; one compiled pass, not a numpy running maximum that cost a fifth of the
    master's work (docs/benchmark-history.md)."""
    for i in range(len(ts)):
        g = group[stream[i]]
        own[i] = running[g] - delay[g]
        late[i] = ts[i] < max(own[i], floor)
        running[g] = max(running[g], ts[i])


(_late,) = kernels(__name__, {"_late": _LATE_SIG})


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
                self._open[g] = {
                    "stream": "RS"[g],
                    "began": now,
                    "ended": None,
                    "watermark": self.watermark,
                    "watermark_ended": None,
                    "resumed": False,
                }
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
        return {
            "running": self.running.tolist(),
            "watermark": self.watermark,
            "late": self.late.tolist(),
            "ended": self.ended.tolist(),
            "periods": [dict(p) for p in self.periods],
            "open": [None if p is None else self.periods.index(p) for p in self._open],
        }

    def restore(self, m: dict) -> None:
        self.running = np.array(m["running"], dtype=np.int64)
        self.watermark, self.late = m["watermark"], np.array(m["late"], dtype=np.int64)
        self.ended = np.array(m["ended"], dtype=bool)
        self.periods = [dict(p) for p in m["periods"]]
        self._open = [None if i is None else self.periods[i] for i in m["open"]]
