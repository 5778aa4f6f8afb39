"""Several dispatchers sharing Kafka topics' partitions (`cluster.dispatchers = 2`, master.sources.kafka_input): each
reads its own partitions, numbers its own rows and codes text keys by their hashes; against a real Kafka-protocol
broker (the session's `broker`), the results equal the reference join of the records as produced, lateness judged
per partition -- also with a partition left empty, a left and a full join, under the supervisor with checkpoints
when dispatcher 1, the master or a slave is killed, and with a live stream beside a topic.  Unit tests: the
partition assignment, the key codes (equal on every dispatcher, a collision stops the run), the payload log's
blocks of rows."""

from __future__ import annotations

import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from master.sources.kafka_input import assignment
from master.sources.key_codes import _hash, _rehash
from master.sources.keys import KeyCollision, KeyDictionary, KeyMapper
from protocol import checkpoint
from protocol.config import ConfigError, load_config
from protocol.plan import compile_plan, load_plan
from protocol.output import read_tables
from protocol.payload import ROW_BLOCK, PayloadLog, PayloadReader
from tests.cluster.test_live_streams import producers
from tests.kafka import (
    assert_recovered_exactly,
    create,
    now_ms,
    produce,
    reference,
    settings,
    stopped_when,
    stream,
    two_topics,
    values,
    written_while_running,
)
from tests.cluster.test_metrics import parse
from tests.reference import reference_outer
from tests.runs import Run, free_port, run_cluster, soak, toml_value

IDS = ("views_vid", "buys_bid")
TWO = {"cluster.dispatchers": 2}


# -- units -------------------------------------------------------------------------------------------------------
def test_the_sorted_partitions_are_dealt_out_in_turn_and_a_dispatcher_may_get_none():
    parts = [("b", 1), ("a", 2), ("b", 0), ("a", 0), ("a", 1)]
    shares = [assignment(parts, i, 2) for i in range(2)]
    assert shares == [[("a", 0), ("a", 2), ("b", 1)], [("a", 1), ("b", 0)]]
    assert sorted(shares[0] + shares[1]) == sorted(parts)
    assert assignment([("t", 0)], 1, 2) == [] and assignment([("t", 0)], 0, 2) == [("t", 0)]


def test_hashed_key_codes_agree_whatever_order_each_dispatcher_sees_the_keys_in():
    """Text and composite keys: two mappers seeing the values in different orders and batches give each value the
    same code (its 64-bit hash), different values different codes; a mapper restored from its dictionaries too."""
    rng = np.random.default_rng(3)
    users = [f"user-{u}" for u in rng.integers(0, 5000, 20_000)]
    towns = [f"t{u % 37}" for u in rng.integers(0, 10**6, 20_000)]
    a, b = KeyMapper(["string"], hashed=True), KeyMapper(["string"], hashed=True)
    first = a.keys([pa.array(users)])
    order = rng.permutation(len(users))
    second = np.empty(len(users), np.int64)
    for chunk in np.array_split(order, 7):
        second[chunk] = b.keys([pa.array([users[i] for i in chunk])])
    assert (first == second).all()
    assert len(np.unique(first)) == len(set(users))
    restored = KeyMapper(["string"], hashed=True)
    restored.restore(a.dictionaries())
    assert (restored.keys([pa.array(users)]) == first).all()
    ints = rng.integers(0, 3, len(users))
    c, d = KeyMapper(["string", "int"], hashed=True), KeyMapper(["string", "int"], hashed=True)
    one = c.keys([pa.array(towns), ints])
    other = d.keys([pa.array(towns[::-1]), ints[::-1]])[::-1]
    assert (one == other).all() and len(np.unique(one)) == len(set(zip(towns, ints.tolist())))
    assert (KeyMapper(["string"]).keys([pa.array(["x", "y", "x"])]) == [0, 1, 0]).all()  # one dispatcher: as before


