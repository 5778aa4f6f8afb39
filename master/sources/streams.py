"""Two declared streams read side by side and merged into one arrival order (docs/input.md, `WatermarkMerge`); the
single file (`source.kind = "file"`) is two streams of one file (protocol.streams.file_streams), taken in its row
order without a merge (`RowOrder`) from a row feed (`RowFeed`): read by one thread (`ReadRows`); so is the generator
(protocol.streams.generator_streams), its drawn chunks taken by that thread as the file's checked batches; and the
single file pushed live (`source.kind = "zmq"`, protocol.streams.zmq_streams) is the other feed, its producers'
messages taken as they come (master.sources.live.LiveTuples).  The order takes tuples alike from either; each feed
keeps its own position, rejections and summary.

Each stream's files are read by a thread of their own, a bounded number of checked batches ahead (READ_AHEAD;
pyarrow decodes and checks outside the GIL: common.stream_file).  The merge orders the tuples by their stream's own
watermark (its running maximum of event time minus its max_delay; ties: R first, then row order), never by the raw
time: within a stream the order stays as written.  Lateness is judged within each stream
(master.state.lateness.Lateness), and every tuple on time within its stream is at or above every stream's watermark
before it in the merged order, so the join's watermark never makes it late: two files give what the interleaved
single file would, without a sort, and files concatenated stream after stream are not judged late against each
other.  The order depends on the data alone (not on batch sizes or thread timing), so a replay, a recovery and every
dispatcher of several see the same input.  A stream that is not files (master.sources.live.Live: ZeroMQ producers, or
a Kafka topic whose partitions are merged by their own watermarks first) hands its checked rows on as they come;
while it is quiet the other stream waits up to its watermark, until its idle_timeout.

Keys become the engine's int64 keys in that order (master.sources.keys); a tuple's `id` is its stream row, the reference
by which results gather the row's own columns from the payload log (protocol.payload), which the reader threads
write batch by batch before any tuple of the batch is handed on.  A recovery reads files again from their
start, which rebuilds the same codes and lists the rejected rows once more from an empty listing.  Live streams
are not read again (a Kafka topic's merge across partitions depends on when records come; ZeroMQ producers
resend only what no checkpoint holds): a checkpoint holds where each stream hands rows on (a topic's offsets,
master.sources.kafka_input; producers' positions, master.sources.live) and everything after that point that the
master has not taken yet -- the tuples merged and ready, those pending, the key dictionaries -- with the rows
rejected so far, and a recovery goes on from there.

The single file's tuples keep the file's id, key (int64) and value columns and its rows' order: its results hold the
fixed columns (protocol.output), so nothing goes to the payload log.  Its position is a file row (with the
duplicate check's state there): a recovery starts reading at that row (Parquet skips whole row groups) and its
rejected rows are listed as the position passes them, each once.  The generator's row is its tuple's place in the
drawn order: a recovery draws from the slice that holds the position (common.workload.GeneratorSource.skip).
Pushed live, the position is each producer's (the tuples of it taken): a recovery goes on from there, and what a
producer resends before it is dropped; the rejected messages are listed at the end (master.sources.producers).
Several dispatchers each bind their own endpoints for their own producers (master.sources.open_shard).

Several dispatchers (`share` = (index, k), both streams live) each take their own share instead of each reading
everything: dispatcher i reads its own partitions of a Kafka topic (master.sources.kafka_input) and what its own
producers push to a ZeroMQ stream (at the endpoint's port + i: master.sources.live.LiveStream), merges its own R
and S as above and numbers its own rows from i * ROW_BLOCK on (protocol.payload: ids unique, its payload segments
its own), and its keys are coded by their hashes (master.sources.keys), so equal keys get equal codes on every
dispatcher.  Each dispatcher's lateness, watermark and idleness are over its own rows; the slaves take the lowest
watermark over the dispatchers (master.punctuation), so the join waits for the slowest.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections import Counter
from types import MappingProxyType
from typing import TYPE_CHECKING, Mapping, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from master.sources.keys import KeyMapper
from master.sources.archive import named
from master.sources.live import Live, LiveTuples, open_live
from protocol import aggregation, eventtime
from protocol.checkpoint import record_tables, table_records
from protocol.config import ConfigError
from common.chunks import Chunk, InputError, Source, concat, empty, rewind, rows, terms_columns, terms_of
from protocol.payload import ROW_BLOCK, PayloadLog
from protocol.streams import KAFKA_COLUMNS
from common.stream_file import (
    BATCH_ROWS,
    EXTENSIONS,
    SidedBatch,
    SidedFile,
    StreamChecks,
    StreamInput,
    arrow_type,
    csv_types,
    first_schema,
    key_kinds,
    stream_files,
)
from common.workload import GeneratorSource

if TYPE_CHECKING:
    from protocol.plan import Generator, Plan, Stream


#: a stream's tuples pending in the merge, as a checkpoint holds them
PENDING = ("id", "ts", "key", "watermark")
#: checked batches (common.stream_file.BATCH_ROWS rows each) a reader thread keeps ready
READ_AHEAD = 4
#: the kinds of source that are the single file's two streams in one order (RowOrder)
ROW_KINDS = ("file", "generator", "zmq")


def _writable(a: np.ndarray, dtype) -> np.ndarray:
    """`a` as the compiled passes take it (common.read_passes): contiguous, writable, of `dtype` (no copy if so)."""
    return np.require(a, dtype, "CW")


def _tops_of(chunk: Chunk, tops: list) -> list:
    """`tops` (the highest id per stream, R's and S's; None: none yet) moved up past `chunk`'s tuples."""
    from common.read_passes import _tops

    high = np.array([t or 0 for t in tops], np.int64)
    has = np.array([t is not None for t in tops])
    _tops(_writable(chunk.stream, np.int8), _writable(chunk.id, np.int64), high, has)
    return [int(t) if h else None for t, h in zip(high, has)]


