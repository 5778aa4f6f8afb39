"""Live declared streams (`[streams.NAME] endpoint`): Arrow record batches pushed by producers over
real loopback ZeroMQ sockets, checked against the declared schema, merged with the other stream (waiting for a
quiet one until its idle_timeout), and the cluster fed by one producer process per stream, compared with the
independent reference join of the two files the producers read."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zmq

from control.produce import Producer
from master.sources import open_source
from protocol import checkpoint, wire
from protocol.payload import ROW_BLOCK
from protocol.config import ConfigError
from protocol.plan import load_plan
from protocol.output import read_tables
from common.chunks import InputError
from common.stream_file import arrow_type
from tests.runs import free_port, run_cluster, toml_value
from tests.reference import encode_pairs, late_flags, reference_pairs
from tests.cluster.test_zmq_cluster import finish, start
from tests.cluster.test_zmq_source import drain


SCHEMAS = {
    "views": {"vid": "int64", "user": "string", "at": "timestamp[ms, tz=UTC]", "page": "string"},
    "buys": {"bid": "int64", "user": "string", "at": "int64", "price": "decimal128(10, 2)"},
}


def live_settings(ports: dict[str, int], **extra) -> dict:
    out = {}
    for name, port in ports.items():
        out |= {
            f"streams.{name}.endpoint": f"tcp://127.0.0.1:{port}",
            f"streams.{name}.key": "user",
            f"streams.{name}.time": "at",
            f"streams.{name}.id": "vid" if name == "views" else "bid",
            f"streams.{name}.schema": SCHEMAS[name],
        }
    out["streams.buys.time_unit"] = "ms"
    return out | extra


def live_plan(tmp_path, ports, **extra):
    return load_plan(
        None,
        [f"{k}={toml_value(v)}" for k, v in {**live_settings(ports), "output.path": str(tmp_path), **extra}.items()],
    )


def test_arrow_types_are_read_as_pyarrow_prints_them():
    assert arrow_type("timestamp[ms, tz=UTC]") == pa.timestamp("ms", "UTC")
    assert arrow_type("decimal128(12, 2)") == pa.decimal128(12, 2)
    assert arrow_type("list<item: int32>") == arrow_type("list<int32>") == pa.list_(pa.int32())
    assert arrow_type(" double ") == pa.float64() and arrow_type("utf8") == pa.string()
    with pytest.raises(ValueError, match="'varchar' is not an Arrow type"):
        arrow_type("varchar")


def test_a_batch_message_round_trips_and_its_frames_are_checked():
    table = pa.table({"a": [1, 2, 3]})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    frames = wire.encode_batch(sink.getvalue(), 3, origin_frame=wire.origin("p", bytes(32)))
    msg = wire.decode([bytes(f) for f in frames], (wire.Frame.BATCH,), 10)
    assert msg.kind == wire.Frame.BATCH and bytes(msg.origin["producer"]) == b"p"
    assert pa.ipc.open_stream(pa.py_buffer(msg.arrow)).read_all().equals(table)
    assert wire.decode([bytes(f) for f in frames], (wire.Frame.BATCH,), 2).reason == "too_large"
    assert wire.decode([bytes(f) for f in frames], (wire.Frame.TUPLES,), 10).reason == "kind"


@pytest.mark.parametrize(
    "settings, words",
    [
        (
            {"streams.views.path": "x.csv"},
            "one of path (files), endpoint (live producers) or kafka (a topic), not path and endpoint",
        ),
        ({"streams.views.schema": {"vid": "int64"}}, "missing user, at"),
        ({"streams.views.schema": {**SCHEMAS["views"], "page": "varchar"}}, "'varchar' is not an Arrow type"),
        ({"streams.views.ack_endpoint": "tcp://127.0.0.1:5999"}, "acknowledgements come from checkpoints"),
        ({"streams.views.endpoint": "tcp://10.1.2.3:5000"}, "is not a loopback address"),
    ],
)
def test_config_mistakes_of_live_streams_are_refused_with_the_key(tmp_path, settings, words):
    from master.sources.streams import StreamsSource

    with pytest.raises(ConfigError, match=re.escape(words)):
        StreamsSource(live_plan(tmp_path, {"views": free_port(), "buys": free_port()}, **settings))


def test_live_streams_of_several_dispatchers_are_refused_where_their_ports_meet_or_beside_files(tmp_path):
    """Dispatcher i binds each live stream's endpoint at its port + i: a stream's port next to another's meets
    dispatcher 1's; and a live stream beside a stream of files would need each dispatcher to read the files whole."""
    port = free_port()
    with pytest.raises(ConfigError, match=re.escape("streams.buys.endpoint: must differ from streams.views.endpoint")):
        live_plan(tmp_path, {"views": port, "buys": port + 1}, **{"cluster.dispatchers": 2})
    files = {"streams.buys.path": "buys.parquet", "streams.buys.key": "user", "streams.buys.time": "at"}
    with pytest.raises(ConfigError, match=re.escape("streams.views.endpoint: with cluster.dispatchers > 1, not")):
        live_plan(tmp_path, {"views": port}, **files, **{"cluster.dispatchers": 2})