def test_two_values_with_one_hash_stop_the_run_naming_it():
    """A 64-bit collision cannot be found by trying, so the dictionary is made to hold "a" under "b"'s hash: coding
    "b" then meets a different value with its hash, which stops the run (InputError: exit 2)."""
    d = KeyDictionary(pa.string(), hashed=True)
    d.codes(pa.array(["a"]))
    raw = np.frombuffer(b"b", np.uint8)
    d.hashes[0] = _hash(raw, 0, 1)
    d.slots[:] = -1
    _rehash(d.slots, d.hashes, d.count)
    with pytest.raises(KeyCollision, match="same 64-bit hash .* run with one dispatcher"):
        d.codes(pa.array(["b"]))
    assert (KeyDictionary(pa.string()).codes(pa.array(["a", "b"])) == [0, 1]).all()


def test_each_dispatcher_resumes_only_its_own_block_of_the_payload_log_and_readers_find_every_segment(tmp_path):
    logs = [PayloadLog(tmp_path, f"d{d}", (d * ROW_BLOCK, (d + 1) * ROW_BLOCK)) for d in range(2)]
    schema = pa.schema([("v", pa.int64())])
    for d, log in enumerate(logs):
        log.write_schema(0, schema)
        for first in (0, 10):
            rows = d * ROW_BLOCK + first + np.arange(10)
            log.write(0, rows, np.arange(10), pa.table({"v": rows}))
    reader = PayloadReader(tmp_path, ("", ""))
    want = np.array([ROW_BLOCK + 15, 3, ROW_BLOCK, 19, -1])
    got = reader.gather(0, want)["v"].to_pylist()
    assert got == [ROW_BLOCK + 15, 3, ROW_BLOCK, 19, None]
    again = PayloadLog(tmp_path, "d1-again", (ROW_BLOCK, 2 * ROW_BLOCK))
    again.resume(0, ROW_BLOCK + 10, 0)  # dispatcher 1 goes on from its row 10: its later segment goes, 0's stay
    assert [s.first for s in again.segments[0]] == [ROW_BLOCK]
    names = sorted(p.name for p in (tmp_path / "payload" / "R").glob("*.arrow") if p.name != "schema.arrow")
    assert len(names) == 3 and f"{ROW_BLOCK + 10:012d}-{ROW_BLOCK + 19:012d}.arrow" not in names


def test_rank_0_tells_the_others_which_times_of_their_own_segments_may_go_only_when_it_changed():
    from master.state.payload import PayloadDesk

    desk = PayloadDesk(load_plan(None, ["join.window=1.0", "checkpoint.keep=1", "cluster.dispatchers=2"]), 0, [2])
    assert desk.prune([]) is None
    assert desk.prune([(0, 5, 100), (1, 7, 90)]) == [100, 90]
    assert desk.prune([(0, 9, 100), (1, 9, 90)]) is None  # the same bounds: no order
    assert desk.prune([(0, 9, 120), (1, 9, 90)]) == [120, 90]


def test_several_dispatchers_take_kafka_topics_but_not_beside_a_stream_of_files():
    base = settings("127.0.0.1:1", {"views": "v", "buys": "b"})
    load_config(None, [f"{k}={toml_value(v)}" for k, v in {**base, **TWO}.items()])
    mixed = {k: v for k, v in base.items() if k not in ("streams.buys.kafka", "streams.buys.schema")}
    with pytest.raises(ConfigError, match="streams.views.kafka: with cluster.dispatchers > 1, not beside a stream"):
        load_config(None, [f"{k}={toml_value(v)}" for k, v in {**mixed, **TWO, "streams.buys.path": "b.csv"}.items()])


# -- against the broker ------------------------------------------------------------------------------------------
def _check_payload(run: Run, views: dict) -> None:
    results = read_tables(run.out / "results")
    vid = results["views_vid"].to_numpy()
    assert (results["views_@partition"].to_numpy() == views["partition"][vid]).all()
    assert (results["views_@offset"].to_numpy() == views["offset"][vid]).all()
    assert results["views_page"].to_pylist() == [f"/p{i % 7}" for i in vid.tolist()]
    assert results["views_user"].to_pylist() == [views["user"][i] for i in vid.tolist()]


