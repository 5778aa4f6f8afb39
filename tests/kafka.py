"""Kafka for the tests: a real Kafka-protocol broker (noida-db on a free port of 127.0.0.1, the `broker` fixture
of tests/conftest.py), topics made and filled with confluent-kafka, the two streams of views and buys the Kafka
tests produce, their settings and their reference join (lateness judged per partition)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from deploy.broker import BrokerUnavailable, local_broker
from deploy.launch import mpi_env
from protocol.output import read_tables
from tests.reference import late_flags, reference_pairs
from tests.runs import Run, write_config

WINDOW, MAX_DELAY = 0.3, 0.25  # seconds


def start_broker(tmp_path_factory, data_dirs: dict | None = None):
    """deploy.broker's broker for a module's tests (its data folder noted in `data_dirs` by its address, for a
    test that stops it early), or the tests skipped with the reason it cannot start."""
    data = tmp_path_factory.mktemp("noida")
    try:
        with local_broker(data) as bootstrap:
            if data_dirs is not None:
                data_dirs[bootstrap] = data
            yield bootstrap
    except BrokerUnavailable as e:
        pytest.skip(str(e))


def create(bootstrap: str, topic: str, partitions: int) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(topic, partitions, 1)])[topic].result(30)


def produce(
    bootstrap: str, topic: str, partition: np.ndarray, values: list[bytes], stamps: np.ndarray | None = None
) -> np.ndarray:
    """The records into `topic` (idempotent: each partition keeps the order given); their offsets."""
    producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True, "linger.ms": 20})
    offsets = np.full(len(values), -1, np.int64)

    def delivered(i):
        def report(err, msg):
            assert err is None, err
            offsets[i] = msg.offset()

        return report

    for i, (p, v) in enumerate(zip(partition.tolist(), values)):
        extra = {} if stamps is None else {"timestamp": int(stamps[i])}
        while True:
            try:
                producer.produce(topic, v, partition=p, on_delivery=delivered(i), **extra)
                break
            except BufferError:  # the producer's queue is full: let it send
                producer.poll(0.1)
    assert producer.flush(60) == 0 and (offsets >= 0).all()
    return offsets


def stream(
    rng, n: int, first_id: int, partitions: int, t0: int, late_share: float = 0.0, spread: int = 4000, step: int = 12
) -> dict:
    """`n` records of users u0..u59, each user in partition crc32(user) % partitions (the same in every topic);
    times in ms rising within each partition by 1 to `step` - 1 ms a record, partition p shifted (partitions - 1 -
    p) * `spread` ms ahead of the last (by default out of order across partitions by far more than max_delay), a
    `late_share` of them 0.6 s back (late within their partition)."""
    users = [f"u{u}" for u in rng.integers(0, 60, n)]
    partition = np.array([zlib.crc32(u.encode()) % partitions for u in users], np.int64)
    at = t0 + np.cumsum(rng.integers(1, step, n)) + (partitions - 1 - partition) * spread
    at -= np.where(rng.random(n) < late_share, 600, 0)
    return {"id": np.arange(n) + first_id, "user": users, "at": at, "partition": partition}


def values(s: dict, id_column: str, with_time: bool = True) -> list[bytes]:
    """The records' values: JSON objects of id, user, time (unless the records' timestamps carry it) and page."""
    return [
        json.dumps({id_column: i, "user": u, **({"at": t} if with_time else {}), "page": f"/p{i % 7}"}).encode()
        for i, u, t in zip(s["id"].tolist(), s["user"], s["at"].tolist())
    ]


def settings(bootstrap: str, topics: dict[str, str], **extra) -> dict:
    """Both streams from their topics (bounded), users as keys, `at` in ms as event time."""
    out = {
        "join.window": f"{WINDOW}s",
        "join.max_delay": f"{MAX_DELAY}s",
        "partitioning.partitions": 8,
        "epochs.distribution": "100ms",
    }
    for name, topic in topics.items():
        id_column = "vid" if name == "views" else "bid"
        out |= {
            f"streams.{name}.kafka": {"bootstrap": bootstrap, "topic": topic, "bounded": True},
            f"streams.{name}.key": "user",
            f"streams.{name}.time": "at",
            f"streams.{name}.time_unit": "ms",
            f"streams.{name}.id": id_column,
            f"streams.{name}.schema": {id_column: "int64", "user": "string", "at": "int64", "page": "string"},
        }
    return out | extra


def reference(r: dict, s: dict) -> tuple[np.ndarray, np.ndarray, dict]:
    """(encoded pairs, late ids encoded stream * 2**40 + id, the on-time ids per side) of two streams given as
    produced: a row is late iff late within its own partition (below the largest earlier time there minus
    max_delay), pairs among the rows on time."""
    codes: dict = {}
    parts, on_time = [], {}
    for side, x in enumerate((r, s)):
        late = np.zeros(len(x["id"]), bool)
        for p in np.unique(x["partition"]):
            mine = x["partition"] == p
            late[mine] = late_flags(x["at"][mine] * 1000, MAX_DELAY)
        keys = np.array([codes.setdefault(u, len(codes)) for u in x["user"]], np.int64)
        parts.append((np.full(len(late), side), x["id"], x["at"] * 1000, keys, late))
        on_time[side] = x["id"][~late]
    stream, ids, ts, keys, late = (np.concatenate(c) for c in zip(*parts))
    pairs, _ = reference_pairs(stream[~late], ids[~late], ts[~late], keys[~late], WINDOW, 1e9)
    return pairs, np.sort(stream[late] * 2**40 + ids[late]), on_time


def two_topics(
    tmp_path: Path, broker: str, views: dict, buys: dict, partitions: int | tuple[int, int] = 4
) -> dict[str, str]:
    """The streams' topics, named after the test, holding their records (each stream's `offset` noted);
    `partitions`: both topics', or views' and buys'."""
    topics = {"views": f"views-{tmp_path.name}", "buys": f"buys-{tmp_path.name}"}
    counts = partitions if isinstance(partitions, tuple) else (partitions, partitions)
    for (name, s, id_column), n in zip((("views", views, "vid"), ("buys", buys, "bid")), counts):
        create(broker, topics[name], n)
        s["offset"] = produce(broker, topics[name], s["partition"], values(s, id_column))
    return topics