def send(endpoint: str, table: pa.Table | None = None, raw: list | None = None, name: str = "p") -> Producer:
    prod = Producer(endpoint, name=name, timeout=10)
    if raw is not None:
        prod._send(raw)
    if table is not None:
        prod.send_table(table)
    return prod


def test_live_batches_are_checked_merged_and_logged_and_bad_messages_rejected_whole(tmp_path):
    """A good batch per stream, then on views: bytes that are no Arrow batch, a batch without `user`, a batch
    whose `at` is text; a batch with one bad cell (its row rejected alone): the good rows merge by each stream's
    watermark, the payload log holds their columns, rejected/ lists the messages and the row."""
    ports = {"views": free_port(), "buys": free_port()}
    src = open_source(live_plan(tmp_path, ports))
    ep = {n: f"tcp://127.0.0.1:{p}" for n, p in ports.items()}
    t0 = 1_795_000_000_000
    views = pa.table(
        {
            "vid": [1, 2, 3],
            "user": ["a", "b", "a"],
            "page": ["/", "/x", None],
            "at": pa.array([t0, t0 + 10, t0 + 20], pa.timestamp("ms", "UTC")),
        }
    )
    buys = pa.table({"bid": [7, 8], "user": ["a", "c"], "at": [t0 + 5, t0 + 30], "price": ["1.50", "2.25"]})
    pv = send(ep["views"], views, name="v")
    pb = send(ep["buys"], buys, name="b")
    header = wire.header(wire.Frame.BATCH, 1)
    pv._send([header, wire.origin("v", bytes(32), 0, 3), b"not arrow"])
    pv.send_table(views.drop_columns(["user"]))
    pv.send_table(views.set_column(3, "at", pa.array(["soon"] * 3)))
    pv.send_table(
        pa.table(
            {
                "vid": [4, 5],
                "user": ["a", None],
                "page": ["/y", "/z"],
                "at": pa.array([t0 + 40, t0 + 41], pa.timestamp("ms", "UTC")),
            }
        )
    )
    pv.close(), pb.close()
    got = drain(src)
    summary = src.finish()
    stream = np.concatenate([c.stream for c in got])
    ids = np.concatenate([c.id for c in got])
    assert stream.tolist() == [0, 1, 0, 0, 1, 0] and ids.tolist() == [0, 0, 1, 2, 1, 3]
    live = summary["live_streams"]["views"]
    assert live["rejected_by_reason"] == {"arrow": 1, "columns": 2} and summary["rejected"] == 1 + 3
    messages = pq.read_table(tmp_path / "rejected" / "zmq-rejected-R.parquet")
    assert messages["reason"].to_pylist() == ["arrow", "columns", "columns"]
    row = pq.read_table(next((tmp_path / "rejected").glob("rejected-*.parquet")))
    assert row["row"].to_pylist() == [5] and row["column"].to_pylist() == ["user"]  # stream row 4, 1-based
    from protocol.payload import PayloadReader

    cols = PayloadReader(tmp_path, ("v_", "b_")).both(np.array([0, 3, -1]), np.array([1, -1, 0]))
    assert cols["v_page"].to_pylist() == ["/", "/y", None] and cols["b_bid"].to_pylist() == [8, None, 7]
    assert cols.schema.field("b_price").type == pa.decimal128(10, 2)


