"""The real cluster fed over ZeroMQ by producer processes, its result stream read by a subscriber process.

Differential like tests/cluster/test_cluster.py: the results (files and stream) equal the reference join over the
input the producers sent, whatever the random pauses between their sends.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import zmq

from deploy.launch import mpi_env, mpirun_command
from protocol import wire
from tests.runs import Run, free_port, run_cluster, write_config
from tests.reference import encode_pairs, reference_pairs
from tests.cluster.test_balance_cluster import FORCED_CHURN, straggler
from tests.cluster.test_cluster import SMALL, check_exact, reference_for


def write_input(path, stream, ids, ts, keys):
    pacsv.write_csv(pa.table({"stream": np.where(stream == 0, "R", "S"), "id": ids, "ts": ts, "key": keys}), path)


def make_input(rng, n, keys, disorder):
    ts = np.sort(rng.random(n) * n / 3000) - rng.random(n) * disorder
    return rng.integers(0, 2, n), np.arange(n), ts, rng.integers(0, keys, n)


def start(module: str, *args) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", module, *map(str, args)],
        env=mpi_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen, timeout: float = 60) -> dict:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode in (0, 1), err
    return json.loads(out.strip().splitlines()[-1])


def stream_settings(ingest: int, results: int, **more) -> dict:
    # the cluster takes the input at 6,000 tuples/s: producers may have sent all of it before every slave has
    # loaded its kernels, and the stream must still span many epochs and punctuations
    return {
        "source.kind": "zmq",
        "source.endpoint": f"tcp://127.0.0.1:{ingest}",
        "source.idle_timeout": 60.0,
        "source.rate": 6000.0,
        "output.zmq_endpoint": f"tcp://127.0.0.1:{results}",
        "output.wait_subscribers": 1,
        "epochs.distribution": 0.1,
        **more,
    }


def check_stream(sub: dict, table: pa.Table, expected: np.ndarray, ordered: bool, merged: bool = False) -> None:
    """The subscriber's view: monotone punctuations, nothing after a punctuation covering it, all results.
    `merged`: the subscriber put several dispatchers' streams in order itself, so rows are not in arrival order."""
    assert sub["ended"] and sub["gaps"] == 0 and sub["non_monotone"] == 0 and sub["punctuations"] > 2
    later = np.maximum(table["r_ts"].to_numpy(), table["s_ts"].to_numpy())
    before = table["punctuation_before"].to_numpy()
    assert (later >= before).all() and sub["covered"] == 0
    assert merged or (before[1:] >= before[:-1]).all()
    if ordered:
        assert (np.diff(later) >= 0).all(), "ordered mode published results out of ts order"
    np.testing.assert_array_equal(encode_pairs(table["r_id"].to_numpy(), table["s_id"].to_numpy()), expected)


def test_zmq_ingest_with_random_send_delays_equals_the_reference(tmp_path):
    # one producer pausing randomly between 400-tuple messages; out-of-order input with late tuples
    rng = np.random.default_rng(41)
    stream, ids, ts, keys = make_input(rng, 9000, 300, disorder=0.4)
    write_input(tmp_path / "in.csv", stream, ids, ts, keys)
    ingest, results = free_port(), free_port()
    sub = start(
        "control.subscribe",
        "--endpoint",
        f"tcp://127.0.0.1:{results}",
        "--out",
        tmp_path / "sub.parquet",
        "--progress",
        0,
    )
    prod = start(
        "control.produce",
        tmp_path / "in.csv",
        "--endpoint",
        f"tcp://127.0.0.1:{ingest}",
        "--batch",
        400,
        "--jitter",
        0.05,
        "--seed",
        41,
    )
    run = run_cluster(
        tmp_path,
        3,
        stream_settings(
            ingest, results, **{"join.window": 0.3, "join.max_delay": 0.2, "output.result_chunk_rows": 100}
        ),
    )
    assert run.returncode == 0, run.stderr
    sent, got = finish(prod), finish(sub)
    assert sent["tuples_sent"] == 9000
    expected, expected_late = reference_pairs(stream, ids, ts, keys, 0.3, 0.2)
    assert len(expected_late) > 0 and len(expected) > 1000
    np.testing.assert_array_equal(run.pairs(), expected)
    np.testing.assert_array_equal(run.late_ids(), expected_late)
    s = run.summary
    assert s["input_total"] + s["late"] == 9000 and s["rejected"] == 0
    assert s["zmq_ingest"]["messages"] == 9000 // 400 + 2 and s["result_stream"]["results"] == len(expected)
    assert s["result_chunks"]["chunked_batches"] > 0
    # the producer sends for about 0.6 s; ingest starts once every slave is ready (protocol.mpi.wait_all_started),
    # which on a loaded machine can be later: then all of it arrives in one batch per slave (2 punctuations)
    check_stream(got, pq.read_table(tmp_path / "sub.parquet"), expected, ordered=False)


