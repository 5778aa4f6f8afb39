"""The single file pushed live (master/sources/live.py, producers.py), the producer and the subscriber over real
loopback ZeroMQ sockets; CURVE; the config rules."""

from __future__ import annotations

import os
import socket
import threading
import time

import numpy as np
import pyarrow.parquet as pq
import pytest
import zmq
import zmq.auth
from zmq.utils.monitor import recv_monitor_message

from control.subscribe import subscribe
from master.sources import open_source
from common.chunks import InputError
from protocol import wire
from protocol.access import public
from protocol.config import ConfigError, load_config
from protocol.plan import Security, compile_plan, load_plan
from control.produce import Blocked, Producer
from common.zmq_security import bind_server, stop_authenticators
from tests.runs import free_port


def zmq_plan(tmp_path, *extra):
    return load_plan(
        None,
        [
            'source.kind="zmq"',
            'source.endpoint="tcp://127.0.0.1:*"',
            f'output.path="{tmp_path}"',
            "source.max_message_tuples=300",
            *extra,
        ],
    )


def drain(src, limit=1000, timeout=10.0):
    parts, deadline = [], time.monotonic() + timeout
    while (c := src.next_chunk(limit)) is not None:
        assert len(c.id) <= limit
        if len(c.id):
            parts.append(c)
        else:
            assert time.monotonic() < deadline, "the source never ended"
            time.sleep(1e-3)
    return parts


def test_bad_messages_are_rejected_whole_and_good_ones_around_them_all_ingested(tmp_path):
    src = open_source(zmq_plan(tmp_path))
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.connect(src.feed.endpoint)
    rng = np.random.default_rng(3)
    sent_ids, next_id = [], 0
    bad = {
        "magic": [b"NOPE" + bytes(wire.HEADER.itemsize - 4), b""],
        "too_large": None,
        "ts": None,
        "frames": wire.encode_end(0.0) + [wire.origin("p", bytes(32)), b"x"],
    }
    for i in range(40):
        n = int(rng.integers(1, 300))
        stream = rng.integers(0, 2, n)
        ids = next_id + np.arange(n)
        ts = rng.integers(0, 1_000_000, n)  # microseconds
        if i % 4 == 1:  # one row with a ts out of range spoils the whole message
            ts[n // 2] = 2**62
        frames = wire.encode_tuples(stream, ids, ts, ids % 7, ts, seq=i)
        if i % 4 == 3:  # more than max_message_tuples
            frames = wire.encode_tuples(
                np.zeros(301), np.arange(301), np.zeros(301, np.int64), np.zeros(301), np.zeros(301)
            )
        push.send_multipart(frames)
        if i % 4 in (0, 2):
            sent_ids.append(ids)
            next_id += n
        if i % 10 == 0:
            push.send_multipart(bad["magic"])
            push.send_multipart(bad["frames"])
    push.send_multipart(wire.encode_end(1.5))
    got = drain(src, limit=250)
    np.testing.assert_array_equal(np.concatenate([c.id for c in got]), np.concatenate(sent_ids))
    summary = src.finish()
    z = summary["zmq_ingest"]
    assert z["rejected_by_reason"] == {"ts": 10, "too_large": 10, "magic": 4, "frames": 4}
    assert summary["rejected"] == 28 and z["producers_blocked_seconds"] == 1.5 and z["held_peak_tuples"] <= 300
    listed = pq.read_table(tmp_path / "rejected" / "zmq-rejected.parquet").to_pylist()
    assert sorted(r["reason"] for r in listed) == sorted(
        ["ts"] * 10 + ["too_large"] * 10 + ["magic"] * 4 + ["frames"] * 4
    )
    push.close()


def test_input_ends_after_every_producer_or_when_idle(tmp_path):
    src = open_source(zmq_plan(tmp_path, "source.producers=2"))
    producers = [Producer(src.feed.endpoint, sender=k) for k in range(2)]
    for k, p in enumerate(producers):
        p.send(np.zeros(5), np.arange(5) + 10 * k, np.arange(5) * 1_000_000, np.zeros(5), np.zeros(5))
    producers[0].close()
    assert sum(len(c.id) for c in drain_until_empty(src)) == 10 and src.next_chunk(10) is not None  # one still open
    producers[1].close()
    assert drain(src) == []
    idle = open_source(zmq_plan(tmp_path, "source.idle_timeout=0.2"))
    assert drain(idle) == []  # no producer at all: ends after 0.2 s without a message
    idle.finish()
    src.finish()


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_64_mib_frame_is_refused_unread_and_its_sender_disconnected(tmp_path):
    """max_message_tuples = 300: ZMQ_MAXMSGSIZE is about 1 MiB, so a 64 MiB frame is refused as it arrives
    (never read whole into this process) and its connection dropped; a well-behaved producer goes on."""
    src = open_source(zmq_plan(tmp_path))
    ctx = zmq.Context()
    rogue = ctx.socket(zmq.PUSH)
    rogue.linger = 0
    monitor = rogue.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
    rogue.connect(src.feed.endpoint)
    huge = np.zeros(64 << 20, dtype=np.uint8)  # calloc'ed zero pages: sending them costs this process nothing
    before = resident_bytes()
    rogue.send_multipart(wire.encode_end(0.0) + [huge], copy=False)
    events, deadline = [], time.monotonic() + 10
    while zmq.EVENT_DISCONNECTED not in events:
        assert time.monotonic() < deadline, f"the sender was never disconnected (events {events})"
        assert src.next_chunk(10) is not None and src.feed.messages == 0  # nothing of it reaches the source
        if monitor.poll(10):
            events.append(recv_monitor_message(monitor)["event"])
    assert resident_bytes() - before < 32 << 20, resident_bytes() - before
    good = Producer(src.feed.endpoint)
    good.send(np.zeros(5), np.arange(5), np.arange(5) * 1_000_000, np.zeros(5), np.zeros(5))
    good.close()
    assert [c.id.tolist() for c in drain(src)] == [[0, 1, 2, 3, 4]]
    assert src.finish()["rejected"] == 0 and src.feed.messages == 2  # the good message and its END
    rogue.disable_monitor()
    monitor.close()
    rogue.close()
    ctx.term()


def drain_until_empty(src):
    parts, deadline = [], time.monotonic() + 5
    while sum(len(c.id) for c in parts) < 10 and time.monotonic() < deadline:
        parts.append(src.next_chunk(100))
    return parts


@pytest.fixture
def keys(tmp_path):
    for name in ("server", "producer", "stranger"):
        (tmp_path / name).mkdir()
        zmq.auth.create_certificates(tmp_path / name, name)
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "producer.key").write_bytes((tmp_path / "producer" / "producer.key").read_bytes())
    return tmp_path


