"""The Kafka result sink (`[output.kafka]`, master/sink.py, docs/output.md#the-kafka-result-sink) against a real
Kafka-protocol broker: the topic read with read_committed holds every result row exactly once -- equal to
`results/` and to the reference join of the records produced -- after a clean run, after a slave or the master
is killed under the supervisor (at a batch, as a checkpoint begins, between a checkpoint's manifest and its
transaction's commit); a left join's rows alone go the same way; without checkpoints every pair at least once;
the clicks example joins two topics into a third, equal to DuckDB's join of its files; the sink's broker
restarted under a transaction or after a commit; another producer's open transaction on the marker topic."""

from __future__ import annotations

import json
import subprocess
import time
from datetime import datetime
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from confluent_kafka import Producer

from master.sink import KafkaSink
from protocol.config import load_config
from protocol.errors import SinkError
from protocol.kafka_sink import ResultProducer
from protocol.output import LEFT_UNMATCHED, RESULT_SCHEMA, read_tables
from protocol.plan import compile_plan
from tests.cluster.test_cluster import check_exact
from tests.cluster.test_dispatchers import SHARDED
from tests.kafka import (
    CLICKS_COLUMNS,
    clicks_example,
    clicks_reference,
    create,
    start_broker,
    now_ms,
    read_topic,
    reference,
    settings,
    stream,
    two_topics,
)
from tests.reference import encode_pairs
from deploy.broker import NOIDA, up_command
from deploy.launch import mpi_env, mpirun_command
from tests.runs import free_port, run_cluster, soak, write_config

IDS = ("views_vid", "buys_bid")
SUPERVISE = [sys.executable, "-m", "control.supervise", "--backoff", "0.1", "--restarts", "3", "--"]


def committed(bootstrap: str, topic: str) -> list[tuple[str, dict]]:
    """Every record of `topic` a read_committed consumer sees, to the end: (key, value as JSON)."""
    return [(key.decode(), json.loads(value)) for _, _, key, value in read_topic(bootstrap, topic)]


def sink_settings(broker: str, topics: dict, tmp_path: Path, **extra) -> tuple[dict, str]:
    """The streams' settings with the sink to a topic of its own (made here, 3 partitions); the topic."""
    sink = f"pairs-{tmp_path.name}"
    create(broker, sink, 3)
    return settings(broker, topics, **{"output.kafka": {"topic": sink, "bootstrap": broker}}, **extra), sink


def assert_exactly_results(got: list[tuple[str, dict]], run) -> None:
    """The records are `results/`'s rows, each once, keyed by the pair's ids."""
    table = read_tables(run.out / "results")
    times = [f.name for f in table.schema if pa.types.is_timestamp(f.type)]
    canon = lambda row: json.dumps({k: v for k, v in row.items() if k != "delay"}, sort_keys=True, default=str)  # noqa: E731
    for _, value in got:  # ISO 8601 text in the records, datetimes in the files
        value.update({c: value[c] and datetime.fromisoformat(value[c]) for c in times})
    assert Counter(canon(v) for _, v in got) == Counter(canon(r) for r in table.to_pylist())
    for key, value in got:
        assert (
            key == f"{'' if value[IDS[0]] is None else value[IDS[0]]}|{'' if value[IDS[1]] is None else value[IDS[1]]}"
        )


def sink_pairs(got: list[tuple[str, dict]]) -> np.ndarray:
    pairs = [(v[IDS[0]], v[IDS[1]]) for _, v in got if v[IDS[0]] is not None and v[IDS[1]] is not None]
    vid, bid = (np.array(c, np.int64) for c in zip(*pairs))
    return encode_pairs(vid, bid)


def small_streams(seed: int) -> tuple[dict, dict]:
    rng = np.random.default_rng(seed)
    t0 = now_ms()
    return stream(rng, 3000, 0, 3, t0, 0.01), stream(rng, 2000, 100_000, 3, t0, 0.01)


def test_with_checkpoints_the_topic_holds_every_pair_once_as_results_and_the_reference(tmp_path, broker):
    """Checkpoints every 2 epochs at 2,500 tuples/s: each slave sends its rows in a transaction per checkpoint,
    rank 0 the last at the end; read_committed sees results/ and the reference pairs, each once."""
    views, buys = small_streams(41)
    topics = two_topics(tmp_path, broker, views, buys, partitions=3)
    cfg, sink = sink_settings(broker, topics, tmp_path, **{"checkpoint.interval": 2, "source.rate": 2500.0})
    run = run_cluster(tmp_path, 3, cfg)
    assert run.returncode == 0, run.stderr
    got = committed(broker, sink)
    pairs, _, _ = reference(views, buys)
    assert len(pairs) > 1000
    np.testing.assert_array_equal(run.pairs(IDS), pairs)
    np.testing.assert_array_equal(np.sort(sink_pairs(got)), pairs)
    assert_exactly_results(got, run)
    done, files = run.summary["kafka_sink"], len(list((run.out / "results").iterdir()))
    assert run.summary["checkpoints"]["written"] >= 1 and done["exactly_once"] and done["files"] == files, done
    assert done["rows_at_end"] < len(got)  # the slaves sent the rest, each its own


