"""Input handed on as its event time says (`source.speed`): a replay with the input's own timing, bursts and gaps
kept, instead of a uniform `source.rate`.

A tuple is due `(T - T0) / speed` seconds after the first one was handed on, where T is the largest event time
up to and including it in arrival order (a tuple arriving out of order is due with the one before it, so the
order stays as it is) and T0 the first tuple's.  The source reads ahead as it always does; what is not due yet
waits here, and the master gets an empty chunk until it is.
"""

from __future__ import annotations

import time

import numpy as np

from common.chunks import Chunk, Source
from protocol import eventtime


class EventTimePaced(Source):
    def __init__(self, inner: Source, speed: float, clock=time.monotonic):
        self.inner, self.speed, self.clock = inner, speed, clock
        self.held: Chunk | None = None  #: read from the source, not due yet
        self.origin: tuple[float, int] | None = None  #: (clock, event time) of the first tuple handed on
        self.frontier = eventtime.NEG_INF  #: the largest event time handed on
        self.handed = [0, 0]  #: per side: every row below this one has been handed on ([streams])

    def next_chunk(self, limit: int) -> Chunk | None:
        if self.held is None:
            self.held = self.inner.next_chunk(limit)
            if self.held is None:
                return None
        c = self.held
        if not len(c.ts):
            self.held = None
            return c
        now = self.clock()
        if self.origin is None:
            self.origin = (now, int(c.ts[0]))
        running = np.maximum.accumulate(np.maximum(c.ts, self.frontier))
        due = int(np.searchsorted(running, self.origin[1] + (now - self.origin[0]) * self.speed * 1e6, "right"))
        taken = Chunk(*(column[:due] for column in c))
        self.held = Chunk(*(column[due:] for column in c)) if due < len(c.ts) else None
        if due:
            self.frontier = int(running[due - 1])
            for side in (0, 1):
                ids = taken.id[taken.stream == side]
                if len(ids):
                    self.handed[side] = max(self.handed[side], int(ids.max()) + 1)
        return taken

    # -- the rest is the source's own --------------------------------------------------------------------------
    @property
    def reasons(self):
        return self.inner.reasons

    @property
    def refused(self):
        return self.inner.refused

    @property
    def log(self):
        return self.inner.log

    @property
    def rows_taken(self) -> list[int]:
        """[streams]: per side, the rows handed on (rows waiting here keep their payload)."""
        return [min(a, b) for a, b in zip(self.inner.rows_taken, self.handed)]

    def partitions(self) -> list[dict]:
        return self.inner.partitions()

    def ended(self) -> list[bool]:
        return [e and self.held is None for e in self.inner.ended()]

    def finish(self) -> dict:
        return self.inner.finish()