class ReadAhead:
    """A reader thread putting checked `batches` into its queue, READ_AHEAD of them ahead of the master (pyarrow
    decodes and checks outside the GIL), then None (an error: the exception, raised again in the master's thread
    when it comes to it); it gives up once `stop` is set (one event for a source's readers: they stop together)."""

    def __init__(self, name: str, batches, stop: threading.Event):
        self.queue: queue.Queue = queue.Queue(READ_AHEAD)
        self.stop = stop
        self.thread = threading.Thread(target=self._read, args=(batches,), daemon=True, name=f"reader-{name}")
        self.thread.start()

    def _put(self, item) -> bool:
        while not self.stop.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False

    def _read(self, batches) -> None:
        try:
            for batch in batches:
                if not self._put(batch):
                    return
            self._put(None)
        except Exception as e:  # noqa: BLE001 -- raised again in the master's thread by next_chunk
            self._put(e)

    def get(self):
        """The next checked batch, None at the end, or the reader's exception (blocks until it comes)."""
        return self.queue.get()


class StreamsSource(Source):
    """Two streams read by reader threads (ReadAhead: READ_AHEAD checked batches ahead each), or taken as live ones
    come, in one of two orders: `WatermarkMerge` for the `[streams.*]` of `plan` (protocol.streams), R first, merged
    by their watermarks; `RowOrder` for the single file's, the generator's or the pushed single file's two streams
    (protocol.streams.file_streams, generator_streams, zmq_streams: `in_rows`), taken in their one order.
    `StreamsSource(plan, ...)` is the one `plan` asks for.  Rejected rows go to `listing` (None: another dispatcher
    lists them, or the generator's, which rejects none); `share` = (index, k): dispatcher `index` of `k`."""

    in_rows: bool  #: the single file's one order (RowOrder), not a merge

    def __new__(cls, plan: Plan, listing=None, share: tuple[int, int] = (0, 1)):
        if cls is StreamsSource:
            cls = RowOrder if plan.source.kind in ROW_KINDS else WatermarkMerge
        return super().__new__(cls)

    def __init__(self, plan: Plan, listing=None, share: tuple[int, int] = (0, 1)):
        self.plan, self.listing, self.share = plan, listing, share
        self.accepted = 0

    def next_chunk(self, limit: int) -> Chunk | None:
        if limit < 1:
            raise ValueError(f"limit must be positive, got {limit}")
        return self._next(limit)

    def _next(self, limit: int) -> Chunk | None:
        """At most `limit` tuples in this order (`next_chunk`)."""
        raise NotImplementedError


