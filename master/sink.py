"""The Kafka result sink (`[output.kafka]`, docs/output.md#the-kafka-result-sink): every result row, as the slaves
wrote it in `results/`, produced to a topic, exactly once with checkpoints.

With checkpoints it is Flink's two-phase-commit sink with the result files as the pre-commit: the files a
complete checkpoint's commit covers are on disk and never removed again (a recovery removes only files past
its checkpoint's commit).  So once a manifest is written rank 0 produces, in one Kafka transaction, every row
of the files that commit covers and no transaction has yet, and beside them one marker record (this run's id,
the checkpoint, every slave's file count) to the marker topic; the transaction commits both or neither.  A
recovery fences the crashed run's producer (`init_transactions` with the same transactional.id aborts its open
transaction), reads the last committed marker with read_committed and produces, in one transaction again, what
the checkpoint it resumes from covers beyond that marker: a crash after the manifest and before the commit
loses nothing, one after the commit produces nothing twice.  The end of the run is the last transaction,
marked `end`: a run restarted after it produces nothing more.  Rank 0 alone produces (one transactional id to
fence, nothing to tell the slaves, any slave count on a recovery) in a thread of its own, so its loop goes on
routing meanwhile; rows reach a read_committed reader about one checkpoint interval after they are joined.

Without checkpoints an idempotent producer sends every file at the end of the run: at least once (a crash
and a rerun send again what the crashed run sent).

Rows are sent a slice of a file at a time: the values (JSON objects) and keys are built for the whole slice by
Arrow's string kernels; confluent-kafka takes one `produce` call per record, the only step per row.  Memory is
bounded: a slice, and the producer's queue (QUEUE records, QUEUE_KIB), which when full makes the thread wait
for the broker.  While more than one checkpoint's transaction waits, ingest pauses (`behind`): a slow broker
slows the cluster, and a broker that takes no row for `output.kafka.timeout` ends the job with exit code SINK.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from protocol import faults
from protocol.errors import ConfigError, SinkError
from protocol.output import SINK_RUN as RUN_FILE

#: rows whose values are built at once, and records and KiB the producer's queue holds at most
SLICE_ROWS = 65536
QUEUE, QUEUE_KIB = 100_000, 65536


def run_id(out: Path) -> str | None:
    """The id of the run whose output is in `out` (None: it had no Kafka sink)."""
    try:
        return json.loads((out / RUN_FILE).read_text())["run"]
    except (OSError, ValueError, KeyError):
        return None


def keep_run_id(out: Path, run: str | None) -> str:
    """Write `run` (None: a new id) as this run's; returns it."""
    run = run or secrets.token_hex(8)
    tmp = out / f".{RUN_FILE}.tmp"
    tmp.write_text(json.dumps({"run": run}))
    os.replace(tmp, out / RUN_FILE)
    return run


def key_columns(cfg: dict) -> list[str]:
    """The result columns a record's key is made of: the pair's ids (declared streams: each stream's id column,
    or its key and time columns when it has none)."""
    if not cfg.get("streams"):
        return ["r_id", "s_id"]
    names = []
    for spec in cfg["streams"].values():
        own = [spec["id"]] if spec["id"] else [*spec["key"], spec["time"]]
        names += [spec["prefix"] + c for c in own]
    return names


def _quoted(text: pa.Array) -> pa.Array:
    """JSON strings: backslash, quote and control characters escaped, in quotes."""
    text = pc.replace_substring(pc.replace_substring(text, "\\", "\\\\"), '"', '\\"')
    if pc.any(pc.match_substring_regex(text, "[\\x00-\\x1f]")).as_py():
        for c in range(32):
            text = pc.replace_substring(text, chr(c), f"\\u{c:04x}")
    return pc.binary_join_element_wise('"', text, '"', "")


def json_text(column: pa.Array) -> pa.Array:
    """Each value of `column` as JSON text: numbers and booleans bare (NaN and infinities null), times as ISO 8601,
    everything else as a string; null as null."""
    t = column.type
    if pa.types.is_floating(t):
        text = pc.if_else(pc.is_finite(column), pc.cast(column, pa.string()), pa.scalar(None, pa.string()))
    elif pa.types.is_integer(t) or pa.types.is_boolean(t) or pa.types.is_decimal(t):
        text = pc.cast(column, pa.string())
    elif pa.types.is_timestamp(t):
        text = _quoted(pc.replace_substring(pc.cast(column, pa.string()), " ", "T", max_replacements=1))
    else:
        text = _quoted(pc.cast(column, pa.string()))
    return pc.fill_null(text, "null")