def test_two_dispatchers_sharing_four_partitions_give_the_reference_join_and_lateness(tmp_path, broker):
    """Two topics of 4 partitions, text keys, partitions 4 s apart (out of order across partitions by far more than
    max_delay), 1% of the rows late within their partition, buys' partition 3 empty: dispatcher 0 reads partitions
    0 and 2 of each, dispatcher 1 partitions 1 and 3; together exactly the reference pairs and late rows, the
    payload (user, page, @partition, @offset) from the right record, each record read once."""
    rng = np.random.default_rng(61)
    t0 = now_ms()
    views, buys = stream(rng, 6000, 0, 4, t0, 0.01), stream(rng, 4000, 100_000, 4, t0, 0.01)
    keep = buys["partition"] != 3  # an empty partition holds nothing back
    buys = {k: (np.asarray(v)[keep] if k != "user" else [u for u, x in zip(v, keep) if x]) for k, v in buys.items()}
    topics = two_topics(tmp_path, broker, views, buys, 4)
    cfg = settings(
        broker,
        topics,
        **TWO,
        **{
            "streams.views.payload": ["user", "page", "@partition", "@offset"],
            "source.rate": 4000,  # paced: the payload log's segments go while the run goes (PRUNE)
            "metrics.endpoint": "127.0.0.1:0",
        },
    )
    run = run_cluster(tmp_path, 4, cfg)
    assert run.returncode == 0, run.stderr
    pairs, late, _ = reference(views, buys)
    assert len(pairs) > 1500 and 40 < len(late) < 200
    np.testing.assert_array_equal(run.pairs(IDS), pairs)
    np.testing.assert_array_equal(run.late_ids(IDS, ("views", "buys")), late)
    _check_payload(run, views)
    for d, share in enumerate(("0, 2", "1, 3")):
        mine = ", ".join(f"{topics['views']}/{p}" for p in share.split(", "))
        assert f"dispatcher {d} of 2 reads 2 of the 4 partitions ({mine}); partitions added later" in run.stderr
    kafka = run.summary["live_streams"]
    assert kafka["views"]["partitions"] == 4 and kafka["views"]["records"] == kafka["views"]["rows"] == 6000
    assert kafka["buys"]["records"] == len(buys["id"]) and kafka["buys"]["positions"][f"{topics['buys']}/3"] == 0
    assert run.summary["rejected"] == 0
    final = parse((run.out / "metrics.prom").read_text())  # rank 0 serves every dispatcher's partitions
    for name, s in (("views", views), ("buys", buys)):
        for p in range(4):
            labels = (("partition", str(p)), ("stream", name), ("topic", topics[name]))
            assert final[("streamjoin_kafka_records_total", labels)] == (s["partition"] == p).sum()


@pytest.mark.parametrize("join_type", ["left", "full"])
def test_outer_joins_with_two_dispatchers_emit_each_row_alone_once(tmp_path, broker, join_type):
    """A left and a full join over 3 partitions shared by 2 dispatchers (dispatcher 1 reads one of each topic):
    every pair once and every row without a partner once, as the reference says; rows alone are decided by the
    lowest watermark of both dispatchers."""
    rng = np.random.default_rng(71 if join_type == "left" else 72)
    t0 = now_ms()
    views, buys = stream(rng, 3000, 0, 3, t0, 0.01, spread=1500), stream(rng, 1200, 100_000, 3, t0, 0.01, spread=1500)
    topics = two_topics(tmp_path, broker, views, buys, 3)
    cfg = settings(broker, topics, **TWO, **{"join.type": join_type})
    run = run_cluster(tmp_path, 4, cfg)
    assert run.returncode == 0, run.stderr
    pairs, late, on_time = reference(views, buys)
    pairs, lone_views, lone_buys = reference_outer(pairs, on_time[0], on_time[1], join_type)
    np.testing.assert_array_equal(run.pairs(IDS), pairs)
    np.testing.assert_array_equal(run.alone("r", IDS), lone_views)
    np.testing.assert_array_equal(run.alone("s", IDS), lone_buys)
    np.testing.assert_array_equal(run.late_ids(IDS, ("views", "buys")), late)
    assert len(lone_views) > 100 and (join_type == "left" or len(lone_buys) > 10)