class RowFeed(Protocol):
    """Where `RowOrder` takes the single file's checked batches from, in their one order, and what stands for its
    position: the file or the generator read ahead by a reader thread (`ReadRows`: a file row), or its tuples
    pushed by producers (master.sources.live.LiveTuples: each producer's position).  RowOrder takes the tuples
    the same way from either; the feed alone knows how to go back to a position and what it rejected."""

    @property
    def done(self) -> bool:
        """Nothing more will come (asked once `batch` has none)."""

    @property
    def reasons(self) -> Mapping[str, int]:
        """Rows (pushed: whole messages) rejected so far, by reason (metrics)."""

    @property
    def refused(self) -> Mapping[str, int]:
        """Pushed messages refused for want of source.token, by kind (metrics)."""

    def batch(self) -> SidedBatch | None:
        """The next checked batch, each tuple with its row; None: none now (pushed: nothing has come), or the end."""

    def took(self, part: Chunk, rows: np.ndarray) -> None:
        """`part` of the last batch (its tuples at `rows`) is taken: the position moves past it."""

    def list_passed(self, end: bool = False) -> None:
        """The rejected rows the position has passed (`end`: every tuple is taken, so all) go to the listing."""

    def position(self) -> dict:
        """Its place for a checkpoint (RowOrder adds the tuples taken)."""

    def seek(self, where: dict) -> None:
        """A recovery: back to a checkpoint's `position`."""

    def acknowledge(self, where: dict) -> None:
        """A checkpoint at `where` is complete."""

    def finish(self) -> dict:
        """Close it; its summary entries."""

    def merge(self, finished: list[dict]) -> dict:
        """Several dispatchers' `finish()` entries as one."""


class ReadRows:
    """The single file (or the generator) as `RowOrder`'s feed: one reader thread (ReadAhead) for both streams, its
    position a file row (with the duplicate check's state there), so a recovery reads on from that row; the rows
    it rejected wait until the position passes them, then go to `listing` (None: none are listed)."""

    refused: Mapping[str, int] = MappingProxyType({})  #: nothing is pushed: nothing is refused

    def __init__(self, plan: Plan, spec: Stream, listing=None):
        self.plan, self.spec, self.listing = plan, spec, listing
        self._open()

    def _open(self, start: int = 0, max_id: tuple = (None, None)) -> None:
        """Read from row `start` on (a recovery: with the duplicate check's state there)."""
        self._stop = threading.Event()
        if self.plan.source.kind == "generator":
            self._reader = ReadAhead("generator", _drawn(self.plan.generator, start), self._stop)
        else:
            window = self.plan.source.duplicate_window
            file = SidedFile(self.spec.path, window, start, max_id, self.spec.time_unit)
            self._reader = ReadAhead("file", file, self._stop)
        self._end_row: int | None = None  #: one past the last row of the batches read
        self._waiting: list[pa.Table] = []  #: rejections of batches read, not yet passed by the position
        self.row, self._max_id, self.done = start, list(max_id), False

    def batch(self) -> SidedBatch | None:
        """The next checked batch; None at the end (and after an error, which is raised once)."""
        if self.done:
            return None
        item = self._reader.get()
        if isinstance(item, Exception):
            self.done = True
            raise item
        if item is None:
            self.done = True
            return None
        self._end_row = item.end_row
        if item.rejected is not None:
            self._waiting.append(item.rejected)
        return item

    def took(self, part: Chunk, rows: np.ndarray) -> None:
        self._max_id = _tops_of(part, self._max_id)
        self.row = int(rows[-1]) + 1

    def list_passed(self, end: bool = False) -> None:
        if end and self._end_row is not None:
            self.row = self._end_row  # every row read is passed: the trailing rejections too
        keep = []
        for t in self._waiting:
            passed = pc.less_equal(t["row"], self.row)  # 1-based rows: row <= position is passed
            n = pc.sum(passed).as_py() or 0
            if self.listing is not None and n:
                self.listing.add(t.filter(passed))
            if n < t.num_rows:
                keep.append(t.filter(pc.invert(passed)))
        self._waiting = keep

    @property
    def reasons(self) -> Mapping[str, int]:
        if self.listing is None:
            return {}
        self.list_passed()
        return self.listing.reasons

    def position(self) -> dict:
        """The row after the last tuple taken, the duplicate check's state there and the listing's files and
        rows (flushed)."""
        if self.listing is not None:
            self.list_passed()
            self.listing.flush()
        return {
            "row": self.row,
            "max_id": list(self._max_id),
            "rejected_files": self.listing.files if self.listing else 0,
            "rejected_rows": self.listing.rows if self.listing else 0,
        }

    def seek(self, where: dict) -> None:
        """Read on from the checkpoint's row, its rejected rows listed up to it."""
        self._close()
        self._open(where["row"], tuple(where["max_id"]))
        if self.listing is not None:
            self.listing.roll_back(where["rejected_files"], where["rejected_rows"])

    def acknowledge(self, where: dict) -> None:
        """Nothing to tell: a file is read again from a checkpoint's row."""

    def _close(self) -> None:
        self._stop.set()
        self._reader.thread.join()

    def finish(self) -> dict:
        self._close()
        if self.listing is None:
            return {}
        self.list_passed()
        self.listing.flush()
        return {"rejected": self.listing.rows}

    @staticmethod
    def merge(finished: list[dict]) -> dict:
        """Every dispatcher reads the whole file and the first lists its rejections: its entries are the run's."""
        return finished[0]