@pytest.mark.parametrize(
    "fault",
    ["1:batch-after-checkpoint:6", soak("0:checkpoint:4"), soak("2:sink-commit:1"), "0:sink-commit:1"],
    ids=["slave-at-a-batch", "master-at-a-checkpoint", "slave-before-its-commit", "master-before-the-ends-commit"],
)
def test_a_rank_killed_under_the_supervisor_leaves_every_pair_in_the_topic_once(tmp_path, broker, fault):
    """At 2,500 tuples/s (2 s of input), SIGKILL of a slave at its sixth batch after a complete checkpoint (which
    may come after the input's last tuples: the master holds a pending fault's input end back and sends the
    slaves batches without tuples meanwhile), of the master as it begins its fourth, of a slave with a complete
    checkpoint's rows in its open transaction before the commit, and of the master before the end's commit:
    restarted from the newest complete checkpoint, read_committed sees every reference pair once, as results/."""
    views, buys = small_streams(43)
    topics = two_topics(tmp_path, broker, views, buys, partitions=3)
    cfg, sink = sink_settings(broker, topics, tmp_path, **{"checkpoint.interval": 2, "source.rate": 2500.0})
    fired = tmp_path / "fault-fired"
    env = {"STREAMJOIN_FAULT": f"{fault}:{fired}"}
    run = run_cluster(tmp_path, 3, cfg, wrapper=SUPERVISE, timeout=150, env=env)
    assert run.returncode == 0, run.stderr
    assert fired.exists() and "restart 1 of 3" in run.stderr, run.stderr
    got = committed(broker, sink)
    pairs, _, _ = reference(views, buys)
    np.testing.assert_array_equal(run.pairs(IDS), pairs)
    np.testing.assert_array_equal(np.sort(sink_pairs(got)), pairs)
    assert_exactly_results(got, run)
    if fault.startswith("2:sink-commit"):  # the slave's open transaction held a complete checkpoint's rows
        assert "sent now, no transaction had them" in run.stderr, run.stderr


def test_a_recovery_on_fewer_slaves_sends_the_files_of_the_slave_it_no_longer_has(tmp_path, broker):
    """Three slaves, the third killed with a complete checkpoint's rows in its open transaction; `--recover` by
    hand on two slaves: rank 0 sends the third's files the checkpoint covers, every pair once."""
    views, buys = small_streams(61)
    topics = two_topics(tmp_path, broker, views, buys, partitions=3)
    cfg, sink = sink_settings(broker, topics, tmp_path, **{"checkpoint.interval": 2, "source.rate": 2500.0})
    fired = tmp_path / "fault-fired"
    crashed = run_cluster(tmp_path, 4, cfg, env={"STREAMJOIN_FAULT": f"3:sink-commit:1:{fired}"})
    assert crashed.returncode != 0 and fired.exists(), crashed.stderr
    run = run_cluster(tmp_path, 3, cfg, extra_args=["--recover"])
    assert run.returncode == 0, run.stderr
    assert "taken with 3 slaves, on 2" in run.stderr and "sent now, no transaction had them" in run.stderr
    assert any(f.name.startswith("slave-003-") for f in (run.out / "results").iterdir())
    got = committed(broker, sink)
    pairs, _, _ = reference(views, buys)
    np.testing.assert_array_equal(np.sort(sink_pairs(got)), pairs)
    assert_exactly_results(got, run)


