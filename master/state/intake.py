"""The ingest desk: paced intake from the source, the lateness rule, routing into the mini-buffers.

Tuples are taken as whole chunks (paper 003, IV-B: the master partitions its
input into one mini-buffer per partition-group); paced input is taken in ticks
of a tenth of a sub-group slot.  A tuple below the largest ts seen before it
minus `join.max_delay` is late (BiStream, Theorem 1); with two declared streams
each has its own max_delay and is judged within itself and against the join's
watermark, which an idle stream stops holding back (master.state.lateness.Lateness).
Late tuples are set aside (an effect: the shell writes the late files), never
joined.  The shell takes from the source what `due` says and hands each chunk
to `take`; with checkpoints it archives every chunk taken.  On-time tuples go
to their hash partition, to their key range (band and inequality joins: S to
its home, R copied to every range that may hold partners; the other way round
for the joins that decide R rows alone, so each R is stored once; both copied
for a full join, each decided at its home), or through
the hot-key router to a key's grid (Streaming HyperCube).  With checkpoints every tuple taken is archived.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dataclasses import dataclass

import numpy as np

from master.state.lateness import Lateness
from master.state.packing import to_wire, to_wire_hashed
from master.state.ranges import KeyRanges, copy_offsets, every_key
from protocol import eventtime
from protocol.predicates import key_distance, range_copied
from protocol.strict_json import finite
from protocol.tuples import STREAM_NAMES, STREAM_R, STREAM_S

if TYPE_CHECKING:
    from protocol.plan import Plan


@dataclass(frozen=True)
class SetAside:
    """Late tuples of `chunk` (`late`: its mask) for the late files, with why (`reason`) and the bound they
    fell below (`bound`, event time)."""

    chunk: object
    late: np.ndarray
    reason: np.ndarray
    bound: np.ndarray


@dataclass(frozen=True)
class Archive:
    """A chunk taken, for the input archive (checkpoint.archive)."""

    chunk: object


class IngestDesk:
    def __init__(
        self, plan: Plan, buffers, stats, channels, index: int, k: int, groups: int, router, sketch, own_rows=False
    ):
        """`router`, `sketch`: the hot-key router and frequent-key sketch (None: hot keys off); `channels`:
        where its effects go (master/state/channels.py); `own_rows`: the dispatchers read different rows (Kafka
        partitions shared out), so one may end long before the others."""
        self.plan, self.buffers, self.stats, self.channels = plan, buffers, stats, channels
        self.index, self.k, self.own_rows = index, k, own_rows
        self.router, self.sketch = router, sketch
        self.rate = plan.source.rate / k  #: this dispatcher's paced share
        join = plan.join
        #: [streams]: each stream judged within itself, by its own max_delay (R's, S's); else both together
        self.streams = {s.name: s for s in plan.streams} if plan.source.kind == "streams" else {}
        delays = [s.max_delay for s in self.streams.values()] or [join.max_delay]  # microseconds, as every ts here
        self.lateness = Lateness(delays, [s.idle_timeout for s in self.streams.values()] or None)
        self.stream_delays = delays if len(delays) == 2 else delays * 2  #: R's, S's
        #: band / inequality joins: key ranges, fixed from the first keys seen (None: hash partitions); with
        #: several dispatchers every one must route by the same ranges, so rank 0 decides them and the others
        #: take no input until they have them (a RANGES order)
        self.ranges: KeyRanges | None = None
        self._ranges_shared = False
        self.range_partitioned = join.predicate != "equal"
        self.key_distance = key_distance(join.predicate, join.band)
        #: the streams copied to every range that may hold partners; the other is stored once, at its key's range,
        #: where its pairs are produced: R, whose matched flag decides a left, semi or anti row; a full
        #: join copies both (each tuple's row alone is decided at its home range only: slave.join)
        self.copied = range_copied(join.type)
        #: paced ingest tick: a tenth of a sub-group slot, at most 10 ms (bounds the delay it adds)
        self.ingest_interval = min(0.01, plan.epochs.distribution / groups / 10)
        self._last_ingest = 0.0
        self._behind = 0.0  #: seconds the pacing schedule is ahead of what `due` allows (the pacing lag)
        self.t0 = 0.0
        self.origin = 0.0  #: the run's first start (a resumed run's too): idle periods are seconds since then
        self.exhausted = False
        self.consumed = 0  #: tuples taken from the source: its position
        #: per stream (R, S): the largest ts taken in, for the metrics' per-stream watermarks
        self.stream_max_ts = [eventtime.NEG_INF, eventtime.NEG_INF]
        self.late_reasons = self._late_reasons()
        self.archiving = plan.checkpoint.enabled and plan.checkpoint.archive

    def ranges_to_share(self) -> list | None:
        """Rank 0: its key ranges, once, as soon as they are decided (the loop sends them to the others)."""
        if self.ranges is None or self._ranges_shared or not self.range_partitioned:
            return None
        self._ranges_shared = True
        return self.ranges.bounds.tolist()

    def spans(self, partitions: np.ndarray) -> np.ndarray:
        """Per stream the (first, last) keys whose home each of `partitions` is (the batches' group table): its key
        range for both, every key with hash partitions, none for a stream a full join copies into a hot key's
        sub-group as guests (master.state.hot_key_router)."""
        if self.ranges is not None:
            return np.tile(self.ranges.spans(partitions), 2)
        return every_key(partitions) if self.router is None else self.router.spans(partitions)

    def use_ranges(self, bounds: list) -> None:
        """Another dispatcher: rank 0's key ranges came."""
        self.ranges = KeyRanges(bounds)

    def start(self, now: float) -> float:
        """The run starts: returns the pacing schedule's origin (a resumed run keeps the schedule where it was)."""
        self.t0 = now - (self.consumed / self.rate if self.rate > 0 else 0.0)
        self.origin = now - self.stats.elapsed_before
        self.lateness.start(now - self.origin)
        return self.t0

    def frontier(self) -> int:
        """The join's watermark W of what was taken: no on-time tuple still to come lies below it."""
        return self.lateness.watermark

    def batch_watermark(self) -> int:
        """The watermark its batches carry: the frontier; with dispatchers reading their own rows POS_INF once
        this one's input has ended and its mini-buffers are empty, so that the slaves' lowest over the dispatchers
        no longer waits for one that sends nothing more (one that reads no Kafka partition, or whose partitions
        ended first)."""
        if self.own_rows and self.exhausted and not len(self.buffers):
            return eventtime.POS_INF
        return self.frontier()

    def idle_note(self) -> str:
        """For the progress line: the streams idle now, if any."""
        idle = [name for name, now in zip(self.streams, self.lateness.idle) if now]
        return f" | idle: {', '.join(idle)}" if idle else ""

    def due(self, now: float, ended, slot: bool = False, cap: int | None = None) -> int:
        """How many tuples to take from the source now: what has arrived (paced) or what fits (unpaced); 0:
        none.  At a `slot` paced input is taken whatever the tick, so what arrived until then goes out now.
        `ended`: with declared streams, per stream whether the source has ended it; `cap`: at most this many
        (the ordered result stream's room, master.result_stream)."""
        if self.streams:  # an idle or ended stream stops holding the watermark back
            self.lateness.tick(now - self.origin, ended)
        if self.range_partitioned and self.ranges is None and self.index > 0:
            return 0  # rank 0's key ranges have not come yet
        src = self.plan.source
        room = self.plan.master.buffer_capacity - len(self.buffers)
        limit = min(src.batch, room, src.batch if cap is None else cap)
        behind = 0.0
        if self.rate > 0:
            due = int((now - self.t0) * self.rate) - self.consumed
            # paced input is taken in ticks, not tuple by tuple; but a whole batch due is taken at once, or the
            # tick would cap ingest at source.batch per tick (65,536 per 10 ms: 6.5M/s, whatever the cluster)
            if due < src.batch and now - self._last_ingest < self.ingest_interval and not slot:
                return 0
            # how far ingest is behind the pacing schedule (the due tuples this step cannot take): it grows only
            # when the cluster cannot keep up
            behind = (due - limit) / self.rate
            limit = min(limit, due)
        if self.exhausted:
            return 0  # the schedule goes on, but no tuple is due after the input's end: the drain is no lag
        if limit <= 0:
            self.stats.pacing_lag_max = max(self.stats.pacing_lag_max, behind)  # full mini-buffers hold ingest back
            return 0
        self._last_ingest, self._behind = now, behind
        return limit

    def take(self, chunk, limit: int, now: float) -> int:
        """Judge and route `chunk`, what the source gave for `due`'s `limit` (None: the input has ended);
        returns the tuples taken."""
        if chunk is None:
            self.exhausted = True
            if self.range_partitioned and self.ranges is None:  # no on-time key at all: any ranges are exact
                self.ranges = KeyRanges.from_sample(np.zeros(1, np.int64), self.buffers.partitions)
            return 0
        n = len(chunk.ts)
        if n == limit:  # a shorter chunk is all the source has: the due tuples past it do not exist
            self.stats.pacing_lag_max = max(self.stats.pacing_lag_max, self._behind)
        if self.archiving and n:  # a held end hands on empty chunks (master.sources.HeldEnd)
            self.channels.write(Archive(chunk))
        if self.rate > 0:  # nominal arrival of each tuple, so master-side queueing counts as delay
            arrival = self.t0 + (self.consumed + np.arange(n)) / self.rate
        else:
            arrival = np.full(n, now)
        self.consumed += n
        late, bound, below_watermark = self.lateness.judge(chunk.ts, chunk.stream, now - self.origin)
        for stream in (0, 1):
            ts = chunk.ts[chunk.stream == stream]
            if len(ts):
                self.stream_max_ts[stream] = max(self.stream_max_ts[stream], int(ts.max()))
        if late.any():
            self._set_aside_late(chunk, late, bound, below_watermark)
        self._route(chunk, arrival, late)
        self.stats.buffered_peak = max(self.stats.buffered_peak, len(self.buffers))
        return n

    def _route(self, chunk, arrival: np.ndarray, late: np.ndarray) -> None:
        """The on-time tuples of `chunk` into the mini-buffers of their partitions."""
        on_time = ~late
        dtype = self.buffers.dtype
        if self.router is not None:
            self.sketch.update(chunk.key[on_time])
        if self.range_partitioned and self.ranges is None and on_time.any():
            self.ranges = KeyRanges.from_sample(chunk.key[on_time], self.buffers.partitions)
        if self.router is None and self.ranges is None:  # hash partitions: the rows built in their order
            for stream, (rows, sizes) in enumerate(
                to_wire_hashed(
                    dtype,
                    chunk.stream,
                    chunk.id,
                    chunk.ts,
                    chunk.key,
                    chunk.value,
                    arrival,
                    late,
                    self.buffers.partitions,
                    chunk.terms,
                )
            ):
                self.stats.input[STREAM_NAMES[stream]] += len(rows)
                self.buffers.add_ordered(stream, rows, sizes)
            return
        for stream in (STREAM_R, STREAM_S):
            sel = np.flatnonzero(on_time & (chunk.stream == stream))
            self.stats.input[STREAM_NAMES[stream]] += len(sel)
            rows = to_wire(dtype, chunk.id, chunk.ts, chunk.key, chunk.value, arrival, sel, chunk.terms)
            if self.router is not None:
                index, part = self.router.route(stream, rows)
                self.buffers.add(stream, rows[index], part)
            elif stream not in self.copied:  # the home of its pairs
                self.buffers.add(stream, rows, self.ranges.home(rows["key"]))
            else:  # a copy to every range that may hold partners: R's keys + (low, high), S's keys - (high, low)
                index, part = self.ranges.copies(
                    rows["key"], *copy_offsets(stream, *self.key_distance, home=len(self.copied) == 2)
                )
                self.buffers.add(stream, rows[index], part)

    def _late_reasons(self) -> np.ndarray:
        """The late output's reasons: [[R's own bound, R below W], [S's ...]] (`bound` says which value)."""
        if not self.streams:
            md = self.plan.join.max_delay / eventtime.PER_SECOND
            return np.array([[f"late: ts below max ts seen before minus join.max_delay ({md})"] * 2] * 2)
        return np.array(
            [
                [
                    f"late: ts below the largest ts of stream {name} before it minus streams.{name}.max_delay "
                    f"({s.max_delay / eventtime.PER_SECOND})",
                    f"late: ts below the join's watermark, which passed it while stream {name} was idle",
                ]
                for name, s in self.streams.items()
            ]
        )

    def _set_aside_late(self, chunk, late: np.ndarray, bound: np.ndarray, below_watermark: np.ndarray) -> None:
        self.stats.late += int(late.sum())
        reason = self.late_reasons[chunk.stream[late], below_watermark[late].astype(np.int64)]
        self.channels.write(SetAside(chunk, late, reason, bound[late]))

    def state(self) -> dict:
        """This desk's part of a checkpoint (the source's position and the files' counts are the shell's)."""
        return {
            "consumed": self.consumed,
            "lateness": self.lateness.state(),
            "key_ranges": None if self.ranges is None else self.ranges.bounds.tolist(),
        }

    def restore(self, m: dict) -> None:
        self.consumed = m["consumed"]
        self.lateness.restore(m["lateness"])
        if m["key_ranges"] is not None:
            self.ranges = KeyRanges(m["key_ranges"])

    def stream_summary(self, now: float) -> dict:
        """[streams]: per stream (R, S) its max_delay, idle_timeout, late tuples and idle periods (seconds since
        the run's start; W in seconds then), closing the periods still open; {} otherwise."""
        self.lateness.finish(now - self.origin)
        out = {}
        for x, (side, (name, s)) in enumerate(zip(STREAM_NAMES, self.streams.items())):
            idle = [
                {
                    "dispatcher": self.index,
                    "began_seconds": round(p["began"], 3),
                    "ended_seconds": round(p["ended"], 3),
                    "resumed": p["resumed"],
                    "watermark_seconds": eventtime.bound_seconds(p["watermark"]),
                    "watermark_ended_seconds": eventtime.bound_seconds(p["watermark_ended"]),
                }
                for p in self.lateness.periods
                if p["stream"] == side
            ]
            out[side] = {
                "stream": name,
                "max_delay": s.max_delay / eventtime.PER_SECOND,
                "idle_timeout": s.idle_timeout,
                "late": int(self.lateness.late[x]),
                "idle": finite(idle),
            }
        return out

    @staticmethod
    def merge_summaries(parts: list[dict]) -> dict:
        """The dispatchers' `stream_summary`s as one: late tuples summed, idle periods of all, by start."""
        return {
            side: {
                **s,
                "late": sum(p[side]["late"] for p in parts),
                "idle": sorted((i for p in parts for i in p[side]["idle"]), key=lambda i: i["began_seconds"]),
            }
            for side, s in parts[0].items()
        }
