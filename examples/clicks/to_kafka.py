"""Produce the example's impressions and clicks into two Kafka topics, for examples/clicks/clicks-kafka.toml.

    python examples/clicks/to_kafka.py [--bootstrap HOST:PORT] [--data DIR] [--partitions N]

Reads what make_data.py wrote (DIR defaults to examples/clicks/data), creates the topics `impressions` and
`clicks` with N partitions each (4 by default; topics already there are kept as they are), and the topic
`impression-clicks` the join's results go to (clicks-kafka.toml's [output.kafka]), and produces every
row as one JSON object, keyed by its user, in the order of its file: the partitioner sends a user's rows to one
partition, so each partition keeps the order the site wrote them in, and the topics hold what the files hold.
The rows' own times travel in the values; the records' timestamps are the time of producing (a broker deletes
records by those, after its retention).  A test broker: `noida-db up --data-dir /tmp/kafka --only kafka
--kafka-port 9092` (pip install noida-db); any Kafka cluster in production.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
from confluent_kafka import KafkaException, Producer
from confluent_kafka.admin import AdminClient, NewTopic

HERE = Path(__file__).parent
RESULTS = "impression-clicks"  #: the topic clicks-kafka.toml writes the join's results to


def rows(data: Path) -> dict[str, pa.Table]:
    """The two streams as make_data.py wrote them, times as ISO-8601 text (what a JSON value carries)."""
    impressions = pa.concat_tables(
        pacsv.read_csv(f, convert_options=pacsv.ConvertOptions(column_types={"shown_at": pa.string()}))
        for f in sorted((data / "impressions").glob("*.csv"))
    )
    clicks = pq.read_table(data / "clicks.parquet")
    at = pc.strftime(clicks["clicked_at"], format="%Y-%m-%dT%H:%M:%SZ")  # %S of milliseconds: 09.945
    return {"impressions": impressions, "clicks": clicks.set_column(2, "clicked_at", at)}


def create_topics(bootstrap: str, names: list[str], partitions: int) -> None:
    """The topics, unless they are there already."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    there = admin.list_topics(timeout=30).topics
    wanted = [NewTopic(t, partitions, 1) for t in names if t not in there]
    for topic, done in (admin.create_topics(wanted) if wanted else {}).items():
        done.result(30)
        print(f"created topic {topic} ({partitions} partitions)")


def produce(bootstrap: str, topic: str, table: pa.Table) -> int:
    """Every row of `table` into `topic` as a JSON object, keyed by user_id; the rows produced."""
    producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True, "linger.ms": 20})
    failed: list[str] = []

    def report(err, _msg):
        if err is not None:
            failed.append(str(err))

    for row in table.to_pylist():  # a producer takes records one by one
        value = json.dumps(row).encode()
        while True:
            try:
                producer.produce(topic, value, key=row["user_id"].encode(), on_delivery=report)
                break
            except BufferError:  # its queue is full: let it send
                producer.poll(0.1)
    left = producer.flush(120)
    if failed or left:
        raise SystemExit(f"{topic}: {len(failed)} records failed ({failed[:1]}), {left} not sent")
    return table.num_rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bootstrap", default="127.0.0.1:9092", help="the cluster's host:port (default 127.0.0.1:9092)")
    p.add_argument("--data", type=Path, default=HERE / "data", help="make_data.py's folder")
    p.add_argument("--partitions", type=int, default=4, help="partitions of each topic created (default 4)")
    a = p.parse_args(argv)
    if not (a.data / "clicks.parquet").exists():
        raise SystemExit(f"no example data in {a.data}: run examples/clicks/make_data.py first")
    streams = rows(a.data)
    try:
        create_topics(a.bootstrap, [*streams, RESULTS], a.partitions)
        for topic, table in streams.items():
            print(f"produced {produce(a.bootstrap, topic, table):,} records into {topic}")
    except KafkaException as e:
        raise SystemExit(f"kafka at {a.bootstrap}: {e.args[0].str()}") from None
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
