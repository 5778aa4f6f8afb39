"""The Kafka result sink's rank 0 part (`[output.kafka]`, docs/output.md#the-kafka-result-sink): the run's id,
the topics, and with checkpoints what no slave's transaction sent -- before a recovered run goes on, and at the
end of the run.

With checkpoints it is Flink's two-phase-commit sink with the result files as the pre-commit: the files a
complete checkpoint's commit covers are on disk and never removed again.  Each slave sends its own files a
checkpoint covers in one transaction with a marker (protocol.kafka_sink; slave.joining: at the next
checkpoint's order, which rank 0 gives only once the one before is complete).  A recovery fences every
slave's producer of the crashed run (`init_transactions` with the same transactional id aborts an open
transaction), reads the committed markers with read_committed and sends, in one transaction of its own, what
the checkpoint it resumes from covers beyond them.  The end of the run is rank 0's last transaction, marked
`end`: a run restarted after it sends nothing more.  Without checkpoints rank 0 sends every file at the end,
idempotent, at least once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import json
import os
import secrets
import time
from pathlib import Path

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from protocol.errors import ConfigError, SinkError
from protocol.kafka_sink import ResultProducer, transactional_id
from protocol.output import SINK_RUN as RUN_FILE

if TYPE_CHECKING:
    from protocol.plan import Plan


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


class KafkaSink(ResultProducer):
    """Rank 0's producer (see the module's docstring); `plan.output.kafka.run` is the run's id."""

    def __init__(self, plan: Plan):
        exact = plan.checkpoint.enabled  #: transactions, else idempotent at least once
        super().__init__(plan, 0, "master" if exact else None)
        self.complete = False  #: the run's end is in Kafka already (a restart after it sends nothing more)

    def start(self, commit: dict[str, int] | None, slaves: list[int]) -> str:
        """Check the topics; with checkpoints fence the slaves' producers of a crashed run, read where their
        committed transactions got to and send what `commit` (the result file counts of the checkpoint resumed
        from; None: none) covers beyond it.  Returns a line for the operator."""
        self._topics()
        if not self.exact:
            return f"kafka sink: results to {self.topic} at the end of the run (at least once)"
        covered = commit or {}
        for series in sorted({*covered, *(f"slave-{r:03d}" for r in slaves)}):
            self._call(self._fenced(series).init_transactions, self.timeout)
        self.begin()
        self.sent, self.complete, newest = self._markers()
        beyond = sorted(s for s, n in self.sent.items() if n > covered.get(s, 0))
        if beyond and not self.complete:
            raise SinkError(
                f"{self.topic} holds rows of {beyond[0]}'s result files past the checkpoint resumed from (a "
                f"transaction of checkpoint {newest} committed them; that checkpoint is gone): resending what "
                "follows would duplicate them; start afresh with another output.kafka.topic"
            )
        if self.complete:
            return f"kafka sink: run {self.run} is complete in {self.topic} already: nothing more is sent"
        line = f"kafka sink: results to {self.topic}, each slave's in a transaction per checkpoint (run {self.run})"
        missing = sum(max(0, n - self.sent.get(s, 0)) for s, n in covered.items())
        if missing:  # the crash came between a checkpoint's manifest and a slave's commit
            self.transaction(covered, "recovered")
            line += f"; {missing} result files the checkpoint covers sent now, no transaction had them"
        return line

    def finish(self, counts: dict[str, int]) -> dict:
        """The end of the run (every slave's transactions committed: they answered before their final reports):
        every result file (`counts`) not sent yet, in the last transaction, marked `end`; the summary's numbers."""
        if not self.complete:
            if self.exact:
                self.sent = self._markers()[0]
            self.transaction(counts, "end")
        return {
            "topic": self.topic,
            "files": sum(counts.values()),
            "rows_at_end": self.rows,
            "transactions_at_end": self.transactions,
            "seconds_at_end": round(self.seconds, 3),
            "exactly_once": self.exact,
        }

    def _fenced(self, series: str):
        """A producer holding `series`' transactional id for a moment: taking it aborts an open transaction."""
        return Producer({**self.client, "transactional.id": transactional_id(self.run, series)})

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

    def _markers(self) -> tuple[dict[str, int], bool, str | int | None]:
        """This run's committed markers: per slave's files the most any transaction sent, whether the end's is
        among them, and the newest checkpoint named.  The marker topic is read with read_committed to where it
        ended after the fence (a transaction of another producer still open there holds the reader back)."""
        reader = lambda level: Consumer(  # noqa: E731
            {
                **self.client,
                "group.id": f"streamjoin-sink-{self.run}",
                "isolation.level": level,
                "enable.auto.commit": False,
            }
        )
        probe, consumer = reader("read_uncommitted"), reader("read_committed")
        sent: dict[str, int] = {}
        complete, newest = False, None
        try:
            meta = probe.list_topics(self.marker_topic, timeout=self.timeout).topics[self.marker_topic]
            ends = {  # a topic just made may have no leader yet: retried
                p: self._call(probe.get_watermark_offsets, TopicPartition(self.marker_topic, p), self.timeout)[1]
                for p in meta.partitions
            }
            consumer.assign([TopicPartition(self.marker_topic, p, 0) for p, end in ends.items() if end > 0])
            deadline = time.monotonic() + self.timeout
            while any(end > 0 for end in ends.values()):
                if time.monotonic() > deadline:
                    at = consumer.position([TopicPartition(self.marker_topic, p) for p, end in ends.items() if end])
                    stuck = ", ".join(
                        f"partition {tp.partition} at {max(tp.offset, 0)} of {ends[tp.partition]}" for tp in at
                    )
                    raise SinkError(
                        f"output.kafka.marker_topic: {self.marker_topic} not readable to its end within "
                        f"{self.timeout:g}s with read_committed ({stuck}): a transaction there is still open after "
                        "this run's were fenced -- another producer's, or one a broker that lost its transaction "
                        "state no longer ends (docs/output.md#the-kafka-result-sink)"
                    )
                message = consumer.poll(0.2)
                if message is not None and message.error() is None and message.key() == self.run.encode():
                    marker = json.loads(message.value())
                    sent |= {s: max(n, sent.get(s, 0)) for s, n in marker["files"].items()}
                    complete |= marker["checkpoint"] == "end"
                    newest = marker["checkpoint"]
                for tp in consumer.position([TopicPartition(self.marker_topic, p) for p in ends]):
                    if tp.offset >= ends[tp.partition]:
                        ends[tp.partition] = 0
            return sent, complete, newest
        except KafkaException as e:
            raise SinkError(f"output.kafka.marker_topic: cannot read {self.marker_topic}: {e}") from None
        finally:
            probe.close()
            consumer.close()