@pytest.mark.parametrize(
    "victim,point",
    [(1, "checkpoint:6"), soak(0, "checkpoint:6"), soak(2, "batch-after-checkpoint:6")],
    ids=["dispatcher-1", "master", "slave"],
)
def test_a_killed_dispatcher_master_or_slave_recovers_each_share_at_its_offsets_exactly_once(
    tmp_path, broker, victim, point
):
    """Unbounded topics of 4 partitions shared by 2 dispatchers, written in waves while the cluster runs with
    checkpoints (text keys, 1% late within their partition, payload columns, 4 records not JSON:
    tests.kafka.written_while_running); dispatcher 1, the master or a slave is killed (SIGKILL) as the waves come,
    and the supervisor restarts the cluster from the last complete checkpoint, where each dispatcher's part holds
    its own partitions' offsets: each partition is read on from there by the same dispatcher.  Exactly the
    reference join and lateness, the payload from the right record, each bad record listed once (in the listing of
    the dispatcher that read it), and every partition's committed offset the last complete checkpoint's."""
    run, written = written_while_running(tmp_path, broker, 81 + victim, f"{victim}:{point}", TWO, 4)
    assert_recovered_exactly(run, *written)
    root = run.out / "checkpoints"
    at_resume = checkpoint.load_manifest(root / checkpoint.name_of(run.summary["checkpoints"]["recovered_from"]))
    parts = [at_resume["master"]["source"]["streams"], at_resume["dispatchers"]["1"]["source"]["streams"]]
    for d, places in enumerate(parts):  # each dispatcher's part: its own partitions, offsets inside the topics
        for place, name in zip(places, ("views", "buys")):
            assert place["partitions"] == [f"{name}-{tmp_path.name}/{p}" for p in (d, d + 2)]
    assert 0 < sum(sum(p["offsets"]) for places in parts for p in places) < 6000, parts
    _, manifest = checkpoint.latest_complete(root)
    _assert_committed(
        broker, [manifest["master"]["source"]["streams"], manifest["dispatchers"]["1"]["source"]["streams"]]
    )


def _assert_committed(broker: str, parts: list[list[dict]]) -> None:
    """Every partition's committed offset (its stream's group: tests.kafka.checkpointed) is its dispatcher's in
    the checkpoint's parts."""
    from confluent_kafka import Consumer, TopicPartition

    for places in parts:
        for place in places:
            topic = place["partitions"][0].rsplit("/", 1)[0]
            asked = [TopicPartition(topic, int(p.rsplit("/", 1)[1])) for p in place["partitions"]]
            consumer = Consumer({"bootstrap.servers": broker, "group.id": f"group-{topic}"})
            try:
                committed = consumer.committed(asked, timeout=20)
            finally:
                consumer.close()
            assert [c.offset for c in committed] == place["offsets"], place


def test_a_dispatcher_with_no_partition_ends_and_holds_nothing_back(tmp_path, broker):
    """Three dispatchers, views in 2 partitions and buys in 1: dispatcher 1 reads no partition of buys, dispatcher 2
    none at all (it ends at once and its batches carry no watermark that holds the slaves back); a left join
    gives exactly the reference pairs, rows alone and late rows."""
    rng = np.random.default_rng(91)
    t0 = now_ms()
    views, buys = stream(rng, 2000, 0, 2, t0, 0.01, spread=1000), stream(rng, 800, 100_000, 1, t0, 0.01)
    topics = two_topics(tmp_path, broker, views, buys, (2, 1))
    cfg = settings(broker, topics, **{"cluster.dispatchers": 3, "join.type": "left"})
    run = run_cluster(tmp_path, 5, cfg)
    assert run.returncode == 0, run.stderr
    assert "dispatcher 2 of 3 reads 0 of the 2 partitions (none)" in run.stderr
    pairs, late, on_time = reference(views, buys)
    pairs, lone_views, _ = reference_outer(pairs, on_time[0], on_time[1], "left")
    np.testing.assert_array_equal(run.pairs(IDS), pairs)
    np.testing.assert_array_equal(run.alone("r", IDS), lone_views)
    np.testing.assert_array_equal(run.late_ids(IDS, ("views", "buys")), late)
    assert len(pairs) > 300 and len(lone_views) > 100


