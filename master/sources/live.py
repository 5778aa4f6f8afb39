"""Streams fed live by ZeroMQ producers: a declared stream (`[streams.NAME] endpoint = ...`, `LiveStream`) whose
producers PUSH Arrow record batches, and the single file's two streams (`source.kind = "zmq"`, `LiveTuples`) whose
producers PUSH its tuples.

A BATCH message (protocol.wire) carries one record batch of the stream's own columns in Arrow's IPC stream
format; the stream declares its columns and their types (`schema`), so the payload log's schema, the key kinds
and the checks are fixed before the first message.  A message is taken whole or rejected whole: one that is
not an Arrow batch, lacks a declared column or holds a column that does not become its declared type is
counted by reason and listed in `rejected/zmq-rejected-<R|S>.*`; single bad cells are rejected rows, as in a
file (common.stream_file.StreamChecks).  Producers, the token, END, the rejected messages and the
acknowledgements are master.sources.producers'; the stream ends after `producers` END messages.  Checkpoints: the
stream's place (`position`) is each
producer's position with the next stream row and the duplicate-id check's state there, and the rows handed on
after it are in the checkpoint's merge state (master.sources.streams); once a checkpoint is complete its
positions go out on the stream's `ack_endpoint`, so producers (`control.produce --stream --ack-endpoint`) keep
only what no checkpoint holds and resend it to a recovered run, which drops what it already has.
`Live` is what master.sources.streams asks of any stream that is not files: this one, or a Kafka topic
(master.sources.kafka_input).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Mapping, Protocol

import numpy as np
import pyarrow as pa

from common.chunks import Chunk, no_terms
from master.sources.archive import named
from master.sources.producers import Producers
from protocol.access import dispatcher_endpoint
from protocol import wire
from common.stream_file import SidedBatch, StreamBatch, StreamChecks

if TYPE_CHECKING:
    from protocol.plan import Plan, Stream

#: the largest message a producer may send, per row the header announces (Arrow rows of a few columns are tens
#: of bytes; long text payloads need `source.max_message_tuples` lowered)
ROW_BYTES = 1024


class Live(Protocol):
    """A declared stream that is not files: master.sources.streams asks it for the rows that have come (it never
    blocks) and lets it go idle when it is quiet.  A ZeroMQ stream (`LiveStream`) or a Kafka topic
    (master.sources.kafka_input.KafkaStream)."""

    last_message: float  #: when rows of it last came (time.monotonic: idleness)
    reasons: Mapping[str, int]  #: what it set aside itself (messages, records), by reason (metrics)

    @property
    def done(self) -> bool:
        """It has ended: nothing more will come."""

    def batches(self) -> list[StreamBatch]:
        """Its checked rows that have come (none: nothing now), numbered as its stream rows."""

    def finish(self) -> dict:
        """Close it; its entry in summary.json's `live_streams`, with `rejected_by_reason`."""

    @staticmethod
    def merged(entries: list[dict]) -> dict:
        """Several dispatchers' `finish()` entries of the stream (each its own partitions or producers) as one."""

    def partition_metrics(self) -> list[dict]:
        """Per partition of a partitioned stream (Kafka): topic, partition, records, bytes, lag; else none."""


def open_live(
    plan: Plan,
    side: int,
    checks: StreamChecks,
    declared: pa.Schema,
    start=None,
    share: tuple[int, int] = (0, 1),
    opened: Live | None = None,
) -> Live:
    """The live stream `checks.spec` names, on side `side` (0 = R), its rows checked by `checks`, from a
    checkpoint's place `start` (None: from its beginning); dispatcher `share[0]` of `share[1]` reads a Kafka
    topic's own partitions, or a ZeroMQ stream's own producers.  A ZeroMQ stream already `opened` (bound) goes on
    from `start` itself."""
    if checks.spec.kafka:
        from master.sources.kafka_input import KafkaStream  # librdkafka: only for a Kafka stream

        return KafkaStream(plan, side, checks, declared, start, share)
    live = opened if isinstance(opened, LiveStream) else LiveStream(plan, side, checks.spec, checks, declared, share)
    if start is not None:
        live.resume(checks, *start)
    return live