def test_curve_lets_in_only_producers_holding_an_allowed_key(tmp_path, keys):
    cfg = zmq_plan(
        tmp_path / "out",
        f'security.server_key="{keys}/server/server.key_secret"',
        f'security.client_keys="{keys}/allowed"',
    )
    src = open_source(cfg)
    one = (np.zeros(1), np.arange(1), np.zeros(1, np.int64), np.zeros(1), np.zeros(1))
    server_pub = str(keys / "server" / "server.key")
    with pytest.raises(Blocked), Producer(src.feed.endpoint, timeout=1.0) as bare:
        bare.send(*one)  # no CURVE at all: the handshake never completes
    stranger_key = str(keys / "stranger" / "stranger.key_secret")
    with pytest.raises(Blocked), Producer(src.feed.endpoint, server_key=server_pub, key=stranger_key, timeout=1.0) as x:
        x.send(*one)  # a well-formed key that is not in client_keys: ZAP refuses it
    assert bare.ctx.closed and x.ctx.closed  # given up at once: nothing left for the collector to finalize
    assert src.next_chunk(10) is not None and src.feed.messages == 0
    ok = Producer(
        src.feed.endpoint, server_key=server_pub, key=str(keys / "producer" / "producer.key_secret"), timeout=5
    )
    ok.send(*one)
    ok.close()
    assert sum(len(c.id) for c in drain(src)) == 1
    src.finish()