class RowOrder(StreamsSource):
    """The single file's two streams (or the generator's, or the pushed single file's) in their one order, as its
    `feed` (RowFeed) hands them on: no merge, one watermark over both; neither stream holds the other back
    (`ended`: never)."""

    in_rows = True

    def __init__(self, plan: Plan, listing=None, share: tuple[int, int] = (0, 1)):
        super().__init__(plan, listing, share)
        kind = plan.source.kind
        self.specs = {s.name: s for s in plan.inputs}
        self.feed: RowFeed = (
            LiveTuples(plan, named("zmq-rejected", *share))
            if kind == "zmq"
            else ReadRows(plan, plan.inputs[0], listing)
        )
        self._ready, self._taken = empty(), 0  #: the batch being taken, and how much of it is
        self._ready_rows = np.empty(0, np.int64)  #: the row of each of its tuples
        self._done = False  #: the feed's end, as it said when it last had no batch

    def _next(self, limit: int) -> Chunk | None:
        """The next tuples in the feed's order; its position moves past the last one."""
        parts, room = [], limit
        while room > 0:
            if self._taken >= len(self._ready.ts):
                if self._done or not self._next_batch():
                    break
                continue
            n = min(room, len(self._ready.ts) - self._taken)
            part = rows(self._ready, self._taken, self._taken + n)
            self.feed.took(part, self._ready_rows[self._taken : self._taken + n])
            self._taken += n
            parts.append(part)
            room -= n
        if not parts:
            if not self._done:
                return empty()  # pushed live: nothing has come yet
            self.feed.list_passed(end=True)
            return None
        self.accepted += limit - room
        self.feed.list_passed()
        return concat(parts)

    def _next_batch(self) -> bool:
        """The feed's next checked batch to take from; False at its end (pushed live: or none yet)."""
        item = self.feed.batch()
        if item is None:
            self._done = self.feed.done
            return False
        self._ready, self._ready_rows, self._taken = item.chunk, item.rows, 0
        return True

    @property
    def reasons(self) -> dict[str, int]:
        """Rejected rows (pushed: rejected messages), by reason."""
        return dict(self.feed.reasons)

    @property
    def refused(self) -> Mapping[str, int]:
        """Pushed live: messages refused for want of the token, by kind."""
        return self.feed.refused

    def position(self) -> dict:
        """The feed's position and the tuples taken, so a recovery goes on from there."""
        return {**self.feed.position(), "accepted": self.accepted}

    def acknowledge(self, position: dict | None) -> None:
        """A checkpoint at `position` is complete: pushed live, producers are told what it holds of theirs."""
        self.feed.acknowledge(position)

    def seek(self, where: dict) -> None:
        """A recovery: the feed goes back to the checkpoint's position (a file is read on from its row; pushed,
        each producer goes on from its own, the sockets staying bound)."""
        self.feed.seek(where)
        self._ready, self._ready_rows, self._taken = empty(), np.empty(0, np.int64), 0
        self.accepted, self._done = where["accepted"], self.feed.done

    def finish(self) -> dict:
        return self.feed.finish()

    def merge(self, finished: list[dict]) -> dict:
        """Several dispatchers' `finish()` entries as one, as the feed merges them (pushed live: their producers',
        each its own)."""
        return self.feed.merge(finished)