class LiveTuples(Producers):
    """The single file's two streams pushed live (`source.kind = "zmq"`, protocol.streams.zmq_streams): TUPLES
    messages of its columns, validated whole by protocol.wire, handed to master.sources.streams.RowOrder in their
    arrival order as the file's checked batches (a tuple's row: its place in that order), as a file's reader
    thread hands them on (its RowFeed).  A producer's position moves as the master takes its tuples (`took`), so
    a checkpoint between two tuples of one message holds it exactly."""

    def __init__(self, plan: Plan, rejected_stem: str):
        super().__init__(plan, rejected_stem)
        self.row = 0  #: the arrival row of the next tuple
        self._from: bytes | None = None  #: the producer of the batch last handed on (None: anonymous)

    def batch(self) -> SidedBatch | None:
        """The next message's new tuples as a checked batch; None: none has come."""
        self._repeat_ack()
        for msg, _ in self._messages(wire.Frame.TUPLES):
            if not len(msg.rows):
                continue
            r = msg.rows[self._skip(msg.origin, len(msg.rows)) :]
            if len(r):
                self._from = None if msg.origin is None else bytes(msg.origin["producer"])
                self.tuples += len(r)
                self.held_peak = max(self.held_peak, len(r))
                first, self.row = self.row, self.row + len(r)
                chunk = Chunk(*(r[c].copy() for c in Chunk._fields[:-1]), no_terms(len(r)))
                return SidedBatch(first, self.row, chunk, np.arange(first, self.row, dtype=np.int64), None)
        return None

    def took(self, part: Chunk, rows: np.ndarray) -> None:
        """`part` of the last batch was taken: its producer's position moves past it."""
        if self._from is not None:
            self.taken[self._from] += len(part.ts)

    def list_passed(self, end: bool = False) -> None:
        """Nothing to list as the tuples are taken: the rejected messages are listed at the end (`finish`)."""

    def position(self) -> dict:
        """Each producer's position (a checkpoint's part)."""
        return self.producers_position()

    def finish(self) -> dict:
        """The summary's entries: the messages rejected and the producers' counts (`zmq_ingest`)."""
        ingest = super().finish()
        return {"rejected": sum(self.reasons.values()), "zmq_ingest": ingest}

    @staticmethod
    def merge(finished: list[dict]) -> dict:
        """Several dispatchers' `finish()` entries (each its own producers) as one."""
        return {
            "rejected": sum(f["rejected"] for f in finished),
            "zmq_ingest": Producers.merged([f["zmq_ingest"] for f in finished]),
        }


class LiveStream(Producers):
    """Stream `checks.name` (side `side`, 0 = R) on its `endpoint`, rows checked by `checks` against `declared`;
    dispatcher `share[0]` of `share[1]` binds its own endpoint and ack_endpoint, at their ports + `share[0]`
    (protocol.access.dispatcher_endpoint), for its own producers, as the ZeroMQ source's do."""

    record_bytes = ROW_BYTES

    def __init__(
        self, plan: Plan, side: int, spec: Stream, checks: StreamChecks, declared: pa.Schema, share=(0, 1)
    ) -> None:
        ends = {"endpoint": spec.endpoint, "ack_endpoint": spec.ack_endpoint}
        own = {key: e and dispatcher_endpoint(e, share[0]) for key, e in ends.items()}
        super().__init__(
            replace(plan, source=replace(plan.source, **own, producers=spec.producers, idle_timeout=0.0)),
            named(f"zmq-rejected-{'RS'[side]}", *share),
            f"streams.{checks.name}",
        )
        self.checks, self.declared = checks, declared

    def partition_metrics(self) -> list[dict]:
        return []  # producers push: no partitions, no lag to count

    def position(self) -> tuple[dict, pa.Table]:
        """Its place (a checkpoint's part): each producer's position, the next stream row and the duplicate-id
        check's state there (JSON, and the check's recent ids)."""
        place, recent = self.checks.place()
        return {**self.producers_position(), **place}, recent

    def resume(self, checks: StreamChecks, where: dict, recent: pa.Table) -> None:
        """Back to a `position`, its rows checked by `checks` from there (a recovery; the sockets stay bound)."""
        self.checks = checks
        self.seek(where)
        checks.resume(where, recent)

    def batches(self) -> list[StreamBatch]:
        """The next checked batch that has arrived (none: nothing now).  One at a time: the merge asks when it
        needs more, so the rest waits in the sockets and its producers feel the backpressure (and keep what no
        checkpoint holds yet, with acknowledgements)."""
        self._repeat_ack()
        for msg, frames in self._messages(wire.Frame.BATCH):
            got = self._table(msg)
            if isinstance(got, wire.Rejection):
                self._reject(got, sum(len(f) for f in frames))
                continue
            table, origin = got
            table = table.slice(self._skip(origin, table.num_rows))
            if origin is not None:  # the producer's position moves past the rows taken
                self.taken[bytes(origin["producer"])] += table.num_rows
            self.tuples += table.num_rows
            self.held_peak = max(self.held_peak, table.num_rows)
            if table.num_rows:
                return [self.checks.checked(table)]
        return []

    def _table(self, msg: wire.Message) -> tuple[pa.Table, object] | wire.Rejection:
        """The message's record batch in the declared columns and types, or why not."""
        try:
            table = pa.ipc.open_stream(pa.py_buffer(msg.arrow)).read_all()
        except (pa.ArrowException, OSError) as e:
            return wire.Rejection("arrow", str(e).splitlines()[0], msg.origin)
        if table.num_rows > self.max_tuples:
            return wire.Rejection("too_large", f"{table.num_rows} rows > {self.max_tuples}", msg.origin, table.num_rows)
        columns = []
        for field in self.declared:
            if field.name not in table.column_names:
                return wire.Rejection(
                    "columns",
                    f"no column {field.name} (columns: {', '.join(table.column_names)})",
                    msg.origin,
                    table.num_rows,
                )
            try:
                columns.append(table[field.name].cast(field.type))
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
                return wire.Rejection(
                    "columns",
                    f"column {field.name} of type {table[field.name].type} does not "
                    f"become {field.type}: {str(e).splitlines()[0]}",
                    msg.origin,
                    table.num_rows,
                )
        return pa.Table.from_arrays(columns, schema=self.declared), msg.origin