def read_topic(
    bootstrap: str, topic: str, isolation: str = "read_committed", within: float = 300
) -> list[tuple[int, int, bytes, bytes]]:
    """Every record of `topic` to its end (TimeoutError if not there `within` seconds): (partition, offset, key,
    value)."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"check-{topic}-{isolation}",
            "isolation.level": isolation,
            "enable.auto.commit": False,
            # the test broker answers a fetch with all it holds, past fetch.max.bytes: 107 MB after 20 minutes
            # of the nemesis soak's sink, above librdkafka's default 100 MB, refused and fetched again for minutes
            "receive.message.max.bytes": 1_000_000_000,
        }
    )
    try:
        parts = consumer.list_topics(topic, timeout=20).topics[topic].partitions
        ends = {p: consumer.get_watermark_offsets(TopicPartition(topic, p), 20)[1] for p in parts}
        consumer.assign([TopicPartition(topic, p, 0) for p in parts])
        got, deadline = [], time.monotonic() + within
        while any(consumer.position([TopicPartition(topic, p)])[0].offset < end for p, end in ends.items() if end):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{topic} not read to its end within {within:g}s")
            for m in consumer.consume(1000, 0.2):
                if m.error() is None:
                    got.append((m.partition(), m.offset(), m.key() or b"", m.value()))
        return got
    finally:
        consumer.close()


def now_ms() -> int:
    """The broker deletes records older than 7 days: event times are now."""
    return int(time.time() * 1000)


def checkpointed(broker: str, topics: dict[str, str], **extra) -> dict:
    """`settings` with checkpoints every 2 epochs (every one kept), views' payload with the records' partition and
    offset, each stream's group named after its topic (`assert_committed`)."""
    cfg = settings(
        broker,
        topics,
        **{
            "streams.views.payload": ["page", "@partition", "@offset"],
            "checkpoint.interval": 2,
            "checkpoint.keep": 100,
            **extra,
        },
    )
    for name, topic in topics.items():
        cfg[f"streams.{name}.kafka"]["group"] = f"group-{topic}"
    return cfg


def produce_waves(broker: str, topics: dict, streams: dict, waves: list[np.ndarray], pause: float) -> None:
    """Each wave's records of both streams into their topics (wave i: the records of stream `name` whose indexes
    waves[i][name] lists, in that order), `pause` seconds apart: records that come while the cluster runs."""
    producer = Producer({"bootstrap.servers": broker, "enable.idempotence": True, "linger.ms": 2})
    for wave in waves:
        for name, s in streams.items():
            for i in wave[name].tolist():
                producer.produce(topics[name], s["value"][i], partition=int(s["partition"][i]))
        assert producer.flush(30) == 0
        time.sleep(pause)