def test_batches_without_the_token_are_refused_and_their_rows_counted(tmp_path):
    """source.token on live streams: a producer without it (or with another) neither feeds nor ends a stream; its
    BATCHes are refused before they are decoded, counted as messages and as the rows their headers announce."""
    ports = {"views": free_port(), "buys": free_port()}
    src = open_source(live_plan(tmp_path, ports, **{"source.token": "s3cret"}))
    ep = {n: f"tcp://127.0.0.1:{p}" for n, p in ports.items()}
    t0 = 1_795_000_000_000
    views = pa.table({"vid": [1, 2], "user": ["a", "b"], "page": ["/", "/x"], "at": [t0, t0 + 10]})
    views = views.set_column(3, "at", pa.array([t0, t0 + 10], pa.timestamp("ms", "UTC")))
    for token in ("", "guess"):
        stranger = Producer(ep["views"], name="x", timeout=10, token=token)
        stranger.send_table(views)
        stranger.send_table(pa.concat_tables([views, views]))
        stranger.close()
    mine = {n: Producer(ep[n], name=n, timeout=10, token="s3cret") for n in ports}
    mine["views"].send_table(views)
    for prod in mine.values():
        prod.close()
    got = drain(src)
    live = src.finish()["live_streams"]["views"]
    assert np.concatenate([c.id for c in got]).tolist() == [0, 1]
    assert live["refused_messages"]["tuples"] == 4 and live["refused_tuples"] == 2 * (2 + 4)


def test_dispatcher_1_binds_each_live_stream_at_its_port_plus_1_and_numbers_its_own_rows(tmp_path):
    """Dispatcher 1 of 2 takes what its own producers send to each stream's port + 1: its stream rows start at
    its own block of the payload log, and its rejected messages are listed in files of its own."""
    from master.sources import open_shard

    ports = {"views": free_port(), "buys": free_port()}  # drawn apart: dispatcher 1 binds port + 1
    src = open_shard(live_plan(tmp_path, ports, **{"cluster.dispatchers": 2}), 1)
    ep = {n: f"tcp://127.0.0.1:{p + 1}" for n, p in ports.items()}
    t0 = 1_795_000_000_000
    views = {"vid": [1, 2], "user": ["a", "b"], "page": ["/", "/x"]}
    pv = send(ep["views"], pa.table({**views, "at": pa.array([t0, t0 + 10], pa.timestamp("ms", "UTC"))}), name="v")
    pv._send([wire.header(wire.Frame.BATCH, 1), wire.origin("v", bytes(32), 0, 2), b"not arrow"])
    pb = send(ep["buys"], pa.table({"bid": [7], "user": ["a"], "at": [t0 + 5], "price": ["1.50"]}), name="b")
    pv.close(), pb.close()
    got = drain(src)
    summary = src.finish()
    assert sorted(np.concatenate([c.id for c in got]).tolist()) == [ROW_BLOCK, ROW_BLOCK, ROW_BLOCK + 1]
    live = summary["live_streams"]
    assert live["views"]["endpoints"] == [ep["views"]] and live["buys"]["producers"] == {"b": 1}
    assert pq.read_table(tmp_path / "rejected" / "zmq-rejected-R-d1.parquet")["reason"].to_pylist() == ["arrow"]