def test_ordered_stream_from_two_producers(tmp_path):
    # two producers interleave at random; max_delay covers the whole input so no tuple is late either way
    rng = np.random.default_rng(42)
    stream, ids, ts, keys = make_input(rng, 8000, 200, disorder=0.3)
    for k in range(2):
        write_input(tmp_path / f"in{k}.csv", stream[k::2], ids[k::2], ts[k::2], keys[k::2])
    ingest, results = free_port(), free_port()
    sub = start(
        "control.subscribe",
        "--endpoint",
        f"tcp://127.0.0.1:{results}",
        "--out",
        tmp_path / "sub.parquet",
        "--progress",
        0,
    )
    prods = [
        start(
            "control.produce",
            tmp_path / f"in{k}.csv",
            "--endpoint",
            f"tcp://127.0.0.1:{ingest}",
            "--batch",
            300,
            "--jitter",
            0.04,
            "--seed",
            k,
            "--sender",
            k,
        )
        for k in range(2)
    ]
    # results in chunks of 40 rows: a batch is done for the punctuation only with its last chunk
    settings = stream_settings(
        ingest,
        results,
        **{
            "source.producers": 2,
            "output.ordered": True,
            "join.window": 0.2,
            "join.max_delay": 5.0,
            "output.result_chunk_rows": 40,
        },
    )
    run = run_cluster(tmp_path, 4, settings)
    assert run.returncode == 0, run.stderr
    assert sum(finish(p)["tuples_sent"] for p in prods) == 8000
    expected, _ = reference_pairs(stream, ids, ts, keys, 0.2, 5.0)
    np.testing.assert_array_equal(run.pairs(), expected)
    assert run.summary["late"] == 0 and run.summary["zmq_ingest"]["producers_ended"] == 2
    assert run.summary["result_chunks"]["chunked_batches"] > 0
    check_stream(finish(sub), pq.read_table(tmp_path / "sub.parquet"), expected, ordered=True)


def test_producer_faster_than_the_cluster_is_held_back_and_nothing_is_lost(tmp_path):
    # mini-buffers of 1,500 tuples, messages of 1,000: ingest pauses, the producer's sends block
    rng = np.random.default_rng(43)
    n = 30000
    stream, ids, ts, keys = make_input(rng, n, 2000, disorder=0.05)
    write_input(tmp_path / "in.csv", stream, ids, ts, keys)
    ingest = free_port()
    prod = start("control.produce", tmp_path / "in.csv", "--endpoint", f"tcp://127.0.0.1:{ingest}", "--batch", 1000)
    settings = {
        "source.kind": "zmq",
        "source.endpoint": f"tcp://127.0.0.1:{ingest}",
        "source.idle_timeout": 60.0,
        "source.max_message_tuples": 1000,
        "master.buffer_capacity": 1500,
        "epochs.distribution": 0.1,
        "join.window": 0.1,
        "join.max_delay": 0.1,
    }
    run = run_cluster(tmp_path, 3, settings)
    assert run.returncode == 0, run.stderr
    sent = finish(prod)
    s = run.summary
    assert s["buffered_peak"] <= 1500 and s["zmq_ingest"]["held_peak_tuples"] <= 1000
    assert sent["blocked_seconds"] > 0 and s["zmq_ingest"]["producers_blocked_seconds"] == sent["blocked_seconds"]
    expected, expected_late = reference_pairs(stream, ids, ts, keys, 0.1, 0.1)
    np.testing.assert_array_equal(run.pairs(), expected)
    assert s["input_total"] + s["late"] == n and s["late"] == len(expected_late)


