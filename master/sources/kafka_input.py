"""A declared stream read from Kafka (`[streams.NAME] kafka = {...}`, docs/input.md#kafka-topics).

Reading.  confluent-kafka (librdkafka) with every partition of the topic(s) (several dispatchers: each its share,
below) assigned explicitly -- no consumer-group rebalancing: the group only names the positions committed for
monitoring, and nothing resumes from them -- each read from its beginning, in large batches taken without waiting
(`consume(timeout=0)`; librdkafka fetches ahead in its own threads).  The client hands records one by one, so the
only steps per record are the calls that take values, partitions and offsets out of them.  A record's value is one
JSON object: a batch's JSON values are joined with newlines and read by one `pyarrow.json.read_json` under the
declared schema (fields not declared are ignored; the key, time and id fields are required); CSV lines and Avro
datums are read a batch at once too (master.sources.kafka_values).  Only when that fails are the bad records looked
for, by halving the batch (an error path: a bad record costs about log2(batch) reads), and set aside in
`rejected/kafka-rejected-<R|S>-NNNNNN.*` with topic, partition, offset, reason (`not JSON`, `not CSV`, `not Avro`,
`missing column`, `wrong type`) and value; the rest go on.  Two streams may share one topic (`select`): each first
reads only the select column of every record and keeps its own; stream R sets aside the records no stream takes.
With `bounded` the stream ends once every partition reached its end offset as read at the start (Flink's bounded
KafkaSource, Spark's endingOffsets = latest); otherwise the run ends on a stop signal.

Order.  The partitions are merged by their own watermarks (master.sources.partitions, which says why each row
is then judged against its own partition's watermark); the rows released are numbered as the stream's rows,
checked (common.stream_file.StreamChecks: rows rejected there are listed beside the records, with their
partition and offset) and handed to master.sources.streams, which merges them with the other stream.
Checkpoints.  The stream's place is where its merge hands rows on (`position`): per partition the offset of its
first record not handed on and its running maximum there (its watermark state), the next stream row and the
duplicate-id check's state; a recovery (`start`) reads each partition again from that offset.  Records set
aside wait until that offset has passed them, so the listing holds each once.  Each complete checkpoint's
offsets are committed to the group (`acknowledge`), for lag monitoring; nothing resumes from them.

Records gone.  Records deleted at the broker before they were read (retention, DeleteRecords) must never be
skipped silently, as a plain consumer's `auto.offset.reset` would: the client never resets (`error`), a start
compares each partition's offset with the broker's offsets (a recovery's checkpointed one may lie below the first
record now), and a client that cannot fetch at its position asks the broker where the partition starts.  The
range lost stops the job (InputLost, exit 8) or, with `on_lost = "skip"`, is logged, counted per partition
(summary, metrics, kept in checkpoints) and the partition read on from its first record.

Several dispatchers (`share` = (index, k)).  The partitions are shared out once, at the start: the topics'
(topic, partition) list sorted, dispatcher i reads the i-th, (i + k)-th, ... of it (`assignment`), each with its
own client, merge, listing (`kafka-rejected-<R|S>-dI`) and place in its own part of each checkpoint; a recovery
(the same k: protocol.checkpoint binds cluster.dispatchers) reads each partition on from its dispatcher's
offsets.  One with no partition of a topic has ended that stream.  The partition list is read once: partitions
added to a topic later are not read (the log says so at the start), and a recovery that finds the topic's
partitions changed stops, as with one dispatcher.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import operator
import re
import sys
import time
from collections import Counter
from itertools import compress, repeat

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition

from common.chunks import InputError, InputLost, InputRewound
from common.stream_file import StreamBatch, StreamChecks
from master.sources.archive import named
from master.sources.rejected import RejectedListing
from master.sources.kafka_values import value_reader
from master.sources.partitions import PartitionMerge, Released
from protocol.errors import ConfigError
from protocol.streams import KAFKA_COLUMNS, resolved_settings

if TYPE_CHECKING:
    from protocol.plan import Plan

#: records taken from the client at once, and most batches taken per call (the master's loop goes on between)
CONSUME_BATCH = 65536
CONSUME_ROUNDS = 4
#: seconds the broker has to answer at the start (metadata, offsets)
METADATA_TIMEOUT = 10.0
#: errors that end the run: the topic or partition is gone, or may not be read
STOPPING = {
    KafkaError.UNKNOWN_TOPIC_OR_PART,
    KafkaError.TOPIC_AUTHORIZATION_FAILED,
    KafkaError._UNKNOWN_PARTITION,
    KafkaError._UNKNOWN_TOPIC,
    KafkaError._AUTHENTICATION,
    KafkaError.SASL_AUTHENTICATION_FAILED,
}
#: the client could not fetch at a partition's position: the broker no longer holds that offset (its records were
#: deleted, or it lost records it had acknowledged); the client never resets on its own (`auto.offset.reset`)
OFFSET_GONE = {KafkaError._AUTO_OFFSET_RESET, KafkaError.OFFSET_OUT_OF_RANGE}


def lost_line(name: str, ranges: list[dict]) -> str:
    """The line that names records deleted before stream `name` read them: per partition its topic, number and
    the offsets lost (`ranges`: dicts of topic, partition, first, last)."""
    where = ", ".join(
        f"kafka topic {r['topic']} partition {r['partition']}: offsets {r['first']}..{r['last']}" for r in ranges
    )
    n = sum(r["last"] - r["first"] + 1 for r in ranges)
    return f"stream {name}: {where} {'were' if n > 1 else 'was'} deleted before they were read ({n:,} records lost)"


def assignment(partitions: list[tuple[str, int]], index: int, k: int) -> list[tuple[str, int]]:
    """Dispatcher `index`'s share of the topics' partitions: every k-th of the sorted list, from the index-th."""
    return sorted(partitions)[index::k]


class KafkaStream:
    """Stream `checks.name` (side `side`, 0 = R) from its topic(s), `checks.spec.kafka` (protocol.streams), its
    records' values read under `declared` (the declared fields, and the records' own columns it names);
    dispatcher `share[0]` of `share[1]` reads its own share of the partitions (`assignment`)."""

    def __init__(
        self,
        plan: Plan,
        side: int,
        checks: StreamChecks,
        declared: pa.Schema,
        start: tuple[dict, pa.Table] | None = None,
        share: tuple[int, int] = (0, 1),
    ):
        """`start`: a checkpoint's `position` to read on from (None: every partition from its beginning)."""
        self.share = share
        spec, kafka = checks.spec, checks.spec.kafka
        self.on_lost = kafka.on_lost
        self.checks, self.name, self.topics, self.bounded = checks, checks.name, kafka.topics, kafka.bounded
        self.side = side
        #: the fields read from the values; key, time and id are required (a record without one is set aside)
        self.fields = pa.schema(
            [
                pa.field(f.name, f.type, nullable=f.name not in checks.roles)
                for f in declared
                if f.name not in KAFKA_COLUMNS
            ]
        )
        self.own = [c for c in declared.names if c in KAFKA_COLUMNS]  #: the records' own columns used
        self.consumer = _consumer(self.name, kafka)
        try:
            self.assigned, first, high = self._partitions(kafka.bootstrap)
        except InputError:
            self.consumer.close()
            raise
        #: per (topic's index in `topics`, partition): the partition's index in `assigned` (-1: not this dispatcher's)
        self.index_of = np.full((len(self.topics), 1 + max((p for _, p in self.assigned), default=0)), -1, np.int64)
        for i, (t, p) in enumerate(self.assigned):
            self.index_of[self.topics.index(t), p] = i
        self.topic_of = np.array([self.topics.index(t) for t, _ in self.assigned], np.int32)  #: per partition index
        self.partition_of = np.array([p for _, p in self.assigned], np.int32)
        self.merge = PartitionMerge(first, high, self.bounded, spec.max_delay, spec.idle_timeout)
        out = plan.output
        self.listing = RejectedListing(
            out.path / "rejected", out.format, out.flush_rows, named(f"kafka-rejected-{'RS'[side]}", *share)
        )
        self.last_message = time.monotonic()  #: when a record of this stream last came (idleness)
        self._started = False  #: the master has asked for rows (quiet time counts from then)
        self.records = self.rows = self.pauses = 0
        self.high = high  #: per partition, its high watermark when reading started (lag until the client fetches)
        self.taken = np.zeros((2, len(self.assigned)), np.int64)  #: records and value bytes read, per partition
        self._last_partitions: list[dict] | None = None  #: partition_metrics() as the client closed
        self.checkpointed = plan.checkpoint.enabled  #: the group's offsets are the checkpoints'
        self._aside: list[tuple[np.ndarray, np.ndarray, pa.Table]] = []  #: set aside, not yet passed by the merge
        self._commit_due: list[TopicPartition] | None = None  #: a complete checkpoint's offsets, to commit
        self.lost = np.zeros(len(self.assigned), np.int64)  #: records deleted before they were read, per partition
        self.rewound = np.zeros(len(self.assigned), np.int64)  #: records read that the broker no longer holds
        self.lost_ranges: list[dict] = []  #: each occurrence: topic, partition, first and last offset lost
        #: each time a checkpoint's offset lay beyond a partition's end (on_lost = "skip"): the offsets the stream
        #: had read that the broker no longer held, read again from their first (others' now)
        self.rewound_ranges: list[dict] = []
        if start is not None:
            self._resume(*start)
        try:  # a checkpoint's offsets outside what the broker holds now: lost, or stop
            gone = np.flatnonzero((self.merge.position < first) | (self.merge.position > high))
            self._skip_gone(gone, first[gone], high[gone])
        except InputLost:
            self.consumer.close()
            raise
        self.consumer.assign([TopicPartition(t, p, int(x)) for (t, p), x in zip(self.assigned, self.merge.position)])
        self._stored = self.merge.unreleased()  #: the positions last stored for committing
        self._crowded = np.zeros(len(self.assigned), bool)  #: paused for rows waiting (master.sources.partitions)
        self._paused = np.zeros(len(self.assigned), bool)  #: paused at the client: crowded, or bounded and ended
        self._warned: set[int] = set()
        self._finished: dict | None = None
        where = f"streams.{self.name}.kafka"
        self.values = value_reader(kafka, self.fields, where)  #: the records' values into tables of the fields
        #: one topic for both streams: the select column's reader, and (R) the values some stream takes
        self.select = kafka.select or None
        if self.select is not None:
            column = self.select["column"]
            kind = declared.field(column).type if column in declared.names else pa.string()
            if not isinstance(self.select["value"], str) and column not in declared.names:
                kind = pa.int64()
            self.selector = value_reader(kafka, pa.schema([pa.field(column, kind)]), where)
            self.chosen = pa.scalar(self.select["value"]).cast(kind)
            self.every_value = pa.array(self.select["values"]).cast(kind)

    def _partitions(self, bootstrap: str) -> tuple[list[tuple[str, int]], np.ndarray, np.ndarray]:
        """The partitions of the topics this dispatcher reads (every one with one dispatcher), sorted, with their
        low and high watermarks."""
        assigned = []
        for topic in self.topics:
            try:
                meta = self.consumer.list_topics(topic, timeout=METADATA_TIMEOUT).topics[topic]
            except KafkaException as e:
                raise InputError(
                    f"streams.{self.name}.kafka.bootstrap: no answer from {bootstrap} within "
                    f"{METADATA_TIMEOUT:g} s ({e.args[0].str()})"
                ) from None
            if meta.error is not None or not meta.partitions:
                reason = meta.error.str() if meta.error is not None else "no partitions"
                raise InputError(f"streams.{self.name}.kafka.topic: {topic!r} cannot be read at {bootstrap}: {reason}")
            assigned += [(topic, p) for p in sorted(meta.partitions)]
        index, k = self.share
        if k > 1:
            every, assigned = len(assigned), assignment(assigned, index, k)
            print(
                f"kafka: streams.{self.name}: dispatcher {index} of {k} reads {len(assigned)} of the {every} "
                f"partitions ({', '.join(f'{t}/{p}' for t, p in assigned) or 'none'}); partitions added later are "
                "not read",
                file=sys.stderr,
                flush=True,
            )
        marks = []
        for topic, p in assigned:
            try:
                mark = self.consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=METADATA_TIMEOUT)
            except KafkaException as e:
                raise InputError(
                    f"streams.{self.name}.kafka: the offsets of {topic} [{p}] are not known: {e.args[0].str()}"
                ) from None
            if mark is None:
                raise InputError(
                    f"streams.{self.name}.kafka: the offsets of {topic} [{p}] are not known: no answer "
                    f"within {METADATA_TIMEOUT:g} s"
                )
            marks.append(mark)
        low, high = np.array(marks, np.int64).reshape(-1, 2).T
        return assigned, low, high

    @property
    def done(self) -> bool:
        """Bounded and read to its end, or no partition is this dispatcher's (it never brings a row)."""
        return self.merge.done or not self.assigned

    @property
    def reasons(self):
        """Records and rows set aside, by reason (metrics)."""
        return self.listing.reasons

    def batches(self) -> list[StreamBatch]:
        """The checked rows released since the last call, as one batch (none: nothing now)."""
        now, moved = time.monotonic(), False
        self._commit()
        if not self._started:  # the master asks once the cluster is up: quiet until then is not idleness
            self._started, self.last_message = True, now
            self.merge.start(now)
        for _ in range(CONSUME_ROUNDS):
            records = self.consumer.consume(CONSUME_BATCH, timeout=0)
            if records:
                self._take(records, now)
                moved = True
            if len(records) < CONSUME_BATCH:
                break
        released = self.merge.release(now)
        if moved or released is not None:
            self._pace(now)
        return [] if released is None else [self._checked(released)]

    def _take(self, records: list, now: float) -> None:
        """A batch from the client: its events (a partition read to its end, errors) and its records, decoded
        and waiting in the merge.  The client hands out one object per record: their fields are taken by maps
        of the client's own methods (C, no Python step per record), everything after on arrays."""
        n = len(records)
        ok = list(map(operator.is_, map(Message.error, records), repeat(None)))  # by identity: errors' == takes ints
        if not all(ok):
            self._events(list(compress(records, map(operator.not_, ok))))
            records = list(compress(records, ok))
            if not (n := len(records)):
                return
        at = np.fromiter(map(Message.partition, records), np.int64, n)
        if len(self.topics) == 1:
            partition = self.index_of[0, at]
        else:
            topic = {t: i for i, t in enumerate(self.topics)}
            partition = self.index_of[np.fromiter(map(topic.__getitem__, map(Message.topic, records)), np.int64, n), at]
        offset = np.fromiter(map(Message.offset, records), np.int64, n)
        if self.bounded and not (inside := offset < self.merge.end[partition]).all():  # written after the start
            records = list(compress(records, inside))
            partition, offset = partition[inside], offset[inside]
            if not records:
                return
        self.last_message = now
        self.records += len(records)
        values = list(map(Message.value, records))
        if None in values:  # a record without a value (a tombstone): an empty one, set aside as unreadable
            values = [v or b"" for v in values]
        sizes = np.fromiter(map(len, values), np.int64, len(values))
        self.taken += [
            np.bincount(partition, minlength=len(self.assigned)),
            np.bincount(partition, sizes, len(self.assigned)).astype(np.int64),
        ]
        self.merge.read(partition, offset, now)
        if self.select is not None:
            mine = self._own_records(values, partition, offset)
            records, values = list(compress(records, mine)), list(compress(values, mine))
            partition, offset = partition[mine], offset[mine]
            if not values:
                return
        good, bad = self.values.read_all(values)
        if bad:
            self._set_aside(np.array(bad), partition, offset, values, [self.values.why(values[i]) for i in bad])
        if not good:
            return
        at = np.concatenate([np.arange(start, start + t.num_rows) for start, t in good])
        table = pa.concat_tables([t for _, t in good])
        stamps = (
            np.array(list(map(Message.timestamp, records)), np.int64).reshape(-1, 2)[at]
            if "@timestamp" in self.own
            else None
        )
        for column in self.own:  # the records' own columns the stream uses
            table = table.append_column(column, self._own(column, partition[at], offset[at], stamps))
        ts, passes = self.checks.times(table)
        self.merge.add(partition[at], offset[at], ts, passes, table)

    def _own(self, column: str, partition: np.ndarray, offset: np.ndarray, stamps: np.ndarray | None) -> pa.Array:
        """One of the records' own columns (protocol.streams.KAFKA_COLUMNS) for the records read."""
        if column == "@topic":
            return pa.array(self.topics, pa.string()).take(pa.array(self.topic_of[partition]))
        if column == "@partition":
            return pa.array(self.partition_of[partition], pa.int32())
        if column == "@offset":
            return pa.array(offset, pa.int64())
        missing = stamps[:, 0] == 0  # TIMESTAMP_NOT_AVAILABLE: no time, a rejected row if it is the event time
        return pa.array(stamps[:, 1], pa.int64(), mask=missing).cast(pa.timestamp("ms", "UTC"))

    def _own_records(self, values: list[bytes], partition: np.ndarray, offset: np.ndarray) -> np.ndarray:
        """One topic for both streams: which records are this stream's, by their select column.  Stream R sets
        aside those whose column cannot be read and those no stream takes; S leaves them."""
        good, bad = self.selector.read_all(values)
        mine = np.zeros(len(values), bool)
        if good:
            at = np.concatenate([np.arange(start, start + t.num_rows) for start, t in good])
            column = pa.chunked_array([t.column(0) for _, t in good])
            mine[at] = pc.fill_null(pc.equal(column, self.chosen), False).to_numpy(zero_copy_only=False)
            nobody = at[~pc.fill_null(pc.is_in(column, self.every_value), False).to_numpy(zero_copy_only=False)]
        else:
            nobody = np.empty(0, np.int64)
        if self.side == 0 and (len(bad) or len(nobody)):
            name = self.select["column"]
            why = [self.selector.why(values[i]) for i in bad]
            why += [(name, "no stream", f"{name} is {self.selector.read([values[i]])[name][0]}") for i in nobody]
            self._set_aside(np.concatenate([bad, nobody]).astype(np.int64), partition, offset, values, why)
        return mine

    def _set_aside(
        self, bad: np.ndarray, partition: np.ndarray, offset: np.ndarray, values: list[bytes], why: list[tuple]
    ) -> None:
        """Records that cannot be read as the declared fields, with `why` each ((column, reason, detail); an
        error path): listed once the merge has handed on every row before them (a recovery reads what is after
        its offsets again)."""
        columns, reasons, details = (pa.array(x, pa.string()) for x in zip(*why))
        table = pa.table(
            {
                "column": columns,
                "reason": reasons,
                "detail": details,
                "value": pa.array([values[i] for i in bad], pa.binary()),
            }
        )
        self._aside.append((partition[bad], offset[bad], table))

    def _list_passed(self) -> None:
        """The records set aside that the merge's offsets have passed, into the listing."""
        if not self._aside:
            return
        at, keep = self.merge.unreleased(), []
        for partition, offset, table in self._aside:
            passed = offset < at[partition]
            if passed.any():
                t = table.filter(pa.array(passed))
                self._list(partition[passed], offset[passed], t["column"], t["reason"], t["detail"], t["value"])
            if not passed.all():
                keep.append((partition[~passed], offset[~passed], table.filter(pa.array(~passed))))
        self._aside = keep

    def _list(self, partition: np.ndarray, offset: np.ndarray, columns, reasons, details, values) -> None:
        """Set-aside records or rejected rows into the listing (`values`: the records' values, None for rows)."""
        n = len(offset)
        place = {name: self._own(f"@{name}", partition, offset, None) for name in ("topic", "partition", "offset")}
        self.listing.add(
            pa.table(
                {
                    **place,
                    "stream": pa.repeat(self.name, n),
                    "column": columns,
                    "reason": reasons,
                    "detail": details,
                    "value": pa.nulls(n, pa.binary()) if values is None else values,
                }
            )
        )

    def _checked(self, released: Released) -> StreamBatch:
        """Released rows numbered and checked; rows rejected there are listed with their partition and offset."""
        first = self.checks.row
        batch = self.checks.checked(released.table)
        if batch.rejected is not None:
            rej = batch.rejected
            at = rej["row"].to_numpy() - 1 - first
            self._list(released.partition[at], released.offset[at], rej["column"], rej["reason"], rej["cells"], None)
            batch = batch._replace(rejected=None)
        self.rows += len(batch.ts)
        return batch

    def _events(self, events: list) -> None:
        """The client's events: a partition read to its end, or an error (most are retried by the client)."""
        for e in events:
            err = e.error()
            if err.code() == KafkaError._PARTITION_EOF:
                self.merge.reached_end(int(self.index_of[self.topics.index(e.topic()), e.partition()]), e.offset())
            elif err.code() in OFFSET_GONE and e.topic():
                self._gone_while_reading(int(self.index_of[self.topics.index(e.topic()), e.partition()]), e.offset())
            elif err.fatal() or err.code() in STOPPING:
                where = f"{e.topic()} [{e.partition()}]" if e.topic() else self.topics[0]
                raise InputError(f"streams.{self.name}.kafka: {where}: {err.str()}")
            elif err.code() not in self._warned:
                self._warned.add(err.code())
                print(
                    f"kafka: streams.{self.name}: {err.str()} (the client retries; repeats not shown)",
                    file=sys.stderr,
                    flush=True,
                )

    def _gone_while_reading(self, i: int, at: int) -> None:
        """The client could not fetch partition i at offset `at` (-1: at the merge's position): the broker's
        offsets now say what was deleted (or lost); the partition is assigned again where reading goes on."""
        topic, p = self.assigned[i]
        at = at if at >= 0 else int(self.merge.position[i])
        try:
            mark = self.consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=METADATA_TIMEOUT)
        except KafkaException:
            mark = None
        if mark is None:  # no answer now: fetch there again, the client reports the same again if it still fails
            print(
                f"kafka: streams.{self.name}: {topic} [{p}]: offset {at} not fetched, and the broker's offsets "
                "are not known: trying again",
                file=sys.stderr,
                flush=True,
            )
        else:
            self._skip_gone(np.array([i]), np.array(mark[:1], np.int64), np.array(mark[1:], np.int64), at)
            at = max(at, mark[0])
        self.consumer.incremental_unassign([TopicPartition(topic, p)])
        self.consumer.incremental_assign([TopicPartition(topic, p, at)])
        if self._paused[i]:
            self.consumer.pause([TopicPartition(topic, p)])

    def _skip_gone(self, gone: np.ndarray, low: np.ndarray, high: np.ndarray, at: int | None = None) -> None:
        """Partitions `gone` (indexes) cannot be read at their position (`at`: at that offset instead) because the
        broker holds only offsets `low`..`high` of them now (each an array beside `gone`).  Below `low`:
        records deleted before they were read -- InputLost naming them (on_lost = "stop"), or counted, logged
        and skipped (the merge reads on from `low`).  Above `high`: the broker lost records the stream had read
        (or the topic was made anew): InputRewound while reading (`at`: a restart resumes from the last complete
        checkpoint); at a checkpoint's offset, whose state and output hold those records, InputLost (on_lost =
        "stop"), or (on_lost = "skip") logged, counted apart as `rewound` and read on from `high`: what the
        broker writes there now is records the stream never read."""
        ranges = []
        for j, i in enumerate(gone.tolist()):
            topic, p = self.assigned[i]
            first = int(self.merge.position[i]) if at is None else at
            lo, hi = int(low[j]), int(high[j])
            if first > hi:
                where = (
                    f"stream {self.name}: kafka topic {topic} partition {p}: offset {first} lies beyond the "
                    f"partition's end {hi}: the broker no longer holds records the stream has read (it lost records "
                    "it had acknowledged, or the topic was made anew)"
                )
                if at is not None:
                    raise InputRewound(f"{where}: resuming from the newest complete checkpoint reads it as it is now")
                if self.on_lost == "stop":
                    raise InputLost(
                        f"{where}, and reading on would take others for them; set streams.{self.name}.kafka.on_lost "
                        '= "skip" to read on from the end'
                    )
                print(f'kafka: {where}; read on from offset {hi} (on_lost = "skip")', file=sys.stderr, flush=True)
                self.rewound_ranges.append({"topic": topic, "partition": p, "first": hi, "last": first - 1})
                self.rewound[i] += first - hi
                self.merge.rewind(i, hi)
                continue
            upto = min(lo, int(self.merge.end[i])) if self.bounded else lo  # bounded: what it would have read
            if first < upto:
                ranges.append({"topic": topic, "partition": p, "first": first, "last": upto - 1})
        if not ranges:
            return
        line = lost_line(self.name, ranges)
        if self.on_lost == "stop":
            raise InputLost(f'{line}; set streams.{self.name}.kafka.on_lost = "skip" to go on without them')
        print(f'kafka: {line}; skipped (on_lost = "skip")', file=sys.stderr, flush=True)
        for r in ranges:
            i = self.assigned.index((r["topic"], r["partition"]))
            self.lost[i] += r["last"] - r["first"] + 1
            self.merge.skip(i, r["last"] + 1)
        self.lost_ranges += ranges

    def _pace(self, now: float) -> None:
        """Pause the partitions read far ahead (master.sources.partitions) and, bounded, those at their end;
        resume those caught up with; store the positions handed on, for the group's committed offsets."""
        crowded = self.merge.crowded(now)
        self.pauses += int((crowded & ~self._crowded).sum())
        self._crowded = crowded.copy()
        paused = crowded | self.merge.ended()
        for want, call in (
            (paused & ~self._paused, self.consumer.pause),
            (~paused & self._paused, self.consumer.resume),
        ):
            if want.any():
                call([TopicPartition(*self.assigned[i]) for i in np.flatnonzero(want)])
        self._paused = paused
        self._list_passed()
        at = self.merge.unreleased()
        moved = np.flatnonzero(at != self._stored)
        if len(moved) and not self.checkpointed:
            self.consumer.store_offsets(offsets=[TopicPartition(*self.assigned[i], int(at[i])) for i in moved])
            self._stored = at

    def partition_metrics(self) -> list[dict]:
        """Per partition: topic, partition, records and value bytes read, and its lag: the records at the broker
        not handed on yet (the high watermark of the client's last fetch, which it keeps without asking the
        broker, minus the oldest offset not handed on), as the usual Kafka tools count a consumer's lag."""
        if self._last_partitions is not None:
            return self._last_partitions
        at = self.merge.unreleased()
        out = []
        for i, (topic, p) in enumerate(self.assigned):
            mark = self.consumer.get_watermark_offsets(TopicPartition(topic, p), cached=True)
            high = mark[1] if mark is not None and mark[1] >= 0 else int(self.high[i])
            records, size = self.taken[:, i].tolist()
            lag = max(high - int(at[i]), 0)
            out.append(
                {
                    "topic": topic,
                    "partition": p,
                    "records": records,
                    "bytes": size,
                    "lag": lag,
                    "lost": int(self.lost[i]),
                    "rewound": int(self.rewound[i]),
                }
            )
        return out

    def finish(self) -> dict:
        """Close the client (committing the positions handed on; with checkpoints, the last complete one's) and the
        listing; the stream's entry in summary.json's `live_streams` (once)."""
        if self._finished is None:
            self._last_partitions = self.partition_metrics()
            self._commit()
            self.consumer.close()
            self._list_passed()
            self.listing.flush()
            self._finished = {
                "topics": self.topics,
                "bounded": self.bounded,
                "partitions": len(self.assigned),
                "records": self.records,
                "rows": self.rows,
                "rejected_by_reason": dict(self.listing.reasons),
                "held_peak_rows": self.merge.peak,
                "partitions_paused": self.pauses,
                "positions": {f"{t}/{p}": int(x) for (t, p), x in zip(self.assigned, self.merge.unreleased())},
                "lost_records": int(self.lost.sum()),
                "rewound_records": int(self.rewound.sum()),
                "lost": list(self.lost_ranges),
                "rewound": list(self.rewound_ranges),
            }
        return self._finished

    @staticmethod
    def merged(entries: list[dict]) -> dict:
        """Several dispatchers' `finish()` entries (each its own partitions) as one: counts added, the positions
        together, the peak the largest."""
        reasons: Counter = sum((Counter(s["rejected_by_reason"]) for s in entries), Counter())
        return {
            **entries[0],
            **{
                k: sum(s[k] for s in entries)
                for k in ("partitions", "records", "rows", "partitions_paused", "lost_records", "rewound_records")
            },
            "held_peak_rows": max(s["held_peak_rows"] for s in entries),
            "rejected_by_reason": dict(reasons),
            "positions": {p: x for s in entries for p, x in s["positions"].items()},
            "lost": [r for s in entries for r in s["lost"]],
            "rewound": [r for s in entries for r in s["rewound"]],
        }

    def position(self) -> tuple[dict, pa.Table]:
        """Where the merge hands rows on (a checkpoint's part; JSON, and the duplicate-id check's recent ids):
        per partition the offset of its first record not handed on and its running maximum there, the run's
        end offsets (bounded), the next stream row, the listing's files."""
        self._list_passed()
        self.listing.flush()
        place, recent = self.checks.place()
        return {
            "partitions": [f"{t}/{p}" for t, p in self.assigned],
            "offsets": self.merge.unreleased().tolist(),
            "running": self.merge.handed.tolist(),
            "end": self.merge.end.tolist(),
            **place,
            "rows": self.rows,
            "rejected_files": self.listing.files,
            "rejected_rows": self.listing.rows,
            "rejected_by_reason": dict(self.listing.reasons),
            "lost": list(self.lost_ranges),
            "rewound": list(self.rewound_ranges),
        }, recent

    def _resume(self, where: dict, recent: pa.Table) -> None:
        """Back to a `position`: the merge, the stream rows and their checks, the listing."""
        now = [f"{t}/{p}" for t, p in self.assigned]
        if len(where["offsets"]) != len(self.assigned) or where.get("partitions", now) != now:
            self.consumer.close()
            raise InputError(
                f"streams.{self.name}.kafka: the checkpoint holds offsets of {len(where['offsets'])} partitions, "
                f"but {', '.join(self.topics)} now has {len(self.assigned)}"
                + (f" for dispatcher {self.share[0]}" if self.share[1] > 1 else "")
                + ": a recovery cannot tell where the records of the others start"
            )
        self.merge.restore(np.array(where["offsets"]), np.array(where["running"]), np.array(where["end"]))
        self.checks.resume(where, recent)
        self.rows = where["rows"]
        self.listing.roll_back(where["rejected_files"], where["rejected_rows"])
        self.listing.reasons.update(where["rejected_by_reason"])
        self.records = self.rows + self.listing.rows
        self._stored = self.merge.unreleased()
        self.lost_ranges = list(where.get("lost", []))  # skipped before the checkpoint (none in older ones)
        self.rewound_ranges = list(where.get("rewound", []))
        for counts, ranges in ((self.lost, self.lost_ranges), (self.rewound, self.rewound_ranges)):
            for r in ranges:
                if (r["topic"], r["partition"]) in self.assigned:
                    counts[self.assigned.index((r["topic"], r["partition"]))] += r["last"] - r["first"] + 1

    def acknowledge(self, where: dict) -> None:
        """A checkpoint holding the stream up to `where` (its `position`) is complete: its offsets become the
        group's committed ones (for lag monitoring; a recovery reads the checkpoint's own) at the next read, once
        the master has written the manifest."""
        self._commit_due = [TopicPartition(t, p, int(x)) for (t, p), x in zip(self.assigned, where["offsets"])]

    def _commit(self) -> None:
        """The offsets of the last complete checkpoint to the group, if not yet (asynchronously: monitoring)."""
        if self._commit_due:
            self.consumer.commit(offsets=self._commit_due, asynchronous=True)
            self._commit_due = None