def test_a_live_streams_endpoint_already_taken_is_named_by_its_own_key(tmp_path):
    """Another process holds buys' port: the error names streams.buys.endpoint, and views' socket is let go."""
    from common.chunks import InputError

    ports = {"views": free_port(), "buys": free_port()}
    holder = zmq.Context.instance().socket(zmq.PULL)
    holder.bind(f"tcp://127.0.0.1:{ports['buys']}")
    try:
        with pytest.raises(InputError, match=r"cannot bind streams\.buys\.endpoint 'tcp://127\.0\.0\.1:"):
            open_source(live_plan(tmp_path, ports))
        holder.close()
        holder = zmq.Context.instance().socket(zmq.PULL)
        deadline = time.monotonic() + 10  # free again: ZeroMQ's I/O thread closes a socket's listener after close()
        while True:
            try:
                holder.bind(f"tcp://127.0.0.1:{ports['views']}")
                break
            except zmq.ZMQError:
                assert time.monotonic() < deadline, "views' endpoint was not let go"
                time.sleep(0.05)
    finally:
        holder.close()


def test_a_quiet_live_stream_holds_the_other_back_until_its_idle_timeout(tmp_path):
    """views sends, buys has sent one batch and then nothing: views' later tuples wait in the merge (buys may
    still send earlier ones) until buys has been quiet for its idle_timeout, then flow."""
    ports = {"views": free_port(), "buys": free_port()}
    src = open_source(live_plan(tmp_path, ports, **{"streams.buys.idle_timeout": "600ms"}))
    ep = {n: f"tcp://127.0.0.1:{p}" for n, p in ports.items()}
    t0 = 1_795_000_000_000
    pb = send(ep["buys"], pa.table({"bid": [1], "user": ["a"], "at": [t0], "price": ["1"]}), name="b")
    pv = send(
        ep["views"],
        pa.table(
            {
                "vid": np.arange(50),
                "user": ["a"] * 50,
                "page": ["/"] * 50,
                "at": pa.array(t0 + np.arange(50) * 100, pa.timestamp("ms", "UTC")),
            }
        ),
        name="v",
    )
    began, taken, when = time.monotonic(), 0, []
    while time.monotonic() - began < 2.0 and taken < 51:
        c = src.next_chunk(1000)
        taken += len(c.ts)
        when.append((time.monotonic() - began, taken))
        time.sleep(5e-3)
    assert taken == 51
    first_views = min(t for t, n in when if n > 2)
    assert 0.5 < first_views < 1.5  # held back until buys was idle for 600 ms
    pv.close(), pb.close()
    drain(src)
    src.finish()


def test_a_live_stream_whose_producers_ended_holds_nothing_back_once_its_rows_are_taken(tmp_path):
    """views sends 50 rows and ends; buys sends one row and stays open: views counts as ended (the lateness
    rule no longer waits for it) once its last row is taken, as a stream of files does; buys does not."""
    ports = {"views": free_port(), "buys": free_port()}
    src = open_source(live_plan(tmp_path, ports))
    ep = {n: f"tcp://127.0.0.1:{p}" for n, p in ports.items()}
    t0 = 1_795_000_000_000
    pb = send(ep["buys"], pa.table({"bid": [1], "user": ["a"], "at": [t0 + 10_000], "price": ["1"]}), name="b")
    views = {"vid": np.arange(50), "user": ["a"] * 50, "page": ["/"] * 50}
    pv = send(ep["views"], pa.table({**views, "at": pa.array(t0 + np.arange(50) * 100, pa.timestamp("ms", "UTC"))}))
    pv.close()
    taken, began = 0, time.monotonic()
    while src.ended() != [True, False] and time.monotonic() - began < 20:  # a guard, not a bound: ends at once
        taken += len(src.next_chunk(1000).ts)
        time.sleep(5e-3)
    assert src.ended() == [True, False] and taken == 51
    pb.close()
    drain(src)
    assert src.ended() == [True, True]
    src.finish()