def test_ordered_stream_stays_correct_while_partition_groups_move(tmp_path):
    # the balancing churn of tests/cluster/test_balance_cluster.py: held tuples of moving groups reach their new slave
    # after it has seen later watermarks; the punctuation must still never pass a result still to come
    results = free_port()
    sub = start(
        "control.subscribe",
        "--endpoint",
        f"tcp://127.0.0.1:{results}",
        "--out",
        tmp_path / "sub.parquet",
        "--progress",
        0,
    )
    settings = dict(
        SMALL,
        **FORCED_CHURN,
        **{
            "generator.duration": 3.0,
            "generator.rate": 12000.0,
            "generator.disorder": 0.2,
            "generator.seed": 34,
            "output.zmq_endpoint": f"tcp://127.0.0.1:{results}",
            "output.ordered": True,
            "output.wait_subscribers": 1,
        },
    )
    run, expected = check_exact(tmp_path, 5, settings, env=straggler(1))
    assert len(run.summary["balance"]["moves"]) >= 1
    check_stream(finish(sub), pq.read_table(tmp_path / "sub.parquet"), expected, ordered=True)


def test_two_dispatchers_publish_one_ordered_stream(tmp_path):
    # each dispatcher publishes its own batches' results on its own socket and punctuates for its share; the
    # subscriber takes the min punctuation and merges: one stream in order of the later ts, every result once
    results = free_port(consecutive=2)
    sub = start(
        "control.subscribe",
        "--endpoint",
        f"tcp://127.0.0.1:{results}",
        "--dispatchers",
        2,
        "--ordered",
        "--out",
        tmp_path / "sub.parquet",
        "--progress",
        0,
    )
    settings = dict(
        SMALL,
        **{
            "cluster.dispatchers": 2,
            "generator.disorder": 0.25,
            "generator.seed": 36,
            "source.rate": 8000.0,
            "output.zmq_endpoint": f"tcp://127.0.0.1:{results}",
            "output.ordered": True,
            "output.wait_subscribers": 1,
        },
    )
    run, expected = check_exact(tmp_path, 5, settings, env={"STREAMJOIN_JITTER": "0.01"})
    stream = run.summary["result_stream"]
    assert len(stream["endpoints"]) == 2 and stream["results"] == len(expected)
    check_stream(finish(sub), pq.read_table(tmp_path / "sub.parquet"), expected, ordered=True, merged=True)


def test_a_frame_above_the_largest_valid_message_is_refused_unread(tmp_path):
    """A 400 MiB frame (ZeroMQ sends the zero pages of a calloc'ed buffer: it costs this test no memory) before
    a producer's input: the master never holds it (ZMQ_MAXMSGSIZE), and the input is joined exactly."""
    rng = np.random.default_rng(11)
    stream, ids, ts, keys = make_input(rng, 3000, 256, 0.0)
    write_input(tmp_path / "in.csv", stream, ids, ts, keys)
    ingest = free_port()
    settings = {
        "source.kind": "zmq",
        "source.endpoint": f"tcp://127.0.0.1:{ingest}",
        "source.idle_timeout": 60.0,
        "join.window": 0.5,
        "join.max_delay": 0.5,
    }
    huge = np.zeros(400 << 20, dtype=np.uint8)

    def rogue():
        ctx = zmq.Context()
        sock = ctx.socket(zmq.PUSH)
        sock.immediate, sock.linger = True, 30000
        sock.connect(f"tcp://127.0.0.1:{ingest}")
        sock.send_multipart([b"\0" * 32, huge], copy=False)
        sock.close()
        ctx.term()  # returns when the frame has been sent (or refused)
        start("control.produce", tmp_path / "in.csv", "--endpoint", f"tcp://127.0.0.1:{ingest}").communicate()

    sender = threading.Thread(target=rogue, daemon=True)
    sender.start()
    run = run_cluster(tmp_path, 3, settings, timeout=180)
    assert run.returncode == 0, run.stderr
    expected, _ = reference_pairs(stream, ids, ts, keys, 0.5, 0.5)
    np.testing.assert_array_equal(run.pairs(), expected)
    assert run.summary["master_peak_rss_bytes"] < 400 << 20, run.summary["master_peak_rss_bytes"]