class WatermarkMerge(StreamsSource):
    """The `[streams.*]` of `plan`, R first, each its files, live producers or a Kafka topic, merged by their own
    watermarks (the module's docstring says how)."""

    in_rows = False

    def __init__(self, plan: Plan, listing=None, share: tuple[int, int] = (0, 1)):
        super().__init__(plan, listing, share)
        self.own_rows = share[1] > 1
        self._records: list[np.ndarray] = []
        self._filtered_before = [0, 0]  #: live streams: the rows filtered before the checkpoint recovered from
        self.specs = {s.name: s for s in plan.streams}
        self._delays = [s.max_delay for s in self.specs.values()]  #: R's, S's, microseconds
        self._idle_timeouts = [s.idle_timeout for s in self.specs.values()]  #: R's, S's, seconds
        self.files, self.declared, missing = {}, {}, []
        for name, s in self.specs.items():  # every path that is not there is named at once
            try:
                if s.endpoint or s.kafka:
                    self.declared[name] = _declared(name, s)
                else:
                    self.files[name] = stream_files(name, s.path)
            except InputError as e:
                missing.append(str(e))
        if missing:
            raise InputError("; ".join(missing))
        firsts = {
            name: self.declared[name]
            if name in self.declared
            else first_schema(self.files[name][0], csv_types(name, self.specs[name], self.files[name]))
            for name in self.specs
        }
        self.kinds = key_kinds(self.specs, firsts)
        if self.kinds != ["int"] and plan.join.predicate != "equal":
            raise ConfigError(
                f'join.predicate = "{plan.join.predicate}" compares key values as integers, but '
                f"the streams' key {' + '.join(next(iter(self.specs.values())).key)} is "
                f'{" + ".join(self.kinds)}: use a single integer key column, or predicate = "equal"'
            )
        first = share[0] * ROW_BLOCK if share[1] > 1 else 0  #: the first stream row this dispatcher numbers
        self.log = PayloadLog(self.plan.output.path, str(os.getpid()), (first, first + ROW_BLOCK))
        #: both streams are live (Kafka topics, ZeroMQ producers): a checkpoint holds the streams' places
        #: (`position`), not a count
        self.placed = all(s.kafka or s.endpoint for s in self.specs.values())
        self._live: list[Live | None] = [None, None]
        self._open()

    def _open(self, starts: list | None = None) -> None:
        """Start reading both streams from their first rows (a recovery of files starts again here), or live
        streams from a checkpoint's places (`starts`, per side; a ZeroMQ stream keeps its bound sockets)."""
        window = self.plan.source.duplicate_window
        query = self.plan.query
        queries = [query.stream(side) if query is not None else None for side in (0, 1)]
        inputs = [
            StreamChecks(
                name, s, self.kinds, window, self.declared[name], s.endpoint or ", ".join(s.kafka.topics), query
            )
            if name in self.declared
            else StreamInput(name, s, self.kinds, window, self.files[name], query)
            for (name, s), query in zip(self.specs.items(), queries)
        ]
        self._check_columns(inputs)
        self._checks = inputs
        for inp in inputs if self.share[1] > 1 else ():  # live streams only: each dispatcher numbers its own rows
            inp.row = self.log.block[0]
        self.log.forget()
        for side, inp in enumerate(inputs):
            self.log.write_schema(side, inp.schema, _tuple_fields(inp, self.kinds))
        self.mapper = KeyMapper(self.kinds, hashed=self.share[1] > 1)
        self._stop = threading.Event()
        #: per side: a live stream (master.sources.live), or None and the reader of its files
        self._live = [
            open_live(self.plan, side, inp, self.declared[inp.name], starts and starts[side], self.share, opened)
            if inp.name in self.declared
            else None
            for (side, inp), opened in zip(enumerate(inputs), self._live)
        ]
        self._readers = [
            ReadAhead(inp.name, self._logged(self.log, side, inp), self._stop) if live is None else None
            for (side, inp), live in zip(enumerate(inputs), self._live)
        ]
        #: per side, read and not merged: (id, ts, key, the stream's watermark: running max - max_delay, terms)
        self._pending: list[tuple | None] = [None, None]
        self._running = [eventtime.NEG_INF, eventtime.NEG_INF]  #: per side, the largest ts read
        self._done = [False, False]
        self._end_at: list[int | None] = [None, None]  #: per side, once known: the position after its last tuple
        self._ready, self._taken = empty(), 0
        self.rows_taken = [0, 0]  #: per side: every row below this one has been taken (their payload may go)

    def _check_columns(self, inputs: list[StreamInput]) -> None:
        """The results' column names are distinct, CSV results can hold every column (no nested types), and
        `[aggregate]` names result columns of the kinds it needs."""
        names = {
            "delay": "the production delay",
            "kind": "the row's kind (outer joins)",
            **{c: f"the late rows' {c}" for c in ("stream", "reason", "bound")},
        }
        for inp in inputs:
            for field in inp.schema:
                name = inp.spec.prefix + field.name
                if name in names:
                    raise ConfigError(
                        f"streams.{inp.name}.prefix: results would have two columns {name!r} "
                        f"({names[name]} and {inp.name}'s {field.name}): choose other prefixes"
                    )
                names[name] = f"{inp.name}'s {field.name}"
                if self.plan.output.format == "csv" and pa.types.is_nested(field.type):
                    raise ConfigError(
                        f'output.format = "csv": column {field.name} of streams.{inp.name} is '
                        f"{field.type}, which CSV cannot hold: use Parquet, or leave it out of "
                        f"streams.{inp.name}.payload"
                    )
        if self.plan.aggregate.enabled:
            fields = [pa.field(inp.spec.prefix + f.name, f.type) for inp in inputs for f in inp.schema]
            if self.plan.join.type != "inner":
                fields.append(pa.field(aggregation.KIND, pa.string()))
            aggregation.check_columns(self.plan.aggregate.view, pa.schema(fields), ConfigError)

    @staticmethod
    def _logged(log: PayloadLog, side: int, inp: StreamInput):
        """The stream's checked batches, each one's columns written to the payload log before it goes on."""
        for batch in inp:
            log.write(side, batch.rows, batch.ts, batch.columns)
            yield batch._replace(columns=None)

    def _pull(self, side: int) -> None:
        """The next checked batch(es) of a stream into its pending tuples (its rejections into the listing); a
        live stream's that have arrived, if any."""
        live = self._live[side]
        if live is None:
            self._take(side, self._readers[side].get())
            return
        for batch in live.batches():
            self.log.write(side, batch.rows, batch.ts, batch.columns)
            self._take(side, batch._replace(columns=None))
        if live.done:
            self._done[side] = True

    def _close(self) -> None:
        """The file readers stop (live streams stay open: a recovery goes on with their sockets)."""
        self._stop.set()
        for reader in self._readers:
            if reader is not None:
                reader.thread.join()

    def _idle(self, side: int) -> bool:
        """A live stream without a message for its idle_timeout (> 0): it no longer holds the other back."""
        live, timeout = self._live[side], self._idle_timeouts[side]
        return live is not None and timeout > 0 and time.monotonic() - live.last_message > timeout

    def _take(self, side: int, item) -> None:
        if isinstance(item, Exception):
            self._done = [True, True]
            raise item
        if item is None:  # the stream's end
            self._done[side] = True
            return
        if item.rejected is not None and self.listing is not None:
            self.listing.add(item.rejected)
        if not len(item.ts):
            return
        from common.read_passes import _watermarks

        ts = _writable(item.ts, np.int64)
        marks = np.empty(len(ts), np.int64)
        self._running[side] = int(_watermarks(ts, self._running[side], self._delays[side], marks))
        keys = _writable(self.mapper.keys(item.keys), np.int64)
        part = (_writable(item.rows, np.int64), ts, keys, marks, item.terms)
        old = self._pending[side]
        self._pending[side] = part if old is None else tuple(np.concatenate(c) for c in zip(old, part))

    def _merge(self) -> bool:
        """Append the next run of merged tuples to the ready ones; False when none can be merged now (at the
        end of both streams, or waiting for a live one)."""
        for side in (0, 1):
            while not self._done[side] and self._pending[side] is None:
                self._pull(side)
                if self._live[side] is not None:
                    break  # nothing has come: it waits
        if self._pending == [None, None]:
            return False
        # a stream that has ended, or a live one idle for its idle_timeout, holds nothing back; otherwise its later
        # tuples have a watermark at least its last one's (pending, or read: a live stream waiting): R goes up to
        # that of S (ties go to R), S below that of R
        last = [
            p[3][-1]
            if p is not None
            else None
            if self._done[side] or self._idle(side)
            else self._running[side] - self._delays[side]
            for side, p in enumerate(self._pending)
        ]
        parts = []
        for side in (0, 1):
            p = self._pending[side]
            if p is None:
                continue
            other = last[1 - side]
            n = len(p[3]) if other is None else int(np.searchsorted(p[3], other, "right" if side == 0 else "left"))
            if n:
                parts.append((side, [c[:n] for c in p]))
                self._pending[side] = None if n == len(p[3]) else tuple(c[n:] for c in p)
        if not parts:
            return False
        rest = rows(self._ready, self._taken)
        if len(parts) == 1:  # one stream's run: in order already
            s, (rows_, ts, keys, _, terms) = parts[0]
            self._ready = concat([rest, Chunk(np.full(len(ts), s, np.int8), rows_, ts, keys, np.zeros(len(ts)), terms)])
        else:  # two runs merged by one compiled pass, after what is left of the ready tuples
            from common.read_passes import _merge

            (_, r), (_, s) = parts
            m, n = len(rest.ts), len(r[3]) + len(s[3])
            out = [np.empty(m + n, c.dtype) for c in rest[:4]]
            for o, c in zip(out, rest[:4]):
                o[:m] = c
            source = np.empty(n, np.int64)
            _merge(*r[:4], *s[:4], *out, source, m)
            terms = np.concatenate([r[4], s[4]])[source]
            if m:  # an empty chunk's terms may be narrower (common.chunks.concat)
                terms = np.concatenate([rest.terms, terms])
            self._ready = Chunk(*out, np.zeros(m + n), terms)
        self._taken = 0
        return True

    def _note_ends(self) -> None:
        """A stream that has ended (its files read, or a live one's producers or partitions done) with nothing of
        it pending: its last tuple is the last of it ready, if any; from that position on it holds nothing back
        (`ended`)."""
        for side in (0, 1):
            if self._done[side] and self._pending[side] is None and self._end_at[side] is None:
                rest = np.flatnonzero(self._ready.stream[self._taken :] == side)
                self._end_at[side] = self.accepted + (int(rest[-1]) + 1 if len(rest) else 0)

    def _next(self, limit: int) -> Chunk | None:
        while len(self._ready.ts) - self._taken < limit and self._merge():
            pass
        self._note_ends()
        n = min(limit, len(self._ready.ts) - self._taken)
        if n == 0:
            return None if all(self._done) and self._pending == [None, None] else empty()
        chunk = rows(self._ready, self._taken, self._taken + n)
        self._taken += n
        self.rows_taken = [top + 1 for top in _tops_of(chunk, [t - 1 for t in self.rows_taken])]
        self.accepted += n
        return chunk

    @property
    def filtered(self) -> dict[str, int]:
        """Rows the query's filters dropped, by stream (R, S); live streams count on from a checkpoint's."""
        return {side: before + c.filtered for side, before, c in zip("RS", self._filtered_before, self._checks)}

    def ended(self) -> list[bool]:
        """Per side (R, S): every tuple of that stream has been taken (known once the merge has seen its end)."""
        return [end is not None and self.accepted >= end for end in self._end_at]

    @property
    def reasons(self) -> dict[str, int]:
        """Rejected rows, and what live streams set aside themselves, by reason."""
        if self.listing is None:
            return {}
        return dict(sum((Counter(x.reasons) for x in self._live if x is not None), Counter(self.listing.reasons)))

    def partitions(self) -> list[dict]:
        return [
            {"stream": name, **row}
            for name, live in zip(self.specs, self._live)
            if live is not None
            for row in live.partition_metrics()
        ]

    def position(self) -> dict:
        """Files: the tuples taken.  Live streams: each stream's place and the state after it (JSON here, its
        arrays in `records`)."""
        if not self.placed:
            return {"accepted": self.accepted}
        places = [live.position() for live in self._live]
        pending = [
            pa.table(dict(zip(PENDING, p or [np.empty(0, np.int64)] * 4)) | terms_columns(p and p[4]))
            for p in self._pending
        ]
        ready = rows(self._ready, self._taken)
        ready = pa.table(dict(zip(Chunk._fields[:-1], ready)) | terms_columns(ready.terms))
        self._records = table_records([*pending, ready, self.mapper.dictionaries(), *(r for _, r in places)])
        if self.listing is not None:
            self.listing.flush()
        return {
            "accepted": self.accepted,
            "rejected_files": self.listing.files if self.listing else 0,
            "rejected_rows": self.listing.rows if self.listing else 0,
            "streams": [place for place, _ in places],
            "rows_taken": list(self.rows_taken),
            "running": list(self._running),
            "done": list(self._done),
            "end_at": list(self._end_at),
            "pending": [p is not None for p in self._pending],
            "filtered": list(self.filtered.values()),
        }

    def acknowledge(self, position: dict | None) -> None:
        """A checkpoint at `position` is complete: Kafka topics commit its offsets to their groups, live streams'
        producers are told what it holds of theirs."""
        if position is not None and "streams" in position:
            for live, place in zip(self._live, position["streams"]):
                live.acknowledge(place)

    def records(self) -> list[np.ndarray]:
        """The arrays of the last `position` (Kafka topics), as byte records for the checkpoint's part (once)."""
        out, self._records = self._records, []
        return out

    def seek(self, where: dict) -> None:
        """A recovery.  Files: read the input again from its start to the checkpoint's tuple (the key codes are
        built again on the way), listing the rejected rows again from an empty listing.  Kafka topics: each
        stream goes on from its place, with the state after it as it was (`position`, and its arrays
        `where["records"]`); the payload log's segments of rows after the places go."""
        self._close()
        if self.listing is not None:  # live streams: the rows rejected before their places stay listed
            self.listing.roll_back(where.get("rejected_files", 0), where.get("rejected_rows", 0))
        if "streams" not in where:
            self.accepted = 0
            self._open()
            rewind(self, where["accepted"])
            return
        *pending, ready, keys, recent_r, recent_s = record_tables(where["records"])
        self._open(list(zip(where["streams"], (recent_r, recent_s))))
        self.mapper.restore(keys)
        self._pending = [
            (*(t[c].to_numpy().copy() for c in PENDING), terms_of(t)) if had else None
            for t, had in zip(pending, where["pending"])
        ]
        ready_columns = (ready[c].to_numpy().copy() for c in Chunk._fields[:-1])  # writable: numba
        self._ready, self._taken = Chunk(*ready_columns, terms_of(ready)), 0
        self._running, self._done = list(where["running"]), list(where["done"])
        self._end_at, self.rows_taken = list(where["end_at"]), list(where["rows_taken"])
        self.accepted = where["accepted"]
        self._filtered_before = list(where.get("filtered", [0, 0]))
        for side, place in enumerate(where["streams"]):
            self.log.resume(side, place["row"], self._running[side])

    def finish(self) -> dict:
        self._close()
        live = [x.finish() for x in self._live if x is not None]
        names = {side: name for side, name in zip("RS", self.specs)}
        out: dict = {
            "streams": names,
            "payload_log_bytes": self.log.bytes,
            "payload_log_removed_bytes": self.log.removed_bytes,
            "payload_log_peak_bytes": self.log.peak_bytes,
            "payload_log_cpu_seconds": round(self.log.seconds, 3),
            **({"live_streams": dict(zip((n for n in self.specs if n in self.declared), live))} if live else {}),
        }
        if self.plan.query is not None:
            out["filtered"] = self.filtered
        if self.listing is None:
            return out
        self.listing.flush()
        out["rejected"] = self.listing.rows + sum(sum(x["rejected_by_reason"].values()) for x in live)
        if self.mapper.coded:
            out["keys"] = {"distinct": self.mapper.distinct, "bytes": self.mapper.nbytes}
        return out

    def merge(self, finished: list[dict]) -> dict:
        """Several dispatchers' `finish()` entries (each its own Kafka partitions, its own producers) as one: counts
        added, peaks the largest, each live stream's entries as its kind merges them; `keys.distinct` the most one
        dispatcher coded."""
        first, live = finished[0], dict(zip(self.specs, self._live))
        out = {
            **first,
            **{k: sum(f[k] for f in finished) for k in ("payload_log_bytes", "payload_log_removed_bytes", "rejected")},
            "payload_log_cpu_seconds": round(sum(f["payload_log_cpu_seconds"] for f in finished), 3),
            "payload_log_peak_bytes": max(f["payload_log_peak_bytes"] for f in finished),
            "live_streams": {
                name: live[name].merged([f["live_streams"][name] for f in finished]) for name in first["live_streams"]
            },
        }
        if "filtered" in first:  # files: every dispatcher reads them all; topics and producers: each its own rows
            out["filtered"] = {
                side: sum(f["filtered"][side] for f in finished) if self.placed else first["filtered"][side]
                for side in "RS"
            }
        if "keys" in first:
            out["keys"] = {
                "distinct": max(f["keys"]["distinct"] for f in finished),
                "bytes": sum(f["keys"]["bytes"] for f in finished),
            }
        return out