def _consumer(name: str, kafka: dict) -> Consumer:
    """The client: the user's settings, then the stream's own; a setting librdkafka refuses is named, its value
    never shown (librdkafka's message quotes it)."""
    settings = {
        **resolved_settings(kafka.config, f"streams.{name}.kafka.config", ConfigError),
        "auto.offset.reset": "error",  # never a silent jump: records gone below a position are the stream's to judge
        "bootstrap.servers": kafka.bootstrap,
        "group.id": kafka.group,
        "enable.partition.eof": True,
        "enable.auto.offset.store": False,
    }
    try:
        return Consumer(settings)
    except KafkaException as e:
        named = re.search(r'property:? "([^"]+)"\s*$', e.args[0].str())
        raise ConfigError(
            f"streams.{name}.kafka.config: librdkafka refuses "
            f"{'the setting ' + named[1] if named else 'a setting'} ({e.args[0].name()}; its message "
            "is not shown, it may quote a value)"
        ) from None


def resolve_patterns(plan: Plan, checkpointed: Plan | None) -> tuple[Plan, list[str]]:
    """Kafka streams given by `pattern` get their topics, once for the run, on rank 0 before the plan goes to the
    other ranks: a recovery's are the checkpoint's (`checkpointed`: the plan it wrote down), else the topics whose
    whole name matches now, sorted (internal ones, `__...`, aside); none matching stops the start.  The plan with
    them, and lines for the log."""
    lines, found = [], {}
    for spec in plan.streams:
        name, kafka = spec.name, spec.kafka
        if not kafka or not kafka.pattern:
            continue
        if checkpointed is not None:
            found[name] = next(s.kafka.topics for s in checkpointed.streams if s.name == name)
            continue
        from confluent_kafka.admin import AdminClient

        settings = resolved_settings(kafka.config, f"streams.{name}.kafka.config", ConfigError)
        try:
            known = AdminClient({**settings, "bootstrap.servers": kafka.bootstrap}).list_topics(
                timeout=METADATA_TIMEOUT
            )
        except KafkaException as e:
            raise InputError(
                f"streams.{name}.kafka.bootstrap: no answer from {kafka.bootstrap} within {METADATA_TIMEOUT:g} s "
                f"({e.args[0].str()})"
            ) from None
        topics = sorted(t for t in known.topics if re.fullmatch(kafka.pattern, t) and not t.startswith("__"))
        if not topics:
            raise InputError(f"streams.{name}.kafka.pattern: no topic at {kafka.bootstrap} matches {kafka.pattern!r}")
        found[name] = topics
        lines.append(
            f"kafka: streams.{name}: pattern {kafka.pattern!r} matches {', '.join(topics)} (topics made later "
            "are not read)"
        )
    return plan.with_topics(found), lines
