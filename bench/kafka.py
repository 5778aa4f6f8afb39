"""`python -m bench.kafka [--quick] [--repeats 3] [--slaves 2] [--out bench-report]`: the cluster fed by two
Kafka topics against the same rows read from files.

The workload is the clicks example's, wider: impressions (impression_id, user_id as text, ad_id, shown_at as
ISO-8601 text) and clicks (click_id, user_id, clicked_at, cost), 20,000 users, clicks joined with the
impressions of the 30 s before them.  The same JSON values are written once as two JSON-lines files and once
into two topics of 4 partitions each (a user's records in one partition, in time order) on the local broker the
suite uses (deploy.broker: noida-db).  Unpaced runs alternate the files and the topics (bounded: read to the
end offsets of the start); the report gives each side's in-run rates and the ratio of the medians against the
target (a Kafka source at least half the file source's rate on the same rows, one dispatcher), and the topics
read by two dispatchers, each its share of the partitions.

The broker's ceiling is measured beside them: a plain confluent-kafka consumer taking every record of both
topics in batches, decoding nothing.  No source can take records faster than the broker hands them out, so
the Kafka runs are also given as a share of that ceiling: on a test broker slower than the engine (noida-db
keeps its log in one JSON file and serves a few hundred thousand records a second) that share, not the
ratio to the files, says what the engine's own source costs.
Output: kafka.md, kafka.json.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.ab import Comparison, parser
from bench.cluster import RunFailed
from bench.search import median
from deploy.broker import BrokerUnavailable, local_broker

RATE_TARGET = 0.5
PARTITIONS, USERS, ADS = 4, 20_000, 300
ROWS = {True: 400_000, False: 1_200_000}  #: --quick or not: records of both streams together
STREAMS = {
    "impressions": {
        "id": "impression_id",
        "time": "shown_at",
        "schema": '{impression_id="int64", user_id="string", ad_id="int64", shown_at="timestamp[ms, tz=UTC]"}',
    },
    "clicks": {
        "id": "click_id",
        "time": "clicked_at",
        "schema": '{click_id="int64", user_id="string", clicked_at="timestamp[ms, tz=UTC]", cost="double"}',
    },
}


def iso(ms: np.ndarray) -> np.ndarray:
    return np.datetime_as_string(ms.astype("datetime64[ms]"), unit="ms", timezone="UTC")


def workload(rows: int, seed: int = 5) -> dict[str, tuple[list[bytes], np.ndarray]]:
    """Per stream: its JSON values in time order and each one's partition (its user's).  Times are now's (the
    broker deletes records older than 7 days)."""
    rng = np.random.default_rng(seed)
    t0 = int(time.time() * 1000)
    n = {"impressions": rows * 2 // 3, "clicks": rows - rows * 2 // 3}
    out = {}
    for name, m in n.items():
        at = iso(t0 + np.cumsum(rng.integers(0, 5, m) * (2 if name == "impressions" else 4)))
        users = rng.integers(0, USERS, m)
        if name == "impressions":
            ads = rng.integers(1, ADS, m)
            values = [
                f'{{"impression_id":{i},"user_id":"u_{u}","ad_id":{a},"shown_at":"{t}"}}'.encode()
                for i, u, a, t in zip(range(m), users.tolist(), ads.tolist(), at.tolist())
            ]
        else:
            cost = np.round(rng.random(m) * 2, 4)
            values = [
                f'{{"click_id":{i},"user_id":"u_{u}","clicked_at":"{t}","cost":{c}}}'.encode()
                for i, u, t, c in zip(range(m), users.tolist(), at.tolist(), cost.tolist())
            ]
        out[name] = (values, users % PARTITIONS)
    return out


def fill_topic(bootstrap: str, topic: str, values: list[bytes], partition: np.ndarray) -> None:
    from confluent_kafka import Producer
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(topic, PARTITIONS, 1)])[topic].result(30)
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20, "compression.type": "lz4"})
    for v, p in zip(values, partition.tolist()):
        while True:
            try:
                producer.produce(topic, v, partition=p)
                break
            except BufferError:  # the producer's queue is full: let it send
                producer.poll(0.05)
    if producer.flush(300):
        raise RunFailed(f"records for {topic} not delivered")


def broker_ceiling(bootstrap: str, topics: list[str], records: int) -> float:
    """Records a second a plain consumer takes from the topics' beginnings, in batches, decoding nothing."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "bench-ceiling", "enable.auto.commit": False})
    consumer.assign([TopicPartition(t, p, 0) for t in topics for p in range(PARTITIONS)])
    began, got = time.monotonic(), 0
    while got < records:
        got += len(consumer.consume(65536, 1.0))
    rate = records / (time.monotonic() - began)
    consumer.close()
    return rate