def assert_committed(broker: str, topics: dict, places: list[dict]) -> None:
    """The streams' groups have committed each partition's offset of the checkpoint `places` (its streams')."""
    for topic, place in zip(topics.values(), places):
        consumer = Consumer({"bootstrap.servers": broker, "group.id": f"group-{topic}"})
        try:
            committed = consumer.committed([TopicPartition(topic, p) for p in range(len(place["offsets"]))], timeout=20)
        finally:
            consumer.close()
        assert [c.offset for c in committed] == place["offsets"], topic


def written_while_running(tmp_path: Path, broker: str, seed: int, fault: str, extra: dict, ranks: int) -> tuple:
    """Unbounded topics of 4 partitions each (3,000 records of views and of buys, 1% late within their partition,
    text keys, 4 views not JSON), written in waves of 0.1 s of event time while the cluster (`ranks`, settings
    `checkpointed` + `extra`) runs under the supervisor with `fault` (STREAMJOIN_FAULT's rank:point) firing once;
    a stop signal once every record is in, as the dispatchers' progress lines count them.  (Each wave spans less
    than max_delay, so a partition fetched a little later than another makes no row late that the per-partition
    rule would not.)  Returns the run and (views, buys, the bad views, every view's offset in its partition)."""
    rng = np.random.default_rng(seed)
    t0 = now_ms()
    views, buys = stream(rng, 3000, 0, 4, t0, 0.01, spread=0, step=2), stream(rng, 3000, 100_000, 4, t0, 0.01, 0, 2)
    streams = {"views": views, "buys": buys}
    topics = {name: f"{name}-{tmp_path.name}" for name in streams}
    for name, s in streams.items():
        create(broker, topics[name], 4)
        s["value"] = values(s, "vid" if name == "views" else "bid")
    bad = np.array([900, 1500, 2100, 2700])  # not JSON: set aside, listed once whether read again or not
    for i in bad.tolist():
        views["value"][i] = b'{"vid": 1, "user": '
    # a wave: the records produced in 0.1 s of event time (their time before the late ones were moved back)
    wave_of = {name: (np.maximum.accumulate(s["at"]) - t0) // 100 for name, s in streams.items()}
    waves = [{name: np.flatnonzero(w == k) for name, w in wave_of.items()} for k in range(31)]
    assert sum(len(x) for w in waves for x in w.values()) == 6000
    produce_waves(broker, topics, streams, waves[:8], 0)
    cfg = checkpointed(broker, topics, **{"output.progress": 0.2, **extra})
    for name in topics:
        cfg[f"streams.{name}.kafka"]["bounded"] = False
        cfg[f"streams.{name}.idle_timeout"] = "1s"
    fired = tmp_path / "fault-fired"
    writer: list[threading.Thread] = []
    taken = {}  # per dispatcher: the tuples it took in and set aside late, as its last progress line says

    def every_record_in(line: str) -> bool:
        if not writer and "checkpoint 2 complete" in line:
            writer.append(threading.Thread(target=produce_waves, args=(broker, topics, streams, waves[8:], 0.08)))
            writer[0].start()
        if "restart 1 of 3" in line:
            taken.clear()  # the restarted cluster's lines count from its checkpoint on
        counts = re.match(r"(?:\[dispatcher (\d+)\] )?\[ *[\d.]+s\] in ([\d,]+) .*\| late ([\d,]+) ", line)
        if counts:
            taken[counts[1]] = sum(int(c.replace(",", "")) for c in counts.groups()[1:])
        return fired.exists() and sum(taken.values()) == 6000 - len(bad)

    run = stopped_when(
        tmp_path, cfg, ranks, every_record_in, supervised=True, env={"STREAMJOIN_FAULT": f"{fault}:{fired}"}
    )
    assert writer, run.stderr
    writer[0].join()
    assert fired.exists() and "restart 1 of 3" in run.stderr, run.stderr
    offset = np.empty(3000, np.int64)
    for p in range(4):  # each partition's records in the order produced
        mine = np.concatenate([w["views"][views["partition"][w["views"]] == p] for w in waves])
        offset[mine] = np.arange(len(mine))
    return run, (views, buys, bad, offset)


def stopped_when(
    tmp_path: Path, cfg: dict, ranks: int, watch, supervised: bool = False, env: dict | None = None
) -> Run:
    """The cluster (`ranks`, settings `cfg`; under the supervisor if `supervised`, with `env` added) run until
    `watch(line)` is true of a line it logs (or 120 s), then stopped by SIGTERM: it must end cleanly (exit 0)."""
    supervise = [sys.executable, "-m", "control.supervise", "--backoff", "0.1", "--restarts", "3", "--"]
    launch = [sys.executable, "-m", "deploy.launch", "-n", str(ranks), "--"]
    proc = subprocess.Popen(
        [*supervise * supervised, *launch, "--config", str(write_config(tmp_path, cfg))],
        cwd=Path(__file__).resolve().parent.parent,
        env={**mpi_env(), **(env or {})},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines = []
    try:
        deadline = time.monotonic() + 120
        while (line := proc.stderr.readline()) and time.monotonic() < deadline:
            lines.append(line)
            if watch(line):
                break
        proc.send_signal(signal.SIGTERM)
        threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()
        assert proc.wait(timeout=60) == 0, "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
    return Run(tmp_path / "out", subprocess.CompletedProcess(proc.args, 0, "", "".join(lines)))


def assert_recovered_exactly(run, views: dict, buys: dict, bad: np.ndarray, offset: np.ndarray) -> None:
    """A run of `written_while_running` recovered from a checkpoint and gave exactly the reference join and
    lateness of the good records (no pair lost or repeated), the payload from the right record, each bad record
    listed once."""
    assert run.summary["checkpoints"]["recovered_from"] is not None, run.stderr
    good = np.setdiff1d(np.arange(3000), bad)
    pairs, late, _ = reference(
        {k: (np.asarray(v)[good] if k != "user" else [v[i] for i in good]) for k, v in views.items()}, buys
    )
    ids = ("views_vid", "buys_bid")
    np.testing.assert_array_equal(run.pairs(ids), pairs)
    np.testing.assert_array_equal(run.late_ids(ids, ("views", "buys")), late)
    results = read_tables(run.out / "results")
    vid = results["views_vid"].to_numpy()
    assert (results["views_@offset"].to_numpy() == offset[vid]).all()
    assert (results["views_@partition"].to_numpy() == views["partition"][vid]).all()
    assert results["views_page"].to_pylist() == [f"/p{i % 7}" for i in vid.tolist()]
    listed = read_tables(run.out / "rejected")
    assert sorted(zip(listed["partition"].to_pylist(), listed["offset"].to_pylist())) == sorted(
        zip(views["partition"][bad].tolist(), offset[bad].tolist())
    )
    assert run.summary["rejected"] == 4 and run.summary["live_streams"]["views"]["rejected_by_reason"] == {
        "not JSON": 4
    }


CLICKS = Path(__file__).resolve().parent.parent / "examples" / "clicks"
#: the result columns compared with DuckDB's join of the clicks example's files
CLICKS_COLUMNS = ["impressions_impression_id", "impressions_ad_id", "clicks_click_id", "clicks_cost"]


def clicks_example(tmp_path: Path, broker: str) -> tuple[dict, dict, Path]:
    """examples/clicks as the README's Kafka form runs it: make_data.py's files produced into the topics by
    to_kafka.py; clicks-kafka.toml's join and streams as settings (on `broker`), the whole TOML, the data folder."""
    import tomllib

    data = tmp_path / "data"
    for script, *args in (("make_data.py", data), ("to_kafka.py", "--bootstrap", broker, "--data", data)):
        done = subprocess.run([sys.executable, CLICKS / script, *map(str, args)], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    cfg = tomllib.loads((CLICKS / "clicks-kafka.toml").read_text())
    out = {f"join.{k}": v for k, v in cfg["join"].items()}
    for name, spec in cfg["streams"].items():
        out |= {f"streams.{name}.{k}": v for k, v in spec.items()}
        out[f"streams.{name}.kafka"] = {**spec["kafka"], "bootstrap": broker}
    return out, cfg, data


def clicks_reference(data: Path):
    """DuckDB's interval join of the clicks example's files: CLICKS_COLUMNS, ordered by impression and click."""
    import duckdb

    return (
        duckdb.connect()
        .execute(
            f"""SELECT i.impression_id, i.ad_id, c.click_id, c.cost
            FROM read_csv('{data}/impressions/*.csv') i JOIN read_parquet('{data}/clicks.parquet') c
            ON i.user_id = c.user_id AND c.clicked_at >= i.shown_at AND c.clicked_at <= i.shown_at + INTERVAL 30 SECOND
            ORDER BY 1, 3"""
        )
        .df()
    )