def test_a_live_stream_goes_on_from_its_checkpointed_place_and_takes_a_resend_once(tmp_path):
    """In-process crash with checkpoints: a position (the merge's state, every producer's) is taken mid-input, more
    is taken and lost, the sockets die; a new source at the same endpoints seeks to the position and the producers
    send everything again: the tuples come out as an uninterrupted source gives them, each once, and the message
    rejected before the checkpoint (views without `user`) is counted and listed once."""
    t0 = 1_795_000_000_000
    views = [
        pa.table(
            {
                "vid": np.arange(k * 20, k * 20 + 20),
                "user": [f"u{i % 3}" for i in range(20)],
                "page": ["/"] * 20,
                "at": pa.array(t0 + np.arange(k * 20, k * 20 + 20) * 10, pa.timestamp("ms", "UTC")),
            }
        )
        for k in range(4)
    ]
    views.insert(1, views[1].drop_columns(["user"]))
    buys = [
        pa.table(
            {
                "bid": np.arange(k * 20, k * 20 + 20),
                "user": [f"u{i % 3}" for i in range(20)],
                "at": t0 + np.arange(k * 20, k * 20 + 20) * 10 + 5,
                "price": ["1.5"] * 20,
            }
        )
        for k in range(4)
    ]

    def feed(src, end: bool) -> list:
        prods = [Producer(f"tcp://127.0.0.1:{src.ports[n]}", name=n, timeout=10) for n in ("views", "buys")]
        for prod, tables in zip(prods, (views, buys)):
            for t in tables:
                prod.send_table(t)
            if end:
                prod.close()
        return prods

    def opened(out: str, ports: dict):
        for _ in range(50):  # a closed socket's port is free once ZeroMQ's I/O thread has let it go
            try:
                src = open_source(live_plan(tmp_path / out, ports, **{"checkpoint.interval": 1}))
                src.ports = ports
                return src
            except InputError:
                time.sleep(0.1)
        raise AssertionError("the endpoints stayed bound")

    def taken(chunks) -> list:
        return [(int(s), int(i)) for c in chunks for s, i in zip(c.stream, c.id)]

    whole = opened("whole", {"views": free_port(), "buys": free_port()})
    feed(whole, end=True)
    expected = taken(drain(whole))
    assert whole.finish()["live_streams"]["views"]["rejected_by_reason"] == {"columns": 1}

    first = opened("first", {"views": free_port(), "buys": free_port()})
    crashed = feed(first, end=False)
    got = []
    while len(got) < 70:
        got += taken([first.next_chunk(7)])
    assert first.reasons == {"columns": 1}  # the bad message is before the checkpoint
    where = {**first.position(), "records": first.records()}
    lost = 0
    while lost < 30:
        lost += len(first.next_chunk(7).ts)  # taken after the checkpoint: lost with the crash
    for live in first._live:  # SIGKILL: the sockets go, nothing more is said
        live.sock.close()
    for prod in crashed:
        prod.sock.close(linger=0)
        prod.ctx.term()
    again = opened("first", first.ports)
    again.seek(where)
    feed(again, end=True)
    got += taken(drain(again))
    summary = again.finish()["live_streams"]
    assert got == expected
    assert summary["views"]["rejected_by_reason"] == {"columns": 1} and summary["views"]["lost_tuples"] == 0
    assert summary["views"]["duplicate_tuples"] > 0 and summary["buys"]["producers"] == {"buys": 80}
    listed = pq.read_table(tmp_path / "first" / "rejected" / "zmq-rejected-R.parquet")
    assert listed["reason"].to_pylist() == ["columns"]