def settings(name: str, spec: dict) -> list[str]:
    return [f"streams.{name}.key=user_id", f"streams.{name}.time={spec['time']}", f"streams.{name}.id={spec['id']}"]


def main(argv: list[str]) -> int:
    quick = f"{ROWS[True]:,} records instead of {ROWS[False]:,}"
    p = parser("python -m bench.kafka", __doc__, 0, 0, 3, quick)
    p.add_argument("--rows", type=int, help="records of both streams together (instead of the above)")
    a = p.parse_args(argv)
    rows = a.rows or ROWS[a.quick]
    data = workload(rows)
    try:
        with tempfile.TemporaryDirectory(prefix="streamjoin-kafka-") as tmp, local_broker(Path(tmp) / "broker") as bs:
            for name, (values, partition) in data.items():
                (Path(tmp) / f"{name}.jsonl").write_bytes(b"\n".join(values) + b"\n")
                fill_topic(bs, name, values, partition)
            common = ["join.lower=0s", "join.upper=30s", "join.max_delay=5s"]
            common += [s for name, spec in STREAMS.items() for s in settings(name, spec)]
            topics = [
                s
                for n, spec in STREAMS.items()
                for s in (
                    f'streams.{n}.kafka={{bootstrap="{bs}", topic="{n}", bounded=true}}',
                    f"streams.{n}.schema={spec['schema']}",  # files carry their own
                )
            ]
            ab = Comparison(
                "python -m bench.kafka " + " ".join(argv),
                a,
                common,
                {
                    "files": [f'streams.{n}.path="{tmp}/{n}.jsonl"' for n in STREAMS],
                    "kafka": topics,
                    "kafka-2": [*topics, "cluster.dispatchers=2"],  # each dispatcher its share of the partitions
                },
                {"kafka-2": a.slaves + 2},
            )
            ab.run(Path(tmp) / "runs")
            ceilings = [broker_ceiling(bs, list(STREAMS), rows) for _ in range(a.repeats)]
            if len({n for runs in ab.data["results"].values() for n in runs}) != 1:
                raise RunFailed(f"the files and the topics gave different results: {ab.data['results']}")
    except (RunFailed, BrokerUnavailable) as e:
        print(f"bench.kafka: {e}", file=sys.stderr)
        return 1
    ceiling = ab.data["broker_ceiling"] = median(ceilings)
    ab.data["broker_ceilings"] = [round(c) for c in ceilings]
    whole = {m: median(r) for m, r in ab.data["whole_process"].items()}
    share = ab.data["share_of_ceiling"] = round(whole["kafka"] / ceiling, 4)
    ab.write(
        "kafka",
        f"Two Kafka topics against the same rows in files ({rows:,} records)",
        "source",
        [
            ab.verdict(RATE_TARGET),
            "",
            f"Whole process (mpirun's start to its exit, start-up included), medians: files {whole['files']:,.0f}, "
            f"kafka {whole['kafka']:,.0f} records/s ({whole['kafka'] / whole['files']:.3f}).",
            "",
            f"Two dispatchers, each reading half the partitions: {ab.data['medians']['kafka-2']:,.0f} tuples/s "
            f"in-run ({ab.data['ratios']['kafka-2'] / ab.data['ratio']:.3f} of one dispatcher's); on 2 cores the "
            "dispatchers share the cores with the slaves and the broker, so this shows that ingest is split, not "
            "how it scales.",
            "",
            f"The broker's ceiling (a consumer alone, decoding nothing, medians of {a.repeats}): {ceiling:,.0f} "
            f"records/s; the Kafka runs' whole process is {share:.3f} of it.  The in-run rate can pass the ceiling: "
            "the consumer fetches ahead (librdkafka's queue) while the ranks start, before the in-run clock starts.",
        ],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