@pytest.mark.parametrize(
    "settings,message",
    [
        (['source.kind="zmq"', 'source.endpoint="tcp://0.0.0.0:5555"'], "security.allow_remote"),
        (['output.zmq_endpoint="tcp://*:5556"'], "not a loopback address"),
        (
            ['source.kind="zmq"', 'source.endpoint="tcp://0.0.0.0:5555"', "security.allow_remote=true"],
            "CURVE is required",
        ),
        (['source.kind="zmq"', 'source.endpoint="udp://127.0.0.1:5"'], "expected tcp://HOST:PORT"),
        (['source.kind="zmq"', 'output.zmq_endpoint="tcp://127.0.0.1:5555"'], "must differ"),
        (['security.server_key="/nonexistent.key_secret"'], "security.server_key"),
    ],
)
def test_config_refuses_unsafe_or_wrong_endpoints(settings, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, settings)


def test_config_accepts_a_remote_bind_with_keys(keys):
    cfg = load_config(
        None,
        [
            'source.kind="zmq"',
            'source.endpoint="tcp://0.0.0.0:5555"',
            "security.allow_remote=true",
            f'security.server_key="{keys}/server/server.key_secret"',
            f'security.client_keys="{keys}/allowed"',
        ],
    )
    assert cfg["security"]["allow_remote"]


def test_curve_result_stream_reaches_only_subscribers_holding_an_allowed_key(keys):
    # the publisher side of output.zmq_endpoint: an XPUB bound as in master/result_stream.py
    pub = zmq.Context.instance().socket(zmq.XPUB)
    security = Security(False, f"{keys}/server/server.key_secret", f"{keys}/allowed")
    bind_server(pub, "tcp://127.0.0.1:*", security)
    endpoint = pub.last_endpoint.decode()
    server_pub = str(keys / "server" / "server.key")
    got = {}

    def listen(name, key):
        got[name] = subscribe(endpoint, server_pub if key else None, key, timeout=3.0, progress=0)

    threads = [
        threading.Thread(target=listen, args=("allowed", str(keys / "producer" / "producer.key_secret"))),
        threading.Thread(target=listen, args=("stranger", str(keys / "stranger" / "stranger.key_secret"))),
        threading.Thread(target=listen, args=("plain", None)),
    ]
    for t in threads:
        t.start()
    assert pub.poll(5000) and pub.recv()[:1] == b"\x01"  # the allowed subscriber's subscription
    rows = np.zeros(2, dtype=wire.RESULT_RECORD)
    rows["r_ts"] = [1.0, 2.0]
    for frames in (wire.encode_results(rows, seq=0), wire.encode_punct(2.5, seq=1), wire.encode_end(0.0, seq=2)):
        pub.send_multipart(frames)
    for t in threads:
        t.join()
    pub.close()
    stop_authenticators()
    assert got["allowed"]["ended"] and got["allowed"]["results"] == 2 and got["allowed"]["punctuations"] == 1
    assert got["stranger"]["results"] == got["plain"]["results"] == 0 and not got["stranger"]["ended"]


def test_endpoint_check_resolves_names_before_it_calls_a_bind_loopback(monkeypatch):
    # a name is local only if every address it resolves to is loopback; a prefix that looks local is not enough
    load_config(None, ['source.kind="zmq"', 'source.endpoint="tcp://localhost:5555"'])
    load_config(None, ['source.kind="zmq"', 'source.endpoint="tcp://lo:5555"'])  # ZeroMQ binds an interface name
    for host in ("localhost.invalid", "127.0.0.1.invalid"):  # passed as loopback by their prefix on main
        with pytest.raises(ConfigError, match="security.allow_remote"):
            load_config(None, ['source.kind="zmq"', f'source.endpoint="tcp://{host}:5555"'])
    real = socket.getaddrinfo
    names = {"feed-host": "10.1.2.3", "loop-alias": "127.0.0.2"}
    monkeypatch.setattr(
        socket,
        "getaddrinfo",
        lambda host, *a, **k: [(socket.AF_INET, 1, 6, "", (names[host], 0))] if host in names else real(host, *a, **k),
    )
    with pytest.raises(ConfigError, match="source.endpoint: 'tcp://feed-host:5555' is not a loopback address"):
        load_config(None, ['source.kind="zmq"', 'source.endpoint="tcp://feed-host:5555"'])
    with pytest.raises(ConfigError, match="metrics.endpoint"):
        load_config(None, ['metrics.endpoint="feed-host:9464"'])
    load_config(None, ['source.kind="zmq"', 'source.endpoint="tcp://loop-alias:5555"'])