def test_two_shares_are_the_topics_once_with_one_code_per_key_and_added_partitions_stop_a_recovery(
    tmp_path, broker, capfd
):
    """In-process: dispatcher 0's and 1's sources of two 2-partition topics read disjoint partitions; together
    they are every record once, each row's id in its dispatcher's block, equal users coded alike on both and the
    payload log holds every row's columns.  A partition added to the topic afterwards is not read (the log line
    says so); a recovery of dispatcher 1's place then finds other partitions and stops, naming the dispatcher."""
    from confluent_kafka.admin import AdminClient, NewPartitions

    from common.chunks import InputError
    from master.sources import open_shard
    from protocol.payload import payload_reader
    from tests.cluster.test_streams import drain

    rng = np.random.default_rng(5)
    t0 = now_ms()
    views, buys = stream(rng, 800, 0, 2, t0), stream(rng, 600, 100_000, 2, t0)
    topics = two_topics(tmp_path, broker, views, buys, 2)
    given = {**settings(broker, topics), **TWO, "output.path": str(tmp_path / "out"), "checkpoint.interval": 2}
    cfg = load_config(None, [f"{k}={toml_value(v)}" for k, v in given.items()])
    sources = [open_shard(compile_plan(cfg), d) for d in range(2)]
    shares = [drain(src) for src in sources]
    where = {**sources[1].position(), "records": sources[1].records()}
    for src in sources:
        src.finish()
    reader = payload_reader(compile_plan(cfg))
    code_of = {}
    for d, share in enumerate(shares):
        assert ((share.id >= d * ROW_BLOCK) & (share.id < (d + 1) * ROW_BLOCK)).all()
        for side, (column, s) in enumerate(zip(IDS, (views, buys))):
            ids = reader.gather(side, share.id[share.stream == side])[column].to_numpy()
            first = int(s["id"][0])
            assert (s["partition"][ids - first] == d).all()  # dispatcher d read partition d of each topic
            for key, i in zip(share.key[share.stream == side].tolist(), ids.tolist()):
                assert code_of.setdefault(s["user"][i - first], key) == key
    assert sum(len(s.ts) for s in shares) == 1400 and len(set(code_of.values())) == len(code_of)
    assert (
        f"dispatcher 1 of 2 reads 1 of the 2 partitions ({topics['views']}/1); partitions added later"
        in capfd.readouterr().err
    )
    admin = AdminClient({"bootstrap.servers": broker})
    admin.create_partitions([NewPartitions(topics["views"], 4)])[topics["views"]].result(30)
    again = open_shard(compile_plan(cfg), 1)
    with pytest.raises(
        InputError, match=r"streams.views.kafka: the checkpoint holds offsets of 1 partitions, .* for dispatcher 1"
    ):
        again.seek(where)