def test_a_slow_subscriber_at_the_end_of_a_run_does_not_crash_the_master(tmp_path):
    """Results still on their way to a slow subscriber when the master exits: it used to free their buffers
    under ZeroMQ's I/O thread ("Bad address (src/tcp.cpp:227)", SIGABRT, exit 134 after a complete run)."""
    many = dict(
        SMALL,
        **{
            "generator.keys": 32,
            "join.window": 2.0,
            "output.flush_rows": 200000,
            "source.rate": 6000.0,
            "output.wait_subscribers": 1,
        },
    )
    for attempt in range(1):  # it struck two runs in three; results are copied to ZeroMQ now, so one run guards it
        port = free_port()
        done = threading.Event()

        def read():  # the socket lives and dies in this thread (ZeroMQ sockets are not thread-safe)
            ctx = zmq.Context()
            slow = ctx.socket(zmq.SUB)
            slow.rcvhwm, slow.rcvbuf, slow.linger = 4, 64 * 1024, 0
            slow.subscribe(b"")
            slow.connect(f"tcp://127.0.0.1:{port}")
            while not done.is_set():
                if slow.poll(100):
                    slow.recv_multipart()
                    time.sleep(0.02)
            slow.close()
            ctx.term()

        reader = threading.Thread(target=read)
        reader.start()
        try:
            run = run_cluster(
                tmp_path / str(attempt),
                3,
                dict(many, **{"output.zmq_endpoint": f"tcp://127.0.0.1:{port}"}),
                timeout=180,
            )
        finally:
            done.set()
            reader.join()
        assert run.returncode == 0, run.stderr[-2000:]
        assert run.summary["result_stream"]["results"] == run.summary["results"] > 1_000_000


def test_a_strangers_end_does_not_end_the_input_and_is_counted(tmp_path):
    """source.token_file: a local process without the token (or with a wrong one) sends END and tuples first;
    the master refuses them (summary, metrics, one line) and joins every tuple of the real producer exactly.
    The token appears nowhere in the output or the logs."""
    token = "tok-" + "7f3a9c" * 4
    (tmp_path / "token").write_text(token + "\n")
    rng = np.random.default_rng(23)
    stream, ids, ts, keys = make_input(rng, 3000, 256, disorder=0.0)
    write_input(tmp_path / "in.csv", stream, ids, ts, keys)
    ingest = free_port()
    settings = {
        "source.kind": "zmq",
        "source.endpoint": f"tcp://127.0.0.1:{ingest}",
        "source.idle_timeout": 60.0,
        "source.token_file": str(tmp_path / "token"),
        "join.window": 0.5,
        "join.max_delay": 0.5,
    }
    produced = {}

    def stranger_then_producer():
        ctx = zmq.Context()
        sock = ctx.socket(zmq.PUSH)
        sock.immediate, sock.linger = True, 30000
        sock.connect(f"tcp://127.0.0.1:{ingest}")
        guess = wire.origin("feed", wire.token_digest("guess"))
        sock.send_multipart(wire.encode_end(0.0))  # today's anonymous END
        sock.send_multipart(wire.encode_end(0.0, origin_frame=guess))
        sock.send_multipart(wire.encode_tuples([0], [10**9], [0], [1], [0.0], origin_frame=guess))
        sock.close()
        ctx.term()  # returns when the three are sent
        produced.update(
            finish(
                start(
                    "control.produce",
                    tmp_path / "in.csv",
                    "--endpoint",
                    f"tcp://127.0.0.1:{ingest}",
                    "--token-file",
                    tmp_path / "token",
                    "--name",
                    "feed",
                    "--batch",
                    500,
                )
            )
        )

    sender = threading.Thread(target=stranger_then_producer, daemon=True)
    sender.start()
    run = run_cluster(tmp_path, 3, settings, timeout=120)
    sender.join(30)
    assert run.returncode == 0, run.stderr
    expected, _ = reference_pairs(stream, ids, ts, keys, 0.5, 0.5)
    np.testing.assert_array_equal(run.pairs(), expected)
    z = run.summary["zmq_ingest"]
    assert produced["tuples_sent"] == 3000 and z["producers"] == {"feed": 3000} and z["producers_ended"] == 1
    assert z["refused_messages"] == {"end": 2, "tuples": 1} and z["refused_tuples"] == 1
    assert "refused an END message from an anonymous producer" in run.stderr
    assert 'streamjoin_refused_messages_total{kind="end"} 2.0' in (run.out / "metrics.prom").read_text()
    assert run.summary["config"]["source"]["token_file"] == str(tmp_path / "token")
    on_disk = "".join(
        f.read_text(errors="replace") for f in run.out.rglob("*") if f.is_file() and f.suffix != ".parquet"
    )
    assert token not in run.stderr and token not in on_disk


