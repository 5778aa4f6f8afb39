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
The Kafka result sink (protocol.kafka_sink) beside the broker's ceiling for its records: a run's result rows
(at most SINK_ROWS) sent as a slave sends its result files at a checkpoint (read, records built, produced, the
transaction committed), alternated with `produce` of the same records prebuilt in one transaction, CPU
nanoseconds a row of this process (librdkafka's threads included; the broker runs apart) and rows a second;
the target is at most SINK_TARGET_NS of CPU a row.  And the files' runs again with checkpoints, without and
with the sink (exactly once), alternated with the others: the rate with the sink against the rate without.
Then the delay to the result topic (`--delay-seconds`, default 4): records produced at half the topics' median
in-run rate (at most DELAY_RATE_CAP, the test broker's bound) into unbounded topics while the cluster joins
them with checkpoints every 0.5 s and the Kafka result sink, each stamped with its produce time as its event
time; the result topic read with read_committed after a stop signal gives, per pair, its record's time minus
its later input record's (p50, p99, max).
Output: kafka.md, kafka.json.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from itertools import repeat
from pathlib import Path

import numpy as np

from bench.ab import Comparison, parser
from bench.cluster import RunFailed, run_cluster
from bench.search import median
from deploy.broker import BrokerUnavailable, local_broker
from protocol.plan import Plan, load_plan
from protocol.output import read_tables

RATE_TARGET = 0.5
#: the sink's CPU a result row at most (ns), and the rate with the sink at least this share of the rate without
SINK_TARGET_NS, SINK_RATE_TARGET = 1500, 0.5
#: result rows the sink's cost is measured on at most, and the checkpoint interval of the runs with the sink
SINK_ROWS, SINK_CHECKPOINT = 200_000, 5
PARTITIONS, USERS, ADS = 4, 20_000, 300
ROWS = {True: 400_000, False: 1_200_000}  #: --quick or not: records of both streams together
#: the delay run's rate at most: the test broker (noida-db) keeps its log in one JSON file it rewrites every second,
#: and past a few hundred thousand records it serves the result topic's reader too slowly (at 100K records/s for 3 s
#: the reader got nothing in time); a real Kafka cluster has no such bound
DELAY_RATE_CAP = 20_000.0
STREAMS = {
    "impressions": {
        "id": "impression_id",
        "time": "shown_at",
        "schema": {
            "impression_id": "int64",
            "user_id": "string",
            "ad_id": "int64",
            "shown_at": "timestamp[ms, tz=UTC]",
        },
    },
    "clicks": {
        "id": "click_id",
        "time": "clicked_at",
        "schema": {"click_id": "int64", "user_id": "string", "clicked_at": "timestamp[ms, tz=UTC]", "cost": "double"},
    },
}


def toml_table(d: dict[str, str]) -> str:
    return "{" + ", ".join(f'{k}="{v}"' for k, v in d.items()) + "}"


def iso(ms: np.ndarray) -> np.ndarray:
    return np.datetime_as_string(ms.astype("datetime64[ms]"), unit="ms", timezone="UTC")


def workload(rows: int, seed: int = 5, at_ms: dict[str, np.ndarray] | None = None) -> dict:
    """Per stream: its JSON values in time order and each one's partition (its user's).  Times are now's (the
    broker deletes records older than 7 days), or `at_ms` (per stream, its records' times in ms)."""
    rng = np.random.default_rng(seed)
    t0 = int(time.time() * 1000)
    n = {"impressions": rows * 2 // 3, "clicks": rows - rows * 2 // 3}
    out = {}
    for name, m in n.items():
        step = rng.integers(0, 5, m) * (2 if name == "impressions" else 4)
        at = iso(at_ms[name] if at_ms is not None else t0 + np.cumsum(step))
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


def create_topic(bootstrap: str, topic: str) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap})  # kept while the answer comes
    admin.create_topics([NewTopic(topic, PARTITIONS, 1)])[topic].result(30)


def produce_all(producer, topic: str, records) -> None:
    """Each (value, key, partition; -1: the producer's choice) of `records`, waiting while the queue is full."""
    produce = producer.produce
    for value, key, partition in records:
        while True:
            try:
                produce(topic, value, key, partition)
                break
            except BufferError:  # the producer's queue is full: let it send
                producer.poll(0.05)


def fill_topic(bootstrap: str, topic: str, values: list[bytes], partition: np.ndarray) -> None:
    from confluent_kafka import Producer

    create_topic(bootstrap, topic)
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20, "compression.type": "lz4"})
    produce_all(producer, topic, zip(values, repeat(None), partition.tolist()))
    if producer.flush(300):
        raise RunFailed(f"records for {topic} not delivered")


