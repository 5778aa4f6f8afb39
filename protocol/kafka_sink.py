"""The Kafka result sink's records and producer, shared by the slaves (each sends its own result files at
checkpoints) and rank 0 (a recovery's and the end's rest): docs/output.md#the-kafka-result-sink.

Rows are sent a slice of a result file at a time: the values (JSON objects) and keys are built for the whole
slice by Arrow's string kernels; confluent-kafka takes one `produce` call per record, the only step per row
(and only failed records report back).
Memory is bounded: a slice, and the producer's queue (QUEUE records, QUEUE_KIB), which when full makes the
sender wait for the broker -- the back-pressure: a slow broker slows the slave sending.  A broker that takes no
row for `output.kafka.timeout` raises SinkError, which ends the job with exit code SINK.

A transaction during which the producer lost every broker (librdkafka's "all brokers down") is not trusted:
a broker restarted meanwhile may have lost the transaction's state with what it had not saved, and records
the producer sent it afterwards would then open a transaction no commit, fence or timeout ends (the test
broker does so).  The producer sends nothing more of it and raises SinkError; the recovery fences and
resends what the committed markers lack.  So does the next transaction after such a loss following a commit:
a broker that restarted may have dropped that commit with what it had not saved.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
from confluent_kafka import KafkaError, KafkaException, Producer

from protocol import faults
from protocol.errors import ConfigError, SinkError
from protocol.streams import resolved_settings

if TYPE_CHECKING:
    from protocol.plan import Plan, Stream

#: rows whose values are built at once, and records and KiB the producer's queue holds at most
SLICE_ROWS = 65536
QUEUE, QUEUE_KIB = 100_000, 65536
#: how long a transaction may stay open before the broker aborts it: one checkpoint interval's rows of a slave
#: must fit (10 minutes; Kafka brokers allow up to 15 by default, transaction.max.timeout.ms)
TXN_MS = 600_000


def transactional_id(run: str, series: str) -> str:
    """The transactional id of the producer that sends `series`' files (`slave-RRR`; `master`: rank 0's)."""
    return f"streamjoin-{run}-{series}"


def key_columns(streams: tuple[Stream, ...]) -> list[str]:
    """The result columns a record's key is made of: the pair's ids (declared `streams`: each stream's id column,
    or its key and time columns when it has none)."""
    if not streams:
        return ["r_id", "s_id"]
    names = []
    for spec in streams:
        own = [spec.id] if spec.id else [*spec.key, spec.time]
        names += [spec.prefix + c for c in own]
    return names


def _escaped(text: pa.Array) -> pa.Array:
    """JSON string contents: backslash, quote and control characters escaped (the replacing passes only where
    one of them occurs)."""
    if not pc.any(pc.match_substring_regex(text, '["\\\\\\x00-\\x1f]')).as_py():
        return text
    text = pc.replace_substring(pc.replace_substring(text, "\\", "\\\\"), '"', '\\"')
    if pc.any(pc.match_substring_regex(text, "[\\x00-\\x1f]")).as_py():
        for c in range(32):
            text = pc.replace_substring(text, chr(c), f"\\u{c:04x}")
    return text


def _text(column: pa.Array) -> tuple[str, pa.Array, str]:
    """Each value of `column` as JSON text between the two strings (quotes; a UTC time's "Z"), null where the
    value is null or not a number."""
    t = column.type
    if pa.types.is_floating(t):
        text = pc.cast(column, pa.string())
        if not pc.all(pc.is_finite(column)).as_py():
            text = pc.if_else(pc.is_finite(column), text, pa.scalar(None, pa.string()))
        return "", text, ""
    if pa.types.is_integer(t) or pa.types.is_boolean(t) or pa.types.is_decimal(t):
        return "", pc.cast(column, pa.string()), ""
    if pa.types.is_timestamp(t):
        # Arrow's text of a zoned time looks its zone up value by value (about 1.2 us each): UTC's is the
        # zoneless text of the same value with a "Z"
        utc = t.tz == "UTC"
        text = pc.cast(pc.cast(column, pa.timestamp(t.unit)) if utc else column, pa.string())
        return '"', pc.replace_substring(text, " ", "T", max_replacements=1), 'Z"' if utc else '"'
    return '"', _escaped(pc.cast(column, pa.string())), '"'


def json_text(column: pa.Array) -> pa.Array:
    """Each value of `column` as JSON text: numbers and booleans bare (NaN and infinities null), times as ISO 8601,
    everything else as a string; null as null."""
    return _filled(*_text(column))


def _filled(before: str, text: pa.Array, after: str) -> pa.Array:
    if before or after:
        text = pc.binary_join_element_wise(before, text, after, "")
    return pc.fill_null(text, "null")


def records(table: pa.Table, keys: list[str]) -> tuple[list[bytes], list[bytes]]:
    """The table's rows as record values (JSON objects of its columns) and keys (`keys`' values joined by |).
    One join of whole columns builds the values: a column without nulls has its quotes in the literal text
    around it, so only columns with nulls are joined apart first."""
    parts: list = []
    literal = "{"
    for i, name in enumerate(table.column_names):
        literal += ("," if i else "") + json.dumps(name) + ":"
        before, text, after = _text(table[name].combine_chunks())
        if text.null_count:
            parts += [literal, _filled(before, text, after)]
            literal = ""
        else:
            parts += [literal + before, text]
            literal = after
    values = pc.binary_join_element_wise(*parts, literal + "}", "").cast(pa.binary()).to_pylist()
    present = [k for k in keys if k in table.column_names]
    if not present:
        return values, values
    texts = [pc.fill_null(pc.cast(table[k].combine_chunks(), pa.string()), "") for k in present]
    return values, pc.binary_join_element_wise(*texts, "|").cast(pa.binary()).to_pylist()


class ResultProducer:
    """Sends result files' rows to `output.kafka.topic`: with `series` (whose transactional id it takes) in
    transactions with a marker, else idempotent (at least once)."""

    def __init__(self, plan: Plan, rank: int, series: str | None):
        k = plan.output.kafka
        self.topic, self.marker_topic, self.timeout, self.run = k.topic, k.marker_topic, k.timeout, k.run
        self.results, self.fmt = plan.output.path / "results", plan.output.format
        self.rank, self.exact, self.keys = rank, series is not None, key_columns(plan.streams)
        self.client = {
            **resolved_settings(k.config, "output.kafka.config", ConfigError),
            "bootstrap.servers": k.bootstrap,
        }
        ms = int(self.timeout * 1000)
        conf = {
            **self.client,
            "enable.idempotence": True,
            "acks": "all",
            "queue.buffering.max.messages": QUEUE,
            "queue.buffering.max.kbytes": QUEUE_KIB,
            "message.timeout.ms": ms,
            "linger.ms": 20,
            "on_delivery": self._delivered,
            "error_cb": self._error,
            "delivery.report.only.error": True,  # a report of each delivered record cost 0.5 us a row
        }
        if self.exact:
            conf |= {"transactional.id": transactional_id(self.run, series), "transaction.timeout.ms": max(ms, TXN_MS)}
        self.producer = Producer(conf)
        self.sent: dict[str, int] = {}  #: per slave's result files (slave-RRR), how many are produced
        self.failed: str | None = None  #: the first record the broker did not take
        self.cut = False  #: every broker went out of reach since the first transaction began
        self.rows = self.transactions = 0
        self.seconds = 0.0  #: spent producing (building records, produce calls, commits)
        #: called while a send goes on (a slice sent, a wait for the broker): a slave tells rank 0 it is alive
        self.alive: Callable[[], None] = lambda: None

    def begin(self) -> None:
        """With transactions: take the transactional id, aborting a crashed holder's open transaction."""
        if self.exact:
            self._call(self.producer.init_transactions, self.timeout)

    def transaction(self, counts: dict[str, int], label: str | int) -> None:
        """The rows of every result file from `sent` up to `counts` (per slave's files) and, with transactions,
        the marker of `label` (a checkpoint, "recovered" or "end") in one transaction."""
        started = time.perf_counter()
        if self.exact:
            self.producer.poll(0)
            self.cut &= self.transactions > 0  # a loss before any commit put nothing at risk
            self._call(self.producer.begin_transaction)
        for series, n in sorted(counts.items()):
            for i in range(self.sent.get(series, 0), n):
                self._file(self.results / f"{series}-{i:06d}.{self.fmt}")
        if self.exact:
            marker = {"run": self.run, "checkpoint": label, "files": counts}
            self._produce(self.marker_topic, [json.dumps(marker)], [self.run])
            faults.reached(self.rank, "sink-commit")
            self._sent_all()
            self._call(self.producer.commit_transaction, 1.0)  # retried while it times out, to the timeout
            self.producer.poll(0)
            self._within_reach()  # a broker restarted before its commit may have dropped the transaction
        elif self.producer.flush(self.timeout) > 0:
            self.failed = self.failed or f"not delivered within output.kafka.timeout = {self.timeout:g}s"
        if self.failed:
            raise SinkError(f"output.kafka.topic: {self.topic}: {self.failed}")
        self.sent = {**self.sent, **counts}
        self.transactions += 1
        self.seconds += time.perf_counter() - started

    def _file(self, path: Path) -> None:
        """One result file's rows, a slice at a time (bounded memory)."""
        table = pq.read_table(path) if self.fmt == "parquet" else pacsv.read_csv(path)
        for start in range(0, table.num_rows, SLICE_ROWS):
            values, keys = records(table.slice(start, SLICE_ROWS), self.keys)
            self._produce(self.topic, values, keys)
            self.rows += len(values)
            self.alive()

    def _produce(self, topic: str, values: list, keys: list) -> None:
        """Hand the records to the producer; while its queue is full wait for the broker (the back-pressure)."""
        self.producer.poll(0)
        self._within_reach()
        produce = self.producer.produce
        for value, key in zip(values, keys):
            try:
                produce(topic, value, key)
            except BufferError:
                self._make_room(topic, value, key)
        self.producer.poll(0)

    def _make_room(self, topic: str, value, key) -> None:
        """The producer's queue is full: wait for the broker until it takes the record."""
        while True:
            self.producer.poll(0.05)
            self.alive()
            self._within_reach()
            if self.failed:
                raise SinkError(f"output.kafka.topic: {topic}: {self.failed}")
            try:
                return self.producer.produce(topic, value, key)
            except BufferError:
                continue

    def _sent_all(self) -> None:
        """Wait until the broker has every record of the transaction, watching that it stays within reach: the
        commit then carries no record to a broker that restarted meanwhile."""
        deadline = time.monotonic() + self.timeout
        while self.producer.flush(0.2) > 0:
            self.alive()
            self._within_reach()
            if self.failed or time.monotonic() > deadline:
                raise SinkError(
                    f"output.kafka.topic: {self.topic}: "
                    f"{self.failed or f'not delivered within output.kafka.timeout = {self.timeout:g}s'}"
                )
        self._within_reach()

    def _within_reach(self) -> None:
        """With transactions: raise SinkError if every broker went out of reach since the last commit (since the
        first transaction began), dropping what the producer holds first (see the module's docstring)."""
        if not (self.exact and self.cut):
            return
        try:
            self.producer.purge(in_queue=True, in_flight=True, blocking=True)
        except KafkaException:
            pass
        raise SinkError(
            f"output.kafka: every broker of {self.client['bootstrap.servers']} went out of reach during a "
            "transaction or since the last commit (a broker restarted may have lost them): not committed; the "
            "recovery resends what the committed markers lack"
        )

    def _error(self, err) -> None:
        if err.code() == KafkaError._ALL_BROKERS_DOWN:
            self.cut = True

    def _delivered(self, err, message) -> None:
        if err is not None and self.failed is None:
            self.failed = f"a record was not delivered: {err.str()}"

    def _call(self, call, *args):
        """`call(*args)` to the broker, its answer; a retriable error is retried until output.kafka.timeout, any
        other ends the run."""
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                return call(*args)
            except KafkaException as e:
                error = e.args[0]
                if not error.retriable() or time.monotonic() > deadline:
                    raise SinkError(f"output.kafka: {call.__name__}: {error.str()}") from None
                self.alive()
                time.sleep(0.2)