#: a paced run of many results: 3 s of 6,000 tuples/s on 32 keys, window 1 s (about 2.9M results, 210 MB)
MANY_RESULTS = dict(
    SMALL,
    **{
        "generator.duration": 3.0,
        "generator.keys": 32,
        "join.window": 1.0,
        "source.rate": 6000.0,
        "output.wait_subscribers": 1,
    },
)


def test_a_subscriber_that_stops_reading_costs_the_master_its_byte_bound_and_is_counted(tmp_path):
    """The old stream queued every result for a subscriber that stops reading (the master's RSS grew by the
    results' bytes, 210 MB here); now at most output.subscriber_buffer_bytes, the rest is dropped for it and
    the gap counted.  A second subscriber stops for a second and then reads on: it sees gaps in seq."""
    port = free_port()
    done, seqs = threading.Event(), []

    def subscriber(pause: float | None):  # pause None: never reads during the run
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.rcvhwm, sub.rcvbuf, sub.linger = 1, 64 * 1024, 0
        sub.subscribe(b"")
        sub.connect(f"tcp://127.0.0.1:{port}")
        if pause is None:
            done.wait()
        else:
            while not sub.poll(100) and not done.is_set():
                pass
            time.sleep(pause)  # results are flowing: stop reading for a while
            while not done.is_set() or sub.poll(100):
                if sub.poll(100):
                    seqs.append(int(np.frombuffer(sub.recv_multipart()[0], wire.HEADER)["seq"][0]))
        sub.close()
        ctx.term()

    readers = [threading.Thread(target=subscriber, args=(pause,), daemon=True) for pause in (None, 1.0)]
    for reader in readers:
        reader.start()
    try:
        run = run_cluster(
            tmp_path,
            3,
            dict(
                MANY_RESULTS,
                **{
                    "output.zmq_endpoint": f"tcp://127.0.0.1:{port}",
                    "output.wait_subscribers": 2,
                    "output.subscriber_buffer_bytes": 4 << 20,
                },
            ),
        )
    finally:
        done.set()
        for reader in readers:
            reader.join(timeout=30)
    assert run.returncode == 0, run.stderr[-2000:]
    s, stream = run.summary, run.summary["result_stream"]
    assert stream["results"] == s["results"] > 2_500_000
    # unordered, the stream holds no result for a full subscriber: it drops the message for it (XPUB queues at
    # most the byte bound per subscriber); the old stream held every result (210 MB here)
    assert stream["held_peak_bytes"] == 0, stream
    # the master's growth from its memory before data: about 190 MiB on a quiet host (its libraries' pages count
    # for more when their files are fresh in the page cache); a loaded host's master holds more batches and MPI
    # messages in flight (312 MiB with a CPU hog beside the suite): a guard against a leak, not the bound
    grown = s["master_peak_rss_bytes"] - s["startup"]["pss_before_data_bytes"]["0"]
    assert grown < 512 << 20, (grown, s["master_peak_rss_bytes"], s["startup"])
    assert "it misses messages until it has read half of them" in run.stderr
    # the one that paused: the start of the run, then jumps in seq past what was dropped for it (one lossy send
    # may open a gap for both subscribers at once)
    seen = int((np.diff(seqs) > 1).sum())
    assert seqs[0] == 0 and 1 <= seen <= stream["gaps"], (seen, stream)
    assert stream["gaps_by_reason"] == {"subscriber_full": stream["gaps"]}
    metrics = (tmp_path / "out" / "metrics.prom").read_text()
    assert f'streamjoin_result_stream_gaps_total{{reason="subscriber_full"}} {float(stream["gaps"])}' in metrics