def sink_delay(bs: str, rate: float, seconds: float, slaves: int, folder: Path) -> dict:
    """The delay from a record's produce time to its pairs' records in the result topic.  Records of both streams
    are produced at `rate` for `seconds` into unbounded topics, each stamped with its scheduled produce time,
    which is its event time (`time = "@timestamp"`), while the cluster joins them with checkpoints and the Kafka
    sink; then a stop signal, and the result topic read with read_committed: per pair, its record's timestamp
    (when its slave produced it) minus the later of its two records' times.  p50, p99 and max in seconds."""
    import json
    import signal
    import subprocess

    from confluent_kafka import Consumer, Producer, TopicPartition

    from deploy.launch import mpi_env

    names = {n: f"paced-{n}" for n in STREAMS}
    for t in [*names.values(), "paced-pairs"]:
        create_topic(bs, t)
    data = workload(int(rate * seconds), 7)
    records = [(names[n], v, p) for n in STREAMS for v, p in zip(data[n][0], data[n][1].tolist())]
    order = np.argsort(np.r_[np.linspace(0, 1, len(data["impressions"][0])), np.linspace(0, 1, len(data["clicks"][0]))])
    interval = 5  # checkpoints every 5 distribution epochs of 0.1 s
    sets = ["join.lower=0s", "join.upper=30s", "join.max_delay=1s"]
    for n, spec in STREAMS.items():
        declared = {k: v for k, v in spec["schema"].items() if k != spec["time"]}
        sets += [
            f'streams.{n}.kafka={{bootstrap="{bs}", topic="{names[n]}"}}',
            f"streams.{n}.key=user_id",
            f"streams.{n}.id={spec['id']}",
            f'streams.{n}.time="@timestamp"',
            f"streams.{n}.schema={toml_table(declared)}",
            f'streams.{n}.payload=["@timestamp"]',
        ]
    sets += [
        f'output.kafka.bootstrap="{bs}"',
        'output.kafka.topic="paced-pairs"',
        f"checkpoint.interval={interval}",
        f"output.path={folder / 'out'}",
        "metrics.endpoint=127.0.0.1:0",
        "output.progress=0",
    ]
    err = open(folder / "stderr", "w+")
    proc = subprocess.Popen(  # through the launcher, which a stop signal ends cleanly (docs/operating.md)
        [
            sys.executable,
            "-m",
            "deploy.launch",
            "-n",
            str(slaves + 1),
            "--",
            *(x for kv in sets for x in ("--set", kv)),
        ],
        env=mpi_env(),
        stdout=subprocess.DEVNULL,
        stderr=err,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while "started:" not in (folder / "stderr").read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RunFailed(f"the paced Kafka run did not start: {(folder / 'stderr').read_text()[-2000:]}")
            time.sleep(0.1)
        producer = Producer({"bootstrap.servers": bs, "linger.ms": 5, "queue.buffering.max.messages": 1_000_000})
        began = time.time()
        for k, i in enumerate(order.tolist()):
            due = began + k / rate
            if due > time.time():
                producer.poll(0)
                time.sleep(max(0.0, due - time.time()))
            topic, value, partition = records[i]
            producer.produce(topic, value, partition=partition, timestamp=int(due * 1000))
        producer.flush(60)
        time.sleep(3 * interval * 0.1 + 2.0)  # the last checkpoints commit what the records made
        proc.send_signal(signal.SIGTERM)  # the records taken in are joined and sent, the end's transaction too
        if proc.wait(timeout=300) != 0:
            raise RunFailed(f"the paced Kafka run failed: {(folder / 'stderr').read_text()[-2000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        err.close()
    consumer = Consumer({"bootstrap.servers": bs, "group.id": "bench-delay", "isolation.level": "read_committed"})
    consumer.assign([TopicPartition("paced-pairs", q, 0) for q in range(PARTITIONS)])
    delays, quiet = [], time.monotonic()
    while time.monotonic() - quiet < 10:
        batch = consumer.consume(10_000, 1.0)
        quiet = time.monotonic() if batch else quiet
        for m in batch:
            if m.error() is None:
                row = json.loads(m.value())
                later = max(row["impressions_@timestamp"], row["clicks_@timestamp"])
                at = np.datetime64(later.rstrip("Z"), "ms").astype(np.int64)
                delays.append((m.timestamp()[1] - int(at)) / 1000)
    consumer.close()
    d = np.array(delays)
    pick = lambda q: round(float(np.percentile(d, q)), 3) if len(d) else None  # noqa: E731
    return {
        "rate": rate,
        "records": len(records),
        "pairs": len(d),
        "checkpoint_seconds": interval * 0.1,
        "p50": pick(50),
        "p99": pick(99),
        "max": pick(100),
    }


def sink_cost(bs: str, plan: Plan, table, repeats: int) -> dict:
    """The sink's CPU a row and rate sending `table` as one slave's result file in a transaction, alternated with
    the broker's ceiling: the same records prebuilt, produced in one transaction by a producer of the same
    settings.  `plan`: the run's plan (its streams name the key columns; its output folder is used)."""
    import pyarrow.parquet as pq

    from protocol.kafka_sink import ResultProducer, key_columns, records

    results = Path(plan.output.path) / "results"
    results.mkdir(parents=True)
    pq.write_table(table, results / "slave-001-000000.parquet")
    topic = plan.output.kafka.topic
    create_topic(bs, topic)
    pieces = [records(table.slice(i, 65536), key_columns(plan.streams)) for i in range(0, table.num_rows, 65536)]
    values, keys = [v for p in pieces for v in p[0]], [k for p in pieces for k in p[1]]
    cpu: dict[str, list] = {"sink": [], "ceiling": []}
    rate: dict[str, list] = {"sink": [], "ceiling": []}
    for i in range(repeats):
        for kind in cpu:
            sink = ResultProducer(plan, 1, f"bench-{kind}-{i}")
            sink.begin()
            p = sink.producer
            began, clock = time.process_time(), time.perf_counter()
            if kind == "sink":
                sink.transaction({"slave-001": 1}, i)
            else:
                p.begin_transaction()
                produce_all(p, topic, zip(values, keys, repeat(-1)))
                p.commit_transaction(60)
            cpu[kind].append(round((time.process_time() - began) / len(values) * 1e9))
            rate[kind].append(round(len(values) / (time.perf_counter() - clock)))
    return {
        "rows": len(values),
        "cpu_ns_per_row": cpu,
        "rows_per_s": rate,
        "medians": {k: {"cpu_ns_per_row": median(cpu[k]), "rows_per_s": median(rate[k])} for k in cpu},
    }


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
    p.add_argument(
        "--delay-seconds",
        type=float,
        default=4.0,
        help="seconds of records produced at half the topics' rate for the delay to the result topic (0: none)",
    )
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
                    f"streams.{n}.schema={toml_table(spec['schema'])}",  # files carry their own
                )
            ]
            files = [f'streams.{n}.path="{tmp}/{n}.jsonl"' for n in STREAMS]
            checkpoints = [*files, f"checkpoint.interval={SINK_CHECKPOINT}"]
            sink = [f'output.kafka.bootstrap="{bs}"', 'output.kafka.topic="pairs"']
            create_topic(bs, "pairs")
            ab = Comparison(
                "python -m bench.kafka " + " ".join(argv),
                a,
                common,
                {
                    "files": files,
                    "kafka": topics,
                    "kafka-2": [*topics, "cluster.dispatchers=2"],  # each dispatcher its share of the partitions
                    "files+checkpoints": checkpoints,
                    "files+checkpoints+sink": [*checkpoints, *sink],
                },
                {"kafka-2": a.slaves + 2},
            )
            ab.run(Path(tmp) / "runs")
            kept = run_cluster(
                a.slaves + 1,
                [*common, *files],
                Path(tmp) / "result-rows",
                a.timeout,
                keep=lambda out: read_tables(out / "results").slice(0, SINK_ROWS),
            )["kept"]
            own = [*common, *files, *sink, f"output.path={tmp}/sink", 'output.kafka.topic="sink-cost"']
            sink_numbers = ab.data["sink"] = sink_cost(
                bs, load_plan(None, own).with_sink("bench", False), kept, a.repeats
            )
            ceilings = [broker_ceiling(bs, list(STREAMS), rows) for _ in range(a.repeats)]
            half = min(max(1000.0, ab.data["medians"]["kafka"] / 2), DELAY_RATE_CAP)
            delay = sink_delay(bs, half, a.delay_seconds, a.slaves, Path(tmp)) if a.delay_seconds > 0 else None
            if len({n for runs in ab.data["results"].values() for n in runs}) != 1:
                raise RunFailed(f"the files and the topics gave different results: {ab.data['results']}")
    except (RunFailed, BrokerUnavailable) as e:
        print(f"bench.kafka: {e}", file=sys.stderr)
        return 1
    ceiling = ab.data["broker_ceiling"] = median(ceilings)
    ab.data["sink_delay"] = delay
    ab.data["broker_ceilings"] = [round(c) for c in ceilings]
    whole = {m: median(r) for m, r in ab.data["whole_process"].items()}
    share = ab.data["share_of_ceiling"] = round(whole["kafka"] / ceiling, 4)
    sink_ns = sink_numbers["medians"]["sink"]["cpu_ns_per_row"]
    ceiling_ns = sink_numbers["medians"]["ceiling"]["cpu_ns_per_row"]
    with_sink = {
        k: round(r["files+checkpoints+sink"] / r["files+checkpoints"], 3)
        for k, r in (("in_run", ab.data["medians"]), ("whole_process", whole))
    }
    ab.data["sink_to_without"] = with_sink
    #: the target against the sink and against produce alone: a target below the ceiling no sink can meet
    ab.data["sink_target"] = {
        "cpu_ns_per_row": SINK_TARGET_NS,
        "met": sink_ns <= SINK_TARGET_NS,
        "below_ceiling": ceiling_ns > SINK_TARGET_NS,
        "own_ns_per_row": sink_ns - ceiling_ns,
    }
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
            *(
                [
                    f"Delay to the result topic (records produced at {delay['rate']:,.0f}/s, half the topics' "
                    f"in-run rate or at most {DELAY_RATE_CAP:,.0f}/s, the test broker's bound, for "
                    f"{a.delay_seconds:g} s; checkpoints every {delay['checkpoint_seconds']:g} s; "
                    f"{delay['pairs']:,} pairs read with read_committed): p50 {delay['p50']} s, p99 {delay['p99']} "
                    f"s, max {delay['max']} s from a pair's later record to its record in the result topic.",
                    "",
                ]
                if delay
                else []
            ),
            f"The Kafka result sink on {sink_numbers['rows']:,} result rows of a files run (one slave's file, one "
            f"transaction; medians of {a.repeats}, alternated): {sink_ns:,.0f} ns of CPU a row "
            f"(target <= {SINK_TARGET_NS}: {'met' if ab.data['sink_target']['met'] else 'NOT met'}), "
            f"{sink_numbers['medians']['sink']['rows_per_s']:,.0f} rows/s; the broker's ceiling for the same "
            f"records (prebuilt, `produce` in one transaction): {ceiling_ns:,.0f} ns a row, "
            f"{sink_numbers['medians']['ceiling']['rows_per_s']:,.0f} rows/s (the sink {ceiling_ns / sink_ns:.2f} of "
            f"its rate by CPU; its own work above the ceiling {sink_ns - ceiling_ns:,.0f} ns a row)"
            + (
                ": the target is below the ceiling itself, out of reach on this machine for a sink that hands "
                "each record to `produce`"
                if ab.data["sink_target"]["below_ceiling"]
                else ""
            )
            + f".  The files' runs with checkpoints every {SINK_CHECKPOINT} epochs, with the sink "
            f"against without: in-run {with_sink['in_run']:.3f}, whole process {with_sink['whole_process']:.3f} "
            f"(target >= {SINK_RATE_TARGET} where the broker is not the bound).",
            "",
            f"The broker's ceiling (a consumer alone, decoding nothing, medians of {a.repeats}): {ceiling:,.0f} "
            f"records/s; the Kafka runs' whole process is {share:.3f} of it.  The in-run rate can pass the ceiling: "
            "the consumer fetches ahead (librdkafka's queue) while the ranks start, before the in-run clock starts.",
        ],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