def write_streams(tmp_path, n_v: int, n_b: int, seed: int) -> tuple[np.ndarray, ...]:
    """views.parquet (timestamps) and buys.parquet (epoch milliseconds, decimal prices) of random users and
    times a little out of order; returns their times (ms) and users."""
    rng = np.random.default_rng(seed)
    t0 = 1_795_000_000_000
    v_ms = t0 + np.cumsum(rng.integers(0, 3, n_v)) - rng.integers(0, 200, n_v)
    b_ms = t0 + np.cumsum(rng.integers(0, 5, n_b)) - rng.integers(0, 200, n_b)
    v_user, b_user = [f"u{i}" for i in rng.integers(0, 40, n_v)], [f"u{i}" for i in rng.integers(0, 40, n_b)]
    pq.write_table(
        pa.table(
            {
                "vid": np.arange(n_v),
                "user": v_user,
                "page": [f"/p{i % 7}" for i in range(n_v)],
                "at": pa.array(v_ms, pa.timestamp("ms", "UTC")),
            }
        ),
        tmp_path / "views.parquet",
    )
    pq.write_table(
        pa.table(
            {
                "bid": np.arange(n_b) + 500,
                "user": b_user,
                "at": b_ms,
                "price": [str(i % 1000) + ".25" for i in range(n_b)],
            }
        ),
        tmp_path / "buys.parquet",
    )
    return v_ms, b_ms, v_user, b_user


def producers(tmp_path, ports: dict[str, int], acks: dict[str, int] | None = None) -> list[subprocess.Popen]:
    """One producer process (control.produce --stream) per stream, pacing its file, named as the stream; with
    `acks`, the port of each stream's ack_endpoint."""
    return [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "control.produce",
                "--stream",
                str(tmp_path / f"{n}.parquet"),
                "--endpoint",
                f"tcp://127.0.0.1:{p}",
                "--batch",
                "200",
                "--rate",
                "2000",
                "--timeout",
                "120",
                "--name",
                n,
                *(["--ack-endpoint", f"tcp://127.0.0.1:{acks[n]}"] if acks else []),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for n, p in ports.items()
    ]


def check_reference(run, streams: tuple, shares: int = 1, max_delay: float = 0.25) -> np.ndarray:
    """The run's pairs and late rows are the reference join's of the two files (`streams`: write_streams'), row i
    of each sent to dispatcher i % `shares`, which judges lateness (by `max_delay`) within its share of the
    stream; returns the pairs."""
    codes: dict = {}
    sides = []
    for side, (ms, users, first) in enumerate(((streams[0], streams[2], 0), (streams[1], streams[3], 500))):
        ts = np.asarray(ms, np.int64) * 1000
        late = np.zeros(len(ts), bool)
        for d in range(shares):
            late[d::shares] = late_flags(ts[d::shares], max_delay)
        keys = np.array([codes.setdefault(u, len(codes)) for u in users])
        sides.append((np.full(len(ts), side), np.arange(len(ts)) + first, ts, keys, late))
    stream, ids, ts, keys, late = (np.concatenate(c) for c in zip(*sides))
    pairs, _ = reference_pairs(stream[~late], ids[~late], ts[~late], keys[~late], 0.3, 1e9)
    assert len(pairs) > 1000
    columns = ("views_vid", "buys_bid")
    np.testing.assert_array_equal(run.pairs(columns), pairs)
    np.testing.assert_array_equal(run.late_ids(columns, ("views", "buys")), np.sort(stream[late] * 2**40 + ids[late]))
    return pairs


#: the join of write_streams' files, its results bucketed every 100 ms
JOIN = {"join.window": "300ms", "join.max_delay": "250ms", "partitioning.partitions": 8, "epochs.distribution": "100ms"}