def test_ordered_stream_waits_for_a_paused_subscriber_with_bounded_memory_and_stays_exact(tmp_path):
    """Ordered: the subscriber stops (SIGSTOP) for 3 s mid-run; the master keeps at most about
    output.subscriber_buffer_bytes of results, pauses ingest meanwhile, and the subscriber gets every result,
    in order, as the reference join has them."""
    port = free_port()
    sub = start(
        "control.subscribe",
        "--endpoint",
        f"tcp://127.0.0.1:{port}",
        "--out",
        tmp_path / "sub.parquet",
        "--progress",
        0.1,
    )
    paused = []

    def pause_once_results_flow():
        for line in sub.stderr:
            if line.startswith("results ") and not line.startswith("results 0 "):
                sub.send_signal(signal.SIGSTOP)
                time.sleep(3.0)
                sub.send_signal(signal.SIGCONT)
                paused.append(line)
                return

    pauser = threading.Thread(target=pause_once_results_flow, daemon=True)
    pauser.start()
    settings = dict(
        MANY_RESULTS,
        **{
            "generator.keys": 256,
            "generator.seed": 5,
            "output.ordered": True,
            "join.max_delay": 0.05,
            "epochs.distribution": 0.1,
            "output.zmq_endpoint": f"tcp://127.0.0.1:{port}",
            "output.subscriber_buffer_bytes": 4 << 20,
            "output.subscriber_timeout": 60.0,
        },
    )
    try:
        run, expected = check_exact(tmp_path, 3, settings)
    finally:
        sub.send_signal(signal.SIGCONT)
    pauser.join(timeout=10)
    assert paused, "the subscriber never saw results"
    stream = run.summary["result_stream"]
    assert stream["gaps"] == 0 and stream["results"] == len(expected) > 300_000
    assert stream["ingest_held_seconds"] > 1.0  # the pause reached ingest
    # the bound, plus one result message (1/8 of it) and what the estimate of results per tuple (with its
    # headroom) misses; the results of join.max_delay of input (about 0.3 MB here) wait for more input whatever
    # the bound.  4.19 MB on a quiet host (6.4 MB before the flow control of results; 3.25 and 4.05 bounds with
    # two CPU hogs beside the suite, whose slaves missed slots); the first stream queued every result (40 MB)
    assert stream["held_peak_bytes"] <= 1.5 * (4 << 20), stream["held_peak_bytes"]
    check_stream(finish(sub), pq.read_table(tmp_path / "sub.parquet"), expected, ordered=True)