def test_config_rules_of_the_token_and_the_acknowledgements(tmp_path):
    zmq_on = ['source.kind="zmq"']
    (tmp_path / "empty").write_text("\n")
    for settings, message in [
        (['source.token="a"', f'source.token_file="{tmp_path}/t"'], "not both"),
        ([f'source.token_file="{tmp_path}/missing"'], "cannot read"),
        ([f'source.token_file="{tmp_path}/empty"'], "is empty"),
        (['source.ack_endpoint="tcp://127.0.0.1:5554"'], "set checkpoint.interval"),
        (['source.ack_endpoint="tcp://127.0.0.1:5555"', "checkpoint.interval=2"], "must differ"),
        # dispatcher 1 binds every endpoint's port + 1: its acks would meet 0's input
        (
            ['source.ack_endpoint="tcp://127.0.0.1:5554"', "checkpoint.interval=2", "cluster.dispatchers=2"],
            r"source.ack_endpoint \(dispatcher 1's\): must differ from source.endpoint",
        ),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(None, zmq_on + settings)
    two = load_config(
        None, zmq_on + ['source.ack_endpoint="tcp://127.0.0.1:5557"', "checkpoint.interval=2", "cluster.dispatchers=2"]
    )  # acknowledgements with several dispatchers
    assert two["source"]["ack_endpoint"] == "tcp://127.0.0.1:5557"
    cfg = load_config(None, zmq_on + ['source.token="s3cret"'])
    assert public(cfg)["source"]["token"] == "***" and cfg["source"]["token"] == "s3cret"  # summary, manifests


def test_a_stranger_neither_feeds_nor_ends_the_input_and_a_resend_is_taken_once(tmp_path):
    """In-process: a producer holding the token; ENDs and tuples without it (none, wrong) are refused and counted;
    a producer's resend of what the master has is dropped row-exactly; a gap in its position counts as lost."""
    src = open_source(zmq_plan(tmp_path, 'source.token="s3cret"'))
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.connect(src.feed.endpoint)
    cols = lambda a, b: (np.arange(a, b) % 2, np.arange(a, b), np.arange(a, b) * 1000, np.zeros(b - a), np.zeros(b - a))
    wrong = wire.origin("intruder", wire.token_digest("guess"))
    mine = lambda offset: wire.origin("feed", wire.token_digest("s3cret"), offset=offset)
    push.send_multipart(wire.encode_end(0.0))
    push.send_multipart(wire.encode_end(0.0, origin_frame=wrong))
    push.send_multipart(wire.encode_tuples(*cols(900, 910), origin_frame=wrong))
    push.send_multipart(wire.encode_tuples(*cols(0, 100), origin_frame=mine(0)))
    push.send_multipart(wire.encode_tuples(*cols(50, 150), origin_frame=mine(50)))  # a resend from 50: half new
    push.send_multipart(wire.encode_tuples(*cols(0, 100), origin_frame=mine(0)))  # all of it again
    push.send_multipart(wire.encode_tuples(*cols(170, 200), origin_frame=mine(170)))  # 150..169 never came
    push.send_multipart(wire.encode_end(0.0, origin_frame=mine(200)))
    got = np.concatenate([c.id for c in drain(src, limit=64)])
    np.testing.assert_array_equal(got, np.r_[0:150, 170:200])
    z = src.finish()["zmq_ingest"]
    assert z["refused_messages"] == {"end": 2, "tuples": 1} and z["refused_tuples"] == 10
    assert (z["duplicate_tuples"], z["lost_tuples"], z["producers_ended"], z["producers"]) == (
        150,
        20,
        1,
        {"feed": 200},
    )
    push.close()


def test_a_producer_resends_what_no_checkpoint_holds_to_a_restarted_master(tmp_path):
    """In-process crash: the master acknowledges a position, takes more, dies; a new master at the same endpoints
    resumes at that position; the producer (which never stopped sending) resends from it: every tuple once, in
    order, the resend's overlap trimmed and messages to the dead run dropped."""
    ports = free_port(), free_port()
    cfg = lambda out: zmq_plan(
        tmp_path / out,
        f'source.endpoint="tcp://127.0.0.1:{ports[0]}"',
        f'source.ack_endpoint="tcp://127.0.0.1:{ports[1]}"',
        "checkpoint.interval=1",
    )
    src = open_source(cfg("one"))
    prod = Producer(src.feed.endpoint, name="feed", ack_endpoint=f"tcp://127.0.0.1:{ports[1]}", keep=40, timeout=20)
    sent = {}

    def send():
        for i in range(30):
            ids = np.arange(i * 100, i * 100 + 100)
            prod.send(ids % 2, ids, ids * 1000, ids % 5, np.zeros(100))
            time.sleep(0.01)
        sent.update(prod.close())

    sender = threading.Thread(target=send)
    sender.start()
    got, deadline = [], time.monotonic() + 20
    while (n := sum(map(len, got))) < 1050 and time.monotonic() < deadline:
        got.append(src.next_chunk(min(70, 1050 - n)).id)
    held = src.position()  # a checkpoint: 1,050 tuples (a message split at the cut)
    src.acknowledge(held)
    while sum(map(len, got)) < 1500 and time.monotonic() < deadline:
        got.append(src.next_chunk(70).id)
    src.feed.sock.close()  # SIGKILL: nothing more is taken, nothing is said
    src.feed.acks.close()
    src.feed.acks.context.term()
    got = [np.concatenate(got)[: held["taken"]["feed".encode().hex()]]]
    for _ in range(50):  # a closed socket's port is free once ZeroMQ's I/O thread has let it go
        try:
            again = open_source(cfg("two"))
            break
        except InputError:
            time.sleep(0.1)
    again.seek(held)
    got += [c.id for c in drain(again, limit=70)]
    z = again.finish()["zmq_ingest"]  # the final ACK confirms the producer's END
    sender.join(20)
    np.testing.assert_array_equal(np.concatenate(got), np.arange(3000))
    assert held["taken"] == {"feed".encode().hex(): 1050} and z["producers"] == {"feed": 3000}
    assert sent["confirmed"] and sent["tuples_resent"] >= 500 and z["lost_tuples"] == 0  # at least 1,000..1,499
    assert z["duplicate_tuples"] == 50  # the first resent message began before the cut


def test_the_subscriber_counts_the_messages_missed_in_each_gap():
    pub = zmq.Context.instance().socket(zmq.XPUB)
    pub.bind("tcp://127.0.0.1:*")
    got = {}
    reader = threading.Thread(target=lambda: got.update(subscribe(pub.last_endpoint.decode(), timeout=3.0, progress=0)))
    reader.start()
    assert pub.poll(5000) and pub.recv()[:1] == b"\x01"
    for frames in (
        wire.encode_punct(1.0, seq=0),
        wire.encode_punct(2.0, seq=3),
        wire.encode_punct(3.0, seq=4),
        wire.encode_end(0.0, seq=9),
    ):
        pub.send_multipart(frames)
    reader.join()
    pub.close()
    assert got["ended"] and got["gaps"] == 2 and got["missed_messages"] == 2 + 4


def test_ordered_stream_lets_in_only_the_input_whose_results_fit_its_bound(tmp_path):
    """master.result_stream.ResultStream.ingest_room over MPI.COMM_SELF: HEADROOM x results per tuple (the run's
    mean or a latest batch's, the larger) x tuples on their way must fit in output.subscriber_buffer_bytes beside
    the held results; before any results, FIRST_TUPLES are let in."""
    from mpi4py import MPI

    from master.result_stream import FIRST_TUPLES, HEADROOM, ResultStream, frame_rows
    from protocol.messages import TAG_RESULTS

    port = free_port()
    cfg = load_config(
        None,
        [
            f'output.zmq_endpoint="tcp://127.0.0.1:{port}"',
            "output.ordered=true",
            "output.subscriber_buffer_bytes=720000",
        ],
    )
    out = ResultStream(MPI.COMM_SELF, compile_plan(cfg), 4)
    hundred = np.zeros(100, dtype=[("ts", "<i8")])

    def batch(seq, results):  # a slave's answer to batch `seq`: `results` rows, later ts 1 s
        buf, rows = wire.results_buffer(results, 0, seq, floor=0)
        rows[:] = np.zeros(results, wire.RESULT_RECORD)
        rows["r_ts"] = 1.0
        out.sent(0, seq, np.arange(4), hundred, hundred[:0], 0)
        request = MPI.COMM_SELF.Isend([buf, MPI.BYTE], dest=0, tag=TAG_RESULTS)
        while not out.pump(0, np.zeros(4, np.int64)):  # punctuation 0: everything stays held
            pass
        request.Wait()

    assert out.ingest_room(0) == FIRST_TUPLES and out.ingest_room(FIRST_TUPLES) == 0  # no results yet: no estimate
    batch(1, 2000)  # 20 results a tuple, 1,440 bytes; 144,000 held
    assert out.ingest_room(0) == (720000 - 144000) // (HEADROOM * 1440) == 200
    assert out.ingest_room(200) == 0  # 200 tuples buffered: their results take the rest
    batch(2, 9000)  # 90 results a tuple in this batch (55 in the run); 792,000 held, over the bound, and
    # nothing on its way to release any: so one bound's worth of input, as the latest batch brings, is let in
    assert out.ingest_room(0) == int(720000 // (HEADROOM * 90 * 72)) == 55
    deadline = time.monotonic() + 5
    while out.held_bytes and time.monotonic() < deadline:  # punctuation 2 s releases them all
        out.pump(2_000_000, np.zeros(4, np.int64))
        time.sleep(0.01)
    assert out.held_bytes == 0 and out.held_peak_bytes == 792000
    out.close()
    s = out.summary()["result_stream"]  # the results in messages of at most frame_rows, the punctuations, END
    assert s["messages"] == -(-11000 // frame_rows(wire.RESULT_RECORD)) + s["punctuations"] + 1 and s["gaps"] == 0


def test_a_slaves_table_goes_out_whole_in_messages_within_the_bound():
    """A TABLE from a slave (over MPI.COMM_SELF) of 5,000 rows whose text grows from 1 to 100 bytes, unordered:
    a real SUB socket gets it in TABLE messages of at most MESSAGE_BYTES each, their rows the table's, in order,
    then the punctuation and END."""
    import pyarrow as pa
    from mpi4py import MPI

    from master.result_stream import MESSAGE_BYTES, ResultStream
    from protocol.messages import TAG_RESULTS

    port = free_port()
    cfg = load_config(None, [f'output.zmq_endpoint="tcp://127.0.0.1:{port}"', "output.wait_subscribers=1"])
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    out = ResultStream(MPI.COMM_SELF, compile_plan(cfg), 4)  # returns once the subscriber is in
    n = 5000
    table = pa.table(
        {
            "views_page": ["/" + "x" * (i // 50) for i in range(n)],
            "views_vid": np.arange(n),
            "delay": np.zeros(n),
            "time": np.linspace(0.0, 1.0, n),
        }
    )
    out.sent(0, 1, np.arange(4), np.zeros(n, [("ts", "<i8")]), np.zeros(0, [("ts", "<i8")]), 0)
    request = MPI.COMM_SELF.Isend([wire.table_buffer(table, 0, 1, 2_000_000), MPI.BYTE], dest=0, tag=TAG_RESULTS)
    while not out.pump(2_000_000, np.zeros(4, np.int64)):
        pass
    request.Wait()
    out.close()
    got, sizes, kinds = [], [], []
    while sub.poll(2000):
        frames = sub.recv_multipart()
        msg = wire.decode(frames, tuple(wire.Frame), n)
        kinds.append(msg.kind)
        if msg.kind == wire.Frame.TABLE:
            got.append(wire.read_table(msg.arrow))
            sizes.append(sum(len(f) for f in frames))
        if msg.kind == wire.Frame.END:
            break
    sub.close()
    assert pa.concat_tables(got).equals(table) and len(got) > 5 and max(sizes) <= MESSAGE_BYTES
    assert kinds[-2:] == [wire.Frame.PUNCT, wire.Frame.END]


def test_an_ordered_stream_takes_no_more_results_while_its_subscriber_is_behind_and_the_bound_is_full():
    """master.result_stream over MPI.COMM_SELF, a real SUB socket that stops reading: once results wait for it
    and the held and waiting results fill output.subscriber_buffer_bytes, a slave's result message (a
    synchronous send, as slave.results_out sends them) is not taken -- the sender waits and the stream says it
    holds it back --; once the subscriber reads, it is taken and the sender goes on."""
    from mpi4py import MPI

    from master.result_stream import ResultStream
    from protocol.messages import TAG_RESULTS

    port, bound = free_port(), 1 << 20
    plan = load_plan(
        None,
        [
            f'output.zmq_endpoint="tcp://127.0.0.1:{port}"',
            "output.ordered=true",
            "output.wait_subscribers=1",
            f"output.subscriber_buffer_bytes={bound}",
            "output.subscriber_timeout=600.0",
        ],
    )
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.rcvhwm, sub.rcvbuf, sub.linger = 1, 4096, 0
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    out = ResultStream(MPI.COMM_SELF, plan, 4)  # returns once the subscriber is in
    try:
        nothing = np.zeros(4, np.int64)

        def send(seq: int, results: int = 2000) -> MPI.Request:  # a slave's answer to batch `seq`: ts `seq` s
            buf, rows = wire.results_buffer(results, 0, seq, floor=0)
            rows[:] = np.zeros(results, wire.RESULT_RECORD)
            rows["r_ts"] = seq
            out.sent(0, seq, np.arange(4), np.full(1, seq * 10**6, [("ts", "<i8")]), np.zeros(0, [("ts", "<i8")]), 0)
            return MPI.COMM_SELF.Issend([buf, MPI.BYTE], dest=0, tag=TAG_RESULTS)

        def pump(seq: int) -> None:  # no input below seq + 1 s to come: the punctuation passes batch `seq`
            out.pump((seq + 1) * 10**6, nothing)

        def full() -> bool:
            return bool(out.outbox) and out.held_bytes + out.outbox_bytes >= bound

        seq = 0
        for _ in range(20):  # on a busy host the socket's queues may still drain after the outbox first filled
            while not full() and seq < 2000:
                seq += 1  # each taken and published until the subscriber's queue is full
                request = send(seq)
                while not request.Test():
                    pump(seq)
                pump(seq)
            assert full(), (seq, out.outbox_bytes)
            assert out.held_bytes + out.outbox_bytes <= bound + 2000 * wire.RESULT_RECORD.itemsize  # one past
            request = send(seq + 1)
            for _ in range(50):
                published = out.seq - len(out.outbox)  # messages that left the outbox
                pump(seq)
                if request.Test():  # taken: only because the subscriber's queue took more first
                    assert out.seq - len(out.outbox) > published, "a result taken while the bound was full"
                    seq += 1
                    break
            else:
                break  # held back for 50 pumps
        assert not request.Test() and out.holding and full()
        assert "slaves' results held back" in out.note() and "subscriber behind" in out.note()
        deadline = time.monotonic() + 30
        while not request.Test() and time.monotonic() < deadline:  # the subscriber reads on
            while sub.poll(0):
                sub.recv_multipart()
            pump(seq + 1)
        assert request.Test() and out.summary()["result_stream"]["slaves_held_back"] >= 1
        while out.outbox and time.monotonic() < deadline:
            while sub.poll(0):
                sub.recv_multipart()
            pump(seq + 1)
        assert not out.holding and out.results == 2000 * (seq + 1)
        out.sock.setsockopt(zmq.LINGER, 0)
        out.close()
    finally:  # a failed assertion leaves no open socket for the collector (its context would wait for ever)
        sub.close()
        if not out.ctx.closed:
            out.sock.close(linger=0)
            out.ctx.term()