def test_the_workloads_rows_with_two_dispatchers_reach_the_topic_once_keyed_by_r_id_and_s_id(tmp_path, broker):
    """The built-in workload's rows (r_id, s_id, ... delay) with two dispatchers and checkpoints (a slave sends
    the checkpoint before once every dispatcher's marker of the next is in): the topic holds the reference
    pairs, once, keyed r_id|s_id."""
    sink = f"pairs-{tmp_path.name}"
    create(broker, sink, 3)
    settings_ = {
        **SHARDED,
        "cluster.dispatchers": 2,
        "generator.seed": 44,
        "source.rate": 4000.0,
        "checkpoint.interval": 2,
        "output.kafka": {"topic": sink, "bootstrap": broker},
    }
    run, expected = check_exact(tmp_path, 4, settings_)
    got = committed(broker, sink)
    assert run.summary["checkpoints"]["written"] >= 1 and len(expected) > 1000
    assert all(key == f"{v['r_id']}|{v['s_id']}" for key, v in got)
    r_id, s_id = (np.array(c, np.int64) for c in zip(*((v["r_id"], v["s_id"]) for _, v in got)))
    np.testing.assert_array_equal(encode_pairs(r_id, s_id), np.sort(expected))


def test_a_left_joins_rows_alone_reach_the_topic_once(tmp_path, broker):
    """join.type = "left" with checkpoints: the views without a buy reach the topic as rows with the buy's
    columns null, beside the pairs, each once, as in results/ (whose pairs are the reference's)."""
    views, buys = small_streams(47)
    topics = two_topics(tmp_path, broker, views, buys, partitions=3)
    cfg, sink = sink_settings(broker, topics, tmp_path, **{"checkpoint.interval": 2, "join.type": "left"})
    run = run_cluster(tmp_path, 3, cfg)
    assert run.returncode == 0, run.stderr
    got = committed(broker, sink)
    pairs, _, on_time = reference(views, buys)
    np.testing.assert_array_equal(np.sort(sink_pairs(got)), pairs)
    alone = sorted(v[IDS[0]] for _, v in got if v[IDS[1]] is None)
    matched = np.unique(pairs >> 32) if len(pairs) else []
    assert len(alone) > 100 and alone == sorted(set(on_time[0].tolist()) - set(np.asarray(matched).tolist()))
    assert all(v["kind"] == LEFT_UNMATCHED for _, v in got if v[IDS[1]] is None)
    assert_exactly_results(got, run)


def test_without_checkpoints_every_pair_reaches_the_topic_at_least_once(tmp_path, broker):
    """No checkpoints: rank 0's idempotent producer sends every result file at the end of the run; every reference
    pair is in the topic (a clean run: once)."""
    views, buys = small_streams(53)
    topics = two_topics(tmp_path, broker, views, buys, partitions=3)
    cfg, sink = sink_settings(broker, topics, tmp_path)
    run = run_cluster(tmp_path, 3, cfg)
    assert run.returncode == 0, run.stderr
    got = committed(broker, sink)
    pairs, _, _ = reference(views, buys)
    assert set(sink_pairs(got).tolist()) == set(pairs.tolist())
    assert not run.summary["kafka_sink"]["exactly_once"] and run.summary["kafka_sink"]["rows_at_end"] == len(got)
    assert_exactly_results(got, run)


BROKER_DATA: dict = {}  #: the own brokers' data folders by address (for `noida-db down`)


@pytest.fixture
def own_broker(tmp_path_factory):
    """A broker of this test's own: the clicks example's topics have fixed names, which another test fills too;
    a test may stop it."""
    yield from start_broker(tmp_path_factory, BROKER_DATA)


@pytest.mark.parametrize(
    "fault",
    [None, "1:batch-after-checkpoint:4", soak("0:sink-commit:1")],
    ids=["as-it-is", "slave-killed", "master-killed-before-a-commit"],
)
def test_the_clicks_example_joins_two_topics_into_a_third_as_duckdb_joins_its_files(tmp_path, own_broker, fault):
    """examples/clicks' Kafka form with checkpoints and the sink: make_data.py's files produced into two topics by
    to_kafka.py, clicks-kafka.toml's join written to a third topic -- as it is, and at 4,000 tuples/s with a
    checkpoint every 0.2 s under the supervisor with a slave or the master SIGKILLed; read_committed, every pair
    and its payload is DuckDB's interval join of the files, once."""
    settings_, cfg, data = clicks_example(tmp_path, own_broker)
    sink = cfg["output"]["kafka"]["topic"]  # to_kafka.py made it beside the streams' topics
    settings_ |= {
        "output.kafka": {**cfg["output"]["kafka"], "bootstrap": own_broker},
        **{f"checkpoint.{k}": v for k, v in cfg["checkpoint"].items()},
    }
    fired, crash = tmp_path / "fault-fired", {}
    if fault:
        settings_ |= {"source.rate": 4000.0, "epochs.distribution": "100ms", "checkpoint.interval": 2}
        crash = {"wrapper": SUPERVISE, "timeout": 150, "env": {"STREAMJOIN_FAULT": f"{fault}:{fired}"}}
    run = run_cluster(tmp_path, 3, settings_, **crash)
    assert run.returncode == 0, run.stderr
    assert not fault or (fired.exists() and "restart 1 of 3" in run.stderr), run.stderr
    want = clicks_reference(data).itertuples(index=False)
    got = sorted(tuple(v[c] for c in CLICKS_COLUMNS) for _, v in committed(own_broker, sink))
    assert len(got) > 1000 and got == [tuple(w) for w in want]