def test_one_producer_per_live_stream_gives_the_reference_join_of_their_files(tmp_path):
    """Two producer processes (control.produce --stream), one per stream, each pacing its own Parquet file
    (views: timestamps; buys: epoch milliseconds, decimal prices) into a cluster of 1 master and 2 slaves:
    results equal the reference join of the files, with both streams' columns, in the result files and on the
    result stream a subscriber reads (TABLEs)."""
    n_v, n_b = 3000, 2000
    streams = write_streams(tmp_path, n_v, n_b, 4)
    ports, results_port = {"views": free_port(), "buys": free_port()}, free_port()
    sub = start(
        "control.subscribe",
        "--endpoint",
        f"tcp://127.0.0.1:{results_port}",
        "--out",
        tmp_path / "sub.parquet",
        "--progress",
        0,
    )
    feeds = producers(tmp_path, ports)
    run = run_cluster(
        tmp_path,
        3,
        {
            **live_settings(ports),
            **JOIN,
            "output.zmq_endpoint": f"tcp://127.0.0.1:{results_port}",
            "output.wait_subscribers": 1,
        },
    )
    assert run.returncode == 0, run.stderr
    got = finish(sub)
    assert got["ended"] and not (got["gaps"] or got["covered"]) and got["results"] == run.summary["results"], got
    for p in feeds:
        assert p.wait(60) == 0, p.stderr.read()
    pairs = check_reference(run, streams)
    ids = ("views_vid", "buys_bid")
    results = read_tables(run.out / "results")
    assert results.schema.field("buys_price").type == pa.decimal128(10, 2)
    assert results["views_page"].to_pylist() == [f"/p{i % 7}" for i in results["views_vid"].to_pylist()]
    streamed = pq.read_table(tmp_path / "sub.parquet")
    np.testing.assert_array_equal(np.sort(encode_pairs(*(streamed[c].to_numpy() for c in ids))), pairs)
    assert streamed.schema.field("buys_price").type == pa.decimal128(10, 2)
    assert streamed["views_page"].to_pylist() == [f"/p{i % 7}" for i in streamed["views_vid"].to_pylist()]
    assert run.summary["live_streams"]["buys"]["tuples"] == n_b


@pytest.mark.parametrize("fault", ["1:checkpoint:2", "0:checkpoint:2"])
def test_live_streams_killed_under_the_supervisor_lose_nothing_their_producers_sent(tmp_path, fault):
    """Checkpoints with live streams: a slave, or the master, is SIGKILLed as a checkpoint goes; each stream's
    producer (control.produce --stream --ack-endpoint) keeps what no complete checkpoint holds and resends it to
    the restarted cluster, which goes on from the checkpoint's merge state and producers' positions and drops
    what it already has: the results are exactly the reference join of the two files."""
    from tests.cluster.test_recovery import SUPERVISE

    n_v, n_b = 3000, 2000
    streams = write_streams(tmp_path, n_v, n_b, 9)
    ports = {"views": free_port(), "buys": free_port()}
    acks = {name: free_port() for name in ports}
    feeds = producers(tmp_path, ports, acks)
    settings = {
        **live_settings(ports),
        **JOIN,
        **{f"streams.{name}.ack_endpoint": f"tcp://127.0.0.1:{port}" for name, port in acks.items()},
        "checkpoint.interval": 2,
        "checkpoint.keep": 1000,  # the one recovered from is read after the run (assert_resent)
        "source.rate": 2000.0,  # the master takes the input over many checkpoints, so some is resent
    }
    run = run_cluster(
        tmp_path,
        3,
        settings,
        wrapper=SUPERVISE,
        timeout=150,
        env={"STREAMJOIN_FAULT": f"{fault}:{tmp_path / 'fault-fired'}"},
    )
    assert run.returncode == 0, run.stderr
    sent = [json.loads(p.communicate(timeout=60)[0]) for p in feeds]
    assert (tmp_path / "fault-fired").exists() and "restart 1 of 3" in run.stderr
    assert run.summary["checkpoints"]["recovered_from"] is not None, run.stderr
    assert_resent(run, sent, n_v + n_b, dispatcher_killed=fault.startswith("0:"))
    check_reference(run, streams)
    live = run.summary["live_streams"]
    assert {name: live[name]["producers"] for name in live} == {"views": {"views": n_v}, "buys": {"buys": n_b}}
    assert live["views"]["lost_tuples"] == live["buys"]["lost_tuples"] == 0