def _tuple_fields(inp: StreamChecks, kinds: list[str]) -> dict[str, str]:
    """The output columns of stream `inp` whose values are its tuples' fields (protocol.payload.TUPLE_FIELDS), so
    results take them from their pairs: its time; its stream row (`row`, without an id); its key, if one integer
    column of int64 taken as it is (the tuples' key is its value, master.sources.keys; CSV text is parsed
    otherwise than cast)."""
    spec = inp.spec
    fields = {spec.time: "ts"} | ({} if spec.id else {"row": "id"})
    csv = any(EXTENSIONS[f.suffix.lower()] == "csv" for f in getattr(inp, "files", ()))
    if kinds == ["int"] and inp.schema.field(spec.key[0]).type == pa.int64() and not csv:
        fields[spec.key[0]] = "key"
    return fields


def _drawn(generator: Generator, start: int):
    """The generator's tuples from tuple `start` on as the single file's checked batches (nothing to reject): a
    tuple's row is its place in the drawn order, so a position and a recovery are the file's."""
    source = GeneratorSource(generator)
    source.skip(start)
    while (chunk := source.next_chunk(BATCH_ROWS)) is not None:
        rows_ = np.arange(start, start + len(chunk.ts), dtype=np.int64)
        yield SidedBatch(start, start + len(chunk.ts), chunk, rows_, None)
        start += len(chunk.ts)


def _declared(name: str, spec: Stream) -> pa.Schema:
    """A live stream's declared columns (protocol.streams `schema`) as an Arrow schema; a Kafka stream's also the
    records' own columns it names as key, time, id or payload."""
    named = {*spec.key, spec.time, spec.id, *(spec.payload if spec.payload != "*" else [])}
    own = {c: t for c, t in KAFKA_COLUMNS.items() if c in named} if spec.kafka else {}
    try:
        return pa.schema([(column, arrow_type(text)) for column, text in {**spec.schema, **own}.items()])
    except ValueError as e:
        raise ConfigError(f"streams.{name}.schema: {e}") from None