def test_a_broker_that_does_not_answer_ends_the_job_with_exit_7_and_a_missing_topic_with_2(tmp_path, broker):
    """No broker at the sink's bootstrap: the job ends before it starts with SINK (7), which the supervisor
    restarts; a results topic that does not exist is the user's mistake (2)."""
    views, buys = small_streams(59)
    topics = two_topics(tmp_path, broker, views, buys, partitions=3)
    cfg = settings(broker, topics)
    nobody = {"topic": "pairs", "bootstrap": f"127.0.0.1:{free_port()}", "timeout": "2s"}
    run = run_cluster(tmp_path / "down", 3, {**cfg, "output.kafka": nobody})
    assert run.returncode == 7 and "error: kafka sink: output.kafka.bootstrap: no answer" in run.stderr, run.stderr
    missing = {"topic": f"none-{tmp_path.name}", "bootstrap": broker}
    run = run_cluster(tmp_path / "missing", 3, {**cfg, "output.kafka": missing})
    assert run.returncode == 2 and f"output.kafka.topic: 'none-{tmp_path.name}' does not exist" in run.stderr


def test_a_broker_that_goes_down_during_the_run_ends_it_with_exit_7(tmp_path, broker, own_broker):
    """The sink's broker stopped (`noida-db down`) once the second checkpoint is complete, the streams' broker
    left up: the next slave to send stops at once if it has committed before (every broker lost since), or
    waits output.kafka.timeout (3 s) for it, saying it is still at work (no stall); the job ends with exit 7
    naming the sink."""
    views, buys = small_streams(67)
    topics = two_topics(tmp_path, broker, views, buys, partitions=3)
    sink = f"pairs-{tmp_path.name}"
    create(own_broker, sink, 3)
    cfg = settings(broker, topics, **{"checkpoint.interval": 2, "source.rate": 1500.0})
    cfg["output.kafka"] = {"topic": sink, "bootstrap": own_broker, "timeout": "3s"}
    command = mpirun_command(3, ["--config", str(write_config(tmp_path, cfg))])
    proc = subprocess.Popen(command, env=mpi_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines = []
    try:
        for line in proc.stderr:
            lines.append(line)
            if "checkpoint 2 complete" in line:
                down = subprocess.run([NOIDA, "down", "--data-dir", BROKER_DATA[own_broker]], capture_output=True)
                assert down.returncode == 0, down.stderr
                break
        lines += proc.stderr.readlines()
        assert proc.wait(timeout=60) == 7, "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
    stderr = "".join(lines)
    assert "kafka sink: output.kafka" in stderr and "stalled" not in stderr, stderr


def wait_saved(bootstrap: str, data: Path, topic: str, timeout: float = 30.0) -> None:
    """Wait until the broker's saved state (noida-db's kafka.json, written about once a second after a change)
    holds everything the broker held when this was called: a topic of its own is made, and waited for there."""
    mark = f"{topic}.saved-{time.monotonic_ns()}"
    create(bootstrap, mark, 1)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if mark in dict(json.loads((data / "kafka.json").read_text())["topics"]):
                return
        except (OSError, ValueError, KeyError):  # being written
            pass
        time.sleep(0.05)
    raise TimeoutError(f"the broker did not save {mark} within {timeout:g}s")


def restart_broker(bootstrap: str) -> None:
    """SIGKILL the own broker at `bootstrap` and start it again on its data (what it had saved)."""
    data, port = BROKER_DATA[bootstrap], int(bootstrap.rsplit(":", 1)[1])
    servers = [
        p
        for p in psutil.process_iter(["cmdline"])
        if "start" in (p.info["cmdline"] or []) and str(data) in p.info["cmdline"]
    ]
    assert servers
    for p in servers:
        p.kill()
    psutil.wait_procs(servers, timeout=20)
    up = subprocess.run(up_command(data, port), capture_output=True, text=True, timeout=60)
    assert up.returncode == 0, up.stderr


@pytest.mark.parametrize("restart", ["during-a-transaction", "after-a-commit"])
def test_a_broker_restarted_under_a_transaction_or_after_its_commit_leaves_every_row_in_the_topic_once(
    tmp_path, own_broker, restart
):
    """The sink's broker SIGKILLed and started again (a) while a slave's transaction holds its first file's rows,
    delivered and saved -- the test broker then forgets the transaction's partitions: rows the producer sent it
    afterwards would open a transaction that no commit, fence or timeout ends, and a read_committed reader would
    stop there for good --, or (b) right after a slave's commit, before the broker saves it (it may drop it):
    the producer's transaction, or its next, sends nothing and fails naming the lost broker (the job's exit 7);
    the recovery's rank 0 fences, reads the committed markers and sends what the checkpoint covers beyond them;
    read_committed, the topic holds every row of the files once."""
    sink = f"pairs-{tmp_path.name}"
    create(own_broker, sink, 3)
    wait_saved(own_broker, BROKER_DATA[own_broker], sink)  # the topic outlives the restart
    plan = compile_plan(
        load_config(
            None,
            [
                f"output.path={tmp_path / 'out'}",
                f"output.kafka.topic={sink}",
                f"output.kafka.bootstrap={own_broker}",
                "output.kafka.timeout=20s",
                "checkpoint.interval=2",
            ],
        )
    ).with_sink("restarted", False)
    results = plan.output.path / "results"
    results.mkdir(parents=True)
    rng = np.random.default_rng(71)
    files = 3
    for i in range(files):  # 2,000 rows each, r_id unique
        ints = lambda c: np.arange(2000) + 2000 * i if c == "r_id" else rng.integers(0, 10**6, 2000)  # noqa: E731
        columns = {c: ints(c) if c.endswith(("_id", "_key")) else rng.random(2000) for c in RESULT_SCHEMA.names}
        pq.write_table(pa.table(columns, schema=RESULT_SCHEMA), results / f"slave-002-{i:06d}.parquet")
    slave = ResultProducer(plan, 2, "slave-002")
    slave.begin()
    if restart == "after-a-commit":
        slave.transaction({"slave-002": 2}, 1)
        restart_broker(own_broker)
    else:
        restarts = []

        def restart_once():  # after the first file's rows are handed over: delivered and saved, then the restart
            if not restarts:
                assert slave.producer.flush(20) == 0
                wait_saved(own_broker, BROKER_DATA[own_broker], sink)
                restart_broker(own_broker)
                restarts.append(1)

        slave.alive = restart_once
    with pytest.raises(SinkError) as failed:
        slave.transaction({"slave-002": files}, 2)
    assert restart == "after-a-commit" or restarts
    line = KafkaSink(plan).start({"slave-002": files}, [2])
    assert "result files the checkpoint covers sent now" in line, line
    got = read_topic(own_broker, sink, within=20)
    want = read_tables(results)
    assert sorted(int(k.split(b"|")[0]) for _, _, k, _ in got) == sorted(want["r_id"].to_pylist())
    assert "went out of reach during a transaction or since the last commit" in str(failed.value), failed.value


def test_an_open_transaction_of_another_producer_on_the_marker_topic_stops_a_recovery_naming_where(tmp_path, broker):
    """Another producer's transaction left open on the marker topic holds read_committed back: the recovery's
    rank 0 (which fences only its run's transactional ids) stops with exit 7's error naming the partition, where
    it got to and the end; the transaction is left alone -- once its producer commits it, the recovery goes on."""
    sink = f"pairs-{tmp_path.name}"
    create(broker, sink, 3)
    plan = compile_plan(
        load_config(
            None,
            [
                f"output.path={tmp_path / 'out'}",
                f"output.kafka.topic={sink}",
                f"output.kafka.bootstrap={broker}",
                "output.kafka.timeout=2s",
                "checkpoint.interval=2",
            ],
        )
    ).with_sink("held", False)
    marker_topic = plan.output.kafka.marker_topic
    create(broker, marker_topic, 1)
    other = Producer({"bootstrap.servers": broker, "transactional.id": f"other-{tmp_path.name}"})
    other.init_transactions(20)
    other.begin_transaction()
    other.produce(marker_topic, b"{}", b"another run")
    assert other.flush(20) == 0
    with pytest.raises(
        SinkError, match=r"not readable to its end within 2s with read_committed \(partition 0 at 0 of 1\)"
    ):
        KafkaSink(plan).start(None, [2])
    other.commit_transaction(20)
    assert "kafka sink: results to" in KafkaSink(plan).start(None, [2])
    assert [k for _, _, k, _ in read_topic(broker, marker_topic, within=20)] == [b"another run"]