def assert_resent(run, sent: list[dict], total: int, dispatcher_killed: bool) -> None:
    """Every producer's tuples were confirmed; with a dispatcher killed as it began a checkpoint (one counted once
    it has taken input: protocol.faults), those the checkpoint the cluster recovered from lacks were sent again.
    On a loaded machine the master may have taken the whole input before that checkpoint (its pacing catching
    up after a stall), and then there is nothing to resend; a slave's checkpoint may come before any input."""
    assert all(s["confirmed"] for s in sent), sent
    if dispatcher_killed:
        recovered = checkpoint.load_manifest(
            run.out / "checkpoints" / checkpoint.name_of(run.summary["checkpoints"]["recovered_from"])
        )
        held = sum(d["source"]["accepted"] for d in [recovered["master"], *recovered.get("dispatchers", {}).values()])
        assert held == total or sum(s["tuples_resent"] for s in sent) > 0, (held, sent)


def split(tmp_path, ports: dict[str, int], shares: int) -> dict[str, int]:
    """Each stream's file cut into `shares` files, row i into NAME-(i % shares).parquet, for the producer of
    dispatcher i % shares; returns their ports (the stream's port + its dispatcher)."""
    for name in ports:
        table = pq.read_table(tmp_path / f"{name}.parquet")
        for d in range(shares):
            pq.write_table(table.take(np.arange(d, table.num_rows, shares)), tmp_path / f"{name}-{d}.parquet")
    return {f"{name}-{d}": port + d for name, port in ports.items() for d in range(shares)}


@pytest.mark.parametrize("fault", [None, "2:checkpoint:2", "1:checkpoint:2"])
def test_two_dispatchers_each_fed_by_its_own_producers_give_the_reference_join(tmp_path, fault):
    """Two dispatchers, each stream's rows split between two producers, one at the stream's port (dispatcher 0)
    and one at port + 1 (dispatcher 1): each dispatcher merges its own share, and the results are the reference
    join of the whole files, lateness judged within each dispatcher's share.  With checkpoints, a slave or
    dispatcher 1 SIGKILLed as one goes under the supervisor: the producers resend to each dispatcher's own
    ack_endpoint (port + 1 for dispatcher 1) what no complete checkpoint holds, and nothing is lost or doubled."""
    from tests.cluster.test_recovery import SUPERVISE

    n_v, n_b = 3000, 2000
    streams = write_streams(tmp_path, n_v, n_b, 6)
    ports = {"views": free_port(), "buys": free_port()}
    acks = {name: free_port() for name in ports} if fault else {}
    feeds = producers(tmp_path, split(tmp_path, ports, 2), split(tmp_path, acks, 2) if fault else None)
    # rows late, and not the whole file's late rows: lateness is judged within each dispatcher's share
    settings = {**live_settings(ports), **JOIN, "join.max_delay": "150ms", "cluster.dispatchers": 2}
    if fault:
        settings |= {
            **{f"streams.{name}.ack_endpoint": f"tcp://127.0.0.1:{port}" for name, port in acks.items()},
            "checkpoint.interval": 2,
            "checkpoint.keep": 1000,  # the one recovered from is read after the run (assert_resent)
            "source.rate": 2000.0,  # the dispatchers together: the input over many checkpoints, some resent
        }
    run = run_cluster(
        tmp_path,
        4,
        settings,
        wrapper=SUPERVISE if fault else (),
        timeout=150,
        env={"STREAMJOIN_FAULT": f"{fault}:{tmp_path / 'fault-fired'}"} if fault else None,
    )
    assert run.returncode == 0, run.stderr
    sent = [json.loads(p.communicate(timeout=60)[0]) for p in feeds]
    check_reference(run, streams, 2, 0.15)
    live = run.summary["live_streams"]
    assert {name: live[name]["producers"] for name in live} == {
        "views": {"views-0": n_v // 2, "views-1": n_v // 2},
        "buys": {"buys-0": n_b // 2, "buys-1": n_b // 2},
    }
    assert len(live["views"]["endpoints"]) == 2 and live["views"]["lost_tuples"] == 0
    if fault:
        assert (tmp_path / "fault-fired").exists() and "restart 1 of 3" in run.stderr
        assert run.summary["checkpoints"]["recovered_from"] is not None, run.stderr
        assert_resent(run, sent, n_v + n_b, dispatcher_killed=fault.startswith(("0:", "1:")))
