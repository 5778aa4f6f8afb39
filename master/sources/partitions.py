"""Per-partition watermarks: the rows of a stream read from several partitions, merged into one order (pure).

A stream read from partitions (a Kafka topic's: master.sources.kafka_input) is out of order across them: each
partition is in order on its own, but one may be read far ahead of another.  As Flink's Kafka source does, each
partition has its own watermark: its running maximum event time (over the rows that pass the checks) minus the
stream's max_delay.  The rows are handed on merged across partitions in order of their partition's watermark
(ties: partition, then offset), and only once their watermark lies strictly below the lowest current watermark
of every partition that can still bring rows.  Holding nothing back: a partition that has ended (bounded, at
its end offset), one with nothing at the broker beyond what was read (its position at its high watermark), one
without a record for the stream's idle_timeout (> 0) until its next record.

Why this is the per-partition rule.  In the merged order every row y before a row x of partition p has a
watermark at most x's, and y's time minus max_delay is at most y's watermark; so the largest time before x minus
max_delay is at most p's watermark at x, which is p's largest time up to x minus max_delay.  The stream-level rule
the master applies (master.state.lateness: late iff below the stream's largest earlier time minus max_delay, or
below the join's watermark) therefore finds x late iff it is below p's own largest earlier time minus max_delay,
or below the join's watermark: each row is judged against its own partition's watermark, never another's -- the
argument of master.sources.streams' merge of two streams, one level down.  A partition that resumes after being
idle (or caught up) may bring rows below what was handed on: those are late, as an idle stream's are.

Memory: a partition read far ahead of the others waits here.  Past PENDING_LIMIT rows waiting, one that is not the
lowest is paused (the reader stops fetching it: Flink's watermark alignment) until half of them are handed on;
a paused partition is never idle, so pausing it changes no order.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

import numpy as np
import pyarrow as pa

from protocol.eventtime import NEG_INF, POS_INF

#: rows one partition may have waiting before it is paused
PENDING_LIMIT = 1 << 20


class Waiting(NamedTuple):
    """Rows of one partition read and not yet handed on, in offset order."""

    watermark: np.ndarray  #: int64: the partition's watermark at each row (rising)
    offset: np.ndarray  #: int64
    table: pa.Table  #: the rows' columns


class Released(NamedTuple):
    """Rows handed on, in the merged order."""

    watermark: np.ndarray
    partition: np.ndarray  #: int64: the partition's index
    offset: np.ndarray
    table: pa.Table


class PartitionMerge:
    """`first[i]` and `high[i]`: partition i's first offset and high watermark when reading starts; `bounded`: it
    ends at that high watermark; `delay` (microseconds) the stream's max_delay, `idle_timeout` its idle timeout
    (seconds of the wall clock, `now` in every call; 0 = never idle)."""

    def __init__(self, first: np.ndarray, high: np.ndarray, bounded: bool, delay: int, idle_timeout: float):
        n = len(first)
        self.delay, self.idle_timeout, self.bounded = delay, idle_timeout, bounded
        self.limit = PENDING_LIMIT  #: rows a partition may have waiting before it is paused
        self.position = np.asarray(first, np.int64).copy()  #: the next offset to read
        self.end = np.asarray(high, np.int64).copy()  #: bounded: where each partition ends
        #: the largest high watermark each partition was read up to (-1: none yet)
        self.reached = np.where(self.position >= self.end, self.end, -1)
        self.running = np.full(n, NEG_INF, np.int64)  #: the largest event time of each partition's good rows
        self.last_record = np.full(n, np.inf)  #: when each partition last brought a record (inf: not started)
        self.paused = np.zeros(n, bool)
        self.waiting_rows = np.zeros(n, np.int64)
        self.peak = 0  #: the most rows ever waiting at once
        #: per partition, its running maximum at its last row handed on: its watermark state at `unreleased`
        self.handed = np.full(n, NEG_INF, np.int64)
        self._waiting: list[deque[Waiting]] = [deque() for _ in range(n)]

    def start(self, now: float) -> None:
        """Reading starts: the partitions' quiet time counts from now, not from when the stream was opened."""
        self.last_record[:] = now

    def read(self, partition: np.ndarray, offset: np.ndarray, now: float) -> None:
        """Records read (those set aside too): the partitions' positions move past them."""
        np.maximum.at(self.position, partition, offset + 1)
        self.last_record[partition] = now

    def reached_end(self, partition: int, offset: int) -> None:
        """Partition `partition` was read up to its high watermark `offset` (nothing more at the broker; bounded:
        nothing it reads past its end)."""
        self.reached[partition] = max(self.reached[partition], offset)
        self.position[partition] = max(
            self.position[partition], min(offset, self.end[partition]) if self.bounded else offset
        )

    def rewind(self, partition: int, offset: int) -> None:
        """Partition `partition` now ends at `offset`, below its position: the broker lost records read there (a
        recovery that goes on past the loss), so it reads from `offset` what the broker writes there now."""
        self.position[partition] = self.reached[partition] = offset  # nothing beyond it now, as `restore` takes it

    def skip(self, partition: int, offset: int) -> None:
        """Partition `partition`'s records below `offset` were deleted before they were read: it reads on
        from there."""
        self.position[partition] = max(self.position[partition], offset)

    def add(self, partition: np.ndarray, offset: np.ndarray, ts: np.ndarray, good: np.ndarray, table: pa.Table) -> None:
        """Rows read, in reading order (each partition's in offset order): their event times `ts`
        (microseconds), whether each passes the checks (`good`: only those move the watermark) and their
        columns."""
        if not len(partition):
            return
        order = np.argsort(partition, kind="stable")
        partition, offset, ts = partition[order], offset[order], np.where(good, ts, NEG_INF)[order]
        table = table.take(order)
        starts = np.flatnonzero(np.r_[True, partition[1:] != partition[:-1]])
        for a, b in zip(starts, np.r_[starts[1:], len(partition)]):  # per partition, not per row
            p = partition[a]
            running = np.maximum.accumulate(np.maximum(ts[a:b], self.running[p]))
            self.running[p] = running[-1]
            self._waiting[p].append(Waiting(running - self.delay, offset[a:b], table.slice(a, b - a)))
            self.waiting_rows[p] += b - a
        self.peak = max(self.peak, int(self.waiting_rows.sum()))

    def ended(self) -> np.ndarray:
        """Which partitions are read to their end (bounded)."""
        return self.bounded & (self.position >= self.end)

    def holding(self, now: float) -> np.ndarray:
        """Which partitions can still bring rows below what is waiting: not ended, not at their high watermark,
        not idle (a paused one is never idle: it was stopped, not quiet)."""
        caught_up = self.reached >= self.position
        idle = (self.idle_timeout > 0) & (now - self.last_record > self.idle_timeout) & ~self.paused
        return ~(self.ended() | caught_up | idle)

    def floor(self, now: float) -> int:
        """The lowest current watermark of the partitions holding rows back (POS_INF: none does)."""
        holding = self.holding(now)
        return int((self.running[holding] - self.delay).min()) if holding.any() else POS_INF

    def release(self, now: float) -> Released | None:
        """The rows whose watermark lies below the floor, merged: by watermark, then partition, then offset
        (None: none)."""
        if not self.waiting_rows.any():
            return None
        floor = self.floor(now)
        taken: list[tuple[int, Waiting]] = []
        for p in np.flatnonzero(self.waiting_rows):  # per partition: its rows below the floor are a prefix
            queue = self._waiting[p]
            while queue and queue[0].watermark[-1] < floor:
                taken.append((p, queue.popleft()))
            if queue and (n := int(np.searchsorted(queue[0].watermark, floor, "left"))):
                head = queue.popleft()
                taken.append((p, Waiting(head.watermark[:n], head.offset[:n], head.table.slice(0, n))))
                queue.appendleft(Waiting(head.watermark[n:], head.offset[n:], head.table.slice(n)))
        if not taken:
            return None
        for p, w in taken:
            self.waiting_rows[p] -= len(w.offset)
        watermark = np.concatenate([w.watermark for _, w in taken])
        partition = np.concatenate([np.full(len(w.offset), p, np.int64) for p, w in taken])
        offset = np.concatenate([w.offset for _, w in taken])
        order = np.lexsort((offset, partition, watermark))
        np.maximum.at(self.handed, partition, watermark + self.delay)
        table = pa.concat_tables([w.table for _, w in taken]).take(order)
        return Released(watermark[order], partition[order], offset[order], table)

    def crowded(self, now: float) -> np.ndarray:
        """Which partitions are to be paused now: `limit` rows or more waiting (or, once paused, half of that)
        while their watermark is above the floor; the lowest is never paused, so the floor always moves."""
        above = self.running - self.delay > self.floor(now)
        self.paused = above & (self.waiting_rows >= np.where(self.paused, self.limit // 2, self.limit))
        return self.paused

    def unreleased(self) -> np.ndarray:
        """Per partition: the offset of its oldest record not handed on (its position when none waits)."""
        return np.array([q[0].offset[0] if q else pos for q, pos in zip(self._waiting, self.position)], np.int64)

    def restore(self, offsets: np.ndarray, running: np.ndarray, end: np.ndarray) -> None:
        """A recovery: read again from `offsets` (a checkpoint's `unreleased`), each partition's watermark state
        there `running` (its `handed`), bounded at the first run's `end`; nothing waits.  Only a partition with
        nothing at the broker now (its high watermark as this merge was made) holds nothing back."""
        high = self.end
        self.position = np.asarray(offsets, np.int64).copy()
        self.end = np.asarray(end, np.int64).copy() if self.bounded else high
        self.reached = np.where(self.position >= high, high, -1)
        self.running = np.asarray(running, np.int64).copy()
        self.handed = self.running.copy()
        self.waiting_rows[:] = 0
        for q in self._waiting:
            q.clear()

    @property
    def done(self) -> bool:
        """Bounded, every partition at its end, nothing waiting."""
        return self.bounded and bool(self.ended().all()) and not self.waiting_rows.any()