def test_a_dispatcher_with_no_partition_does_not_hold_back_rows_decided_alone_before_the_stop(tmp_path, broker):
    """Unbounded topics (views 2 partitions, buys 1) and 3 dispatchers: dispatcher 2 reads nothing, so it ends at
    once and its batches carry no watermark; the slaves' lowest over the dispatchers goes on with the others', so
    a left join decides views without a partner while the cluster runs, before the stop signal (the dispatchers'
    progress lines count more results than pairs).  Then SIGTERM: exactly the reference pairs and rows alone."""
    rng = np.random.default_rng(93)
    t0 = now_ms()
    views, buys = stream(rng, 2000, 0, 2, t0, spread=0), stream(rng, 600, 100_000, 1, t0)
    topics = two_topics(tmp_path, broker, views, buys, (2, 1))
    cfg = settings(broker, topics, **{"cluster.dispatchers": 3, "join.type": "left", "output.progress": 0.2})
    for name in topics:
        cfg[f"streams.{name}.kafka"]["bounded"] = False
        cfg[f"streams.{name}.idle_timeout"] = "1s"
    pairs, late, on_time = reference(views, buys)
    pairs, lone_views, _ = reference_outer(pairs, on_time[0], on_time[1], "left")
    results = {}  # per dispatcher: the results its batches brought, as its last progress line says

    def rows_alone_decided(line: str) -> bool:
        if counts := re.match(r"\[dispatcher (\d+)\] .*\| results ([\d,]+) ", line):
            results[counts[1]] = int(counts[2].replace(",", ""))
        return sum(results.values()) > len(pairs)

    run = stopped_when(tmp_path, cfg, 5, rows_alone_decided)
    assert sum(results.values()) > len(pairs), run.stderr  # not only at the stop
    np.testing.assert_array_equal(run.pairs(IDS), pairs)
    np.testing.assert_array_equal(run.alone("r", IDS), lone_views)
    assert not len(late) and len(lone_views) > 100


def test_a_live_stream_beside_a_kafka_topic_on_two_dispatchers_gives_the_reference_join(tmp_path, broker):
    """views pushed live by two producers (one to each dispatcher: the stream's port and port + 1), buys read from
    a topic of 2 partitions (one to each dispatcher): every dispatcher merges its own live share with its own
    partition, and the results are the reference join, lateness judged within each live share and each
    partition."""
    rng = np.random.default_rng(97)
    t0 = now_ms()
    views, buys = stream(rng, 3000, 0, 1, t0, 0.01, step=8), stream(rng, 2000, 100_000, 2, t0, 0.01, spread=3000)
    topic = f"buys-{tmp_path.name}"
    create(broker, topic, 2)
    buys["offset"] = produce(broker, topic, buys["partition"], values(buys, "bid"))
    for d in range(2):  # row i of views to dispatcher i % 2, in order
        pq.write_table(
            pa.table(
                {
                    "vid": views["id"][d::2],
                    "user": views["user"][d::2],
                    "at": views["at"][d::2],
                    "page": [f"/p{i % 7}" for i in views["id"][d::2].tolist()],
                }
            ),
            tmp_path / f"views-{d}.parquet",
        )
    port = free_port()
    feeds = producers(tmp_path, {"views-0": port, "views-1": port + 1})
    cfg = settings(broker, {"buys": topic}, **TWO) | {
        "streams.views.endpoint": f"tcp://127.0.0.1:{port}",
        "streams.views.key": "user",
        "streams.views.time": "at",
        "streams.views.time_unit": "ms",
        "streams.views.id": "vid",
        "streams.views.schema": {"vid": "int64", "user": "string", "at": "int64", "page": "string"},
    }
    run = run_cluster(tmp_path, 4, cfg, timeout=150)
    assert run.returncode == 0, run.stderr
    for feed in feeds:
        feed.communicate(timeout=60)
    shares = {**views, "partition": np.arange(len(views["id"])) % 2}  # a live share is judged like a partition
    pairs, late, _ = reference(shares, buys)
    assert len(pairs) > 1000 and len(late) > 10
    np.testing.assert_array_equal(run.pairs(IDS), pairs)
    np.testing.assert_array_equal(run.late_ids(IDS, ("views", "buys")), late)
    live = run.summary["live_streams"]
    assert live["views"]["producers"] == {"views-0": 1500, "views-1": 1500} and live["views"]["lost_tuples"] == 0
    assert live["buys"]["records"] == 2000