def test_a_stalled_ordered_subscriber_holds_the_slaves_results_back_in_bounded_memory(tmp_path):
    """Ordered, unpaced, 3.8M results (270 MB): the subscriber reads 50 messages, then stops until the master
    says (its progress line) that results wait for it with ingest paused, then reads on.  Ingest lets in only
    what fits the bound, and the slaves' result messages wait for the master to take them
    (master.result_stream, slave.results_out): while the subscriber is behind the held and waiting results stay
    within the bound plus what the estimate of results per tuple missed (below one bound here), and the
    master's RSS (sampled with psutil) grows by at most 96 MiB + 10 bounds (its libraries' pages as they are
    touched, the held and waiting results, the XPUB queue, their sorting's copies: about 110 MiB here).
    Before, the master took every result message: its RSS grew by 650 MiB and more, and with the subscriber
    stopped the job lost its slaves.  The subscriber still gets every result, in order."""
    port, bound = free_port(), 16 << 20
    settings = {
        "generator.duration": 6.0,
        "generator.rate": 3000.0,
        "generator.keys": 64,
        "generator.seed": 3,
        "join.window": 1.0,
        "join.max_delay": 0.05,
        "epochs.distribution": 0.1,
        "output.progress": 0.2,
        "output.zmq_endpoint": f"tcp://127.0.0.1:{port}",
        "output.ordered": True,
        "output.wait_subscribers": 1,
        "output.subscriber_buffer_bytes": bound,
        "output.subscriber_timeout": 600.0,
    }
    expected, _, _ = reference_for(settings)
    holding, done = threading.Event(), threading.Event()
    got: dict = {"rows": [], "punctuations": [], "seqs": [], "ended": False}
    lines: list[str] = []
    rss: list[int] = []

    def subscriber():
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.rcvhwm, sub.rcvbuf, sub.linger = 16, 64 * 1024, 0
        sub.subscribe(b"")
        sub.connect(f"tcp://127.0.0.1:{port}")
        while not done.is_set() or sub.poll(100):
            if not sub.poll(100):
                continue
            msg = wire.decode(sub.recv_multipart(), tuple(wire.Frame), 1 << 40)
            got["seqs"].append(msg.seq)
            if len(got["seqs"]) == 50:
                holding.wait(300)  # stopped: until the master says it waits for it with ingest paused
            if msg.kind == wire.Frame.RESULTS:
                got["rows"].append((msg.rows.copy(), got["punctuations"][-1] if got["punctuations"] else -np.inf))
            elif msg.kind == wire.Frame.PUNCT:
                got["punctuations"].append(msg.punctuation)
            elif msg.kind == wire.Frame.END:
                got["ended"] = True
                break
        sub.close()
        ctx.term()

    def sample_master_rss():
        master = None
        while not done.is_set():
            if master is None:
                for p in psutil.process_iter(["cmdline", "environ"]):
                    cmdline, env = " ".join(p.info["cmdline"] or []), p.info["environ"] or {}
                    if str(tmp_path) in cmdline and "master" in cmdline and env.get("OMPI_COMM_WORLD_RANK") == "0":
                        master = p
            else:
                try:
                    rss.append(master.memory_info().rss)
                except psutil.Error:
                    return
            time.sleep(0.05)

    threads = [threading.Thread(target=f, daemon=True) for f in (subscriber, sample_master_rss)]
    for thread in threads:
        thread.start()
    cmd = mpirun_command(3, ["--config", str(write_config(tmp_path, settings))])
    proc = subprocess.Popen(cmd, env=mpi_env(), stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stderr:
            lines.append(line)
            if "results wait for a subscriber behind" in line and "ingest paused" in line:
                holding.set()
        proc.wait(timeout=300)
    finally:
        proc.kill()
        holding.set()
        done.set()
        for thread in threads:
            thread.join(timeout=60)
    run = Run(tmp_path / "out", subprocess.CompletedProcess(cmd, proc.returncode, "", "".join(lines)))
    assert run.returncode == 0, run.stderr[-3000:]
    stream = run.summary["result_stream"]
    assert stream["gaps"] == 0 and stream["ingest_held_seconds"] > 0, stream
    # the bound, plus what the estimate of results per tuple misses while the windows fill (below one bound),
    # plus one result message (1/8 of it); the progress lines while the subscriber was behind say as much
    held = [float(line.split("behind: ")[1].split(" of")[0]) for line in lines if "subscriber behind: " in line]
    assert held and stream["held_peak_bytes"] <= 2 * bound and max(held) <= 2 * bound / 2**20, (held, stream)
    grown = max(rss) - run.summary["startup"]["pss_before_data_bytes"]["0"]
    assert len(rss) > 10 and grown <= (96 << 20) + 10 * bound, (grown / 2**20, max(rss) / 2**20)
    # exact, in order, punctuated: every result once, none after a punctuation that covers it
    assert got["ended"] and np.all(np.diff(got["seqs"]) == 1)
    rows = np.concatenate([r for r, _ in got["rows"]])
    before = np.concatenate([np.full(len(r), p) for r, p in got["rows"]])
    later = np.maximum(rows["r_ts"], rows["s_ts"])
    assert (np.diff(later) >= 0).all() and (later >= before).all()
    np.testing.assert_array_equal(np.sort(encode_pairs(rows["r_id"], rows["s_id"])), expected)
    assert run.summary["results"] == len(expected) > 3_000_000