def records(table: pa.Table, keys: list[str]) -> tuple[list[str], list[str]]:
    """The table's rows as record values (JSON objects of its columns) and keys (`keys`' values joined by |)."""
    parts: list = []
    for i, name in enumerate(table.column_names):
        parts += [("{" if i == 0 else ",") + json.dumps(name) + ":", json_text(table[name].combine_chunks())]
    values = pc.binary_join_element_wise(*parts, "}", "")
    present = [k for k in keys if k in table.column_names]
    if not present:
        return values.to_pylist(), values.to_pylist()
    texts = [pc.fill_null(pc.cast(table[k].combine_chunks(), pa.string()), "") for k in present]
    return values.to_pylist(), pc.binary_join_element_wise(*texts, "|").to_pylist()


class KafkaSink:
    """Rank 0's producer of the result files' rows (see the module's docstring)."""

    def __init__(self, cfg: dict, run: str):
        k = cfg["output"]["kafka"]
        self.topic, self.marker_topic, self.timeout, self.run = k["topic"], k["marker_topic"], k["timeout"], run
        self.results, self.fmt = Path(cfg["output"]["path"]) / "results", cfg["output"]["format"]
        self.exact = bool(cfg["checkpoint"]["interval"])  #: transactions, else idempotent at least once
        self.keys = key_columns(cfg)
        self.client = {**k["config"], "bootstrap.servers": k["bootstrap"]}
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
        }
        if self.exact:
            conf |= {"transactional.id": f"streamjoin-{run}", "transaction.timeout.ms": max(ms, 60_000)}
        self.producer = Producer(conf)
        self.sent: dict[str, int] = {}  #: per slave's result files (slave-RRR), how many are produced
        self.complete = False  #: the run's end is in Kafka already (a restart after it sends nothing more)
        self.failed: str | None = None  #: the first record the broker did not take
        self.rows = self.transactions = 0
        self.seconds = 0.0  #: spent producing (building records, produce calls, commits)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kafka-sink")
        self._pending: list[Future] = []

    # -- before the run ------------------------------------------------------------------------------------
    def start(self, commit: dict[str, int] | None) -> str:
        """Check the topics; with checkpoints fence a crashed run's producer, read where its committed
        transactions got to and produce what `commit` (the result file counts of the checkpoint resumed from;
        None: none) covers beyond it.  Returns a line for the operator."""
        self._topics()
        if not self.exact:
            return f"kafka sink: results to {self.topic} at the end of the run (at least once)"
        self._call(self.producer.init_transactions, self.timeout)
        last = self._last_marker()
        self.sent, self.complete = (last["files"], last["checkpoint"] == "end") if last else ({}, False)
        covered = commit or {}
        beyond = sorted(s for s, n in self.sent.items() if n > covered.get(s, 0))
        if beyond and not self.complete:
            raise SinkError(
                f"{self.topic} holds rows of {beyond[0]}'s result files past the checkpoint resumed from (its "
                f"transaction {last['checkpoint']} committed them; that checkpoint is gone): resending what follows "
                "would duplicate them; start afresh with another output.kafka.topic"
            )
        if self.complete:
            return f"kafka sink: run {self.run} is complete in {self.topic} already: nothing more is sent"
        line = f"kafka sink: results to {self.topic} in a transaction per checkpoint (run {self.run})"
        missing = sum(max(0, n - self.sent.get(s, 0)) for s, n in covered.items())
        if missing:  # the crash came between a manifest and its transaction's commit
            self._transaction(covered, "recovered")
            line += f"; {missing} result files the checkpoint covers sent now, no transaction had them"
        return line

    def _topics(self) -> None:
        """The results topic must exist; the marker topic is made with one partition if it does not."""
        admin = AdminClient(self.client)
        try:
            topics = admin.list_topics(timeout=self.timeout).topics
        except KafkaException as e:
            raise SinkError(f"output.kafka.bootstrap: no answer from {self.client['bootstrap.servers']}: {e}") from None
        if self.topic not in topics or topics[self.topic].error is not None:
            raise ConfigError(f"output.kafka.topic: {self.topic!r} does not exist on the broker: create it first")
        if self.exact and self.marker_topic not in topics:
            try:
                admin.create_topics([NewTopic(self.marker_topic, 1, 1)])[self.marker_topic].result(self.timeout)
            except KafkaException as e:
                if e.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                    raise SinkError(f"output.kafka.marker_topic: cannot create {self.marker_topic!r}: {e}") from None

    def _last_marker(self) -> dict | None:
        """This run's last committed marker: the marker topic read with read_committed to where it ended after
        the fence (a transaction of another producer still open there holds the reader back)."""
        reader = lambda level: Consumer(  # noqa: E731
            {
                **self.client,
                "group.id": f"streamjoin-sink-{self.run}",
                "isolation.level": level,
                "enable.auto.commit": False,
            }
        )
        probe, consumer = reader("read_uncommitted"), reader("read_committed")
        try:
            meta = probe.list_topics(self.marker_topic, timeout=self.timeout).topics[self.marker_topic]
            ends = {  # a topic just made may have no leader yet: retried
                p: self._call(probe.get_watermark_offsets, TopicPartition(self.marker_topic, p), self.timeout)[1]
                for p in meta.partitions
            }
            consumer.assign([TopicPartition(self.marker_topic, p, 0) for p, end in ends.items() if end > 0])
            last, deadline = None, time.monotonic() + self.timeout
            while any(end > 0 for end in ends.values()):
                if time.monotonic() > deadline:
                    raise SinkError(
                        f"output.kafka.marker_topic: {self.marker_topic} not readable to its end within "
                        f"{self.timeout:g}s (a transaction of another producer open there?)"
                    )
                message = consumer.poll(0.2)
                if message is not None and message.error() is None and message.key() == self.run.encode():
                    last = json.loads(message.value())
                for tp in consumer.position([TopicPartition(self.marker_topic, p) for p in ends]):
                    if tp.offset >= ends[tp.partition]:
                        ends[tp.partition] = 0
            return last
        except KafkaException as e:
            raise SinkError(f"output.kafka.marker_topic: cannot read {self.marker_topic}: {e}") from None
        finally:
            probe.close()
            consumer.close()

    # -- during the run --------------------------------------------------------------------------------------
    def deliver(self, counts: dict[str, int], label: str | int) -> None:
        """A checkpoint is complete (`label`: its id): the rows of the result files its commit `counts` covers,
        in one transaction, by the sink's thread.  A failure of an earlier one ends the run here."""
        self.check()
        if not self.complete:
            self._pending.append(self._thread.submit(self._transaction, dict(counts), label))

    def behind(self) -> bool:
        """More than one checkpoint's transaction waits for the broker: ingest pauses until it catches up, so a
        slow broker slows the cluster and the result files not yet sent stay a checkpoint interval's worth."""
        self.check()
        return len(self._pending) > 1

    def check(self) -> None:
        """Re-raise what made a finished transaction fail."""
        while self._pending and self._pending[0].done():
            self._pending.pop(0).result()

    def finish(self, counts: dict[str, int]) -> dict:
        """The end of the run: every result file (`counts`) produced, the last transaction marked `end`; the
        summary's numbers."""
        self.deliver(counts, "end")
        for future in self._pending:
            future.result()
        self._pending = []
        self._thread.shutdown()
        return {
            "topic": self.topic,
            "rows": self.rows,
            "transactions": self.transactions,
            "seconds": round(self.seconds, 3),
            "exactly_once": self.exact,
        }

    def _transaction(self, counts: dict[str, int], label: str | int) -> None:
        started = time.perf_counter()
        if self.exact:
            self._call(self.producer.begin_transaction)
        for series, n in sorted(counts.items()):
            for i in range(self.sent.get(series, 0), n):
                self._file(self.results / f"{series}-{i:06d}.{self.fmt}")
        if self.exact:
            marker = {"run": self.run, "checkpoint": label, "files": {**self.sent, **counts}}
            self._produce(self.marker_topic, [json.dumps(marker)], [self.run])
            faults.reached(0, "sink-commit")
            self._call(self.producer.commit_transaction, self.timeout)
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

    def _produce(self, topic: str, values: list[str], keys: list[str]) -> None:
        """Hand the records to the producer; while its queue is full wait for the broker (the back-pressure)."""
        produce, poll = self.producer.produce, self.producer.poll
        for value, key in zip(values, keys):
            while True:
                try:
                    produce(topic, value, key)
                    break
                except BufferError:
                    poll(0.05)
                    if self.failed:
                        raise SinkError(f"output.kafka.topic: {topic}: {self.failed}") from None
        poll(0)

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
                time.sleep(0.2)
