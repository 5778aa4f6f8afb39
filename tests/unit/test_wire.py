"""protocol/wire.py: the ZeroMQ frame format, its validation, and a seeded fuzz of the decoder."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from protocol import wire

ACCEPT = (wire.Frame.TUPLES, wire.Frame.END)


def good(rng, n=None, first_id=0):
    n = int(rng.integers(1, 200)) if n is None else n
    stream = rng.integers(0, 2, n)
    return wire.encode_tuples(
        stream, first_id + np.arange(n), rng.integers(0, 10_000_000, n), rng.integers(0, 50, n), rng.random(n)
    )


def test_round_trip_keeps_every_column():
    rng = np.random.default_rng(1)
    stream, ids, keys, values = rng.integers(0, 2, 50), np.arange(50) * 7, rng.integers(-9, 9, 50), rng.random(50)
    ts = rng.integers(-(2**61) + 1, 2**61, 50)  # microseconds: the whole valid range
    msg = wire.decode(wire.encode_tuples(stream, ids, ts, keys, values, sender=3, seq=9), ACCEPT, 100)
    assert isinstance(msg, wire.Message) and msg.kind == wire.Frame.TUPLES and (msg.sender, msg.seq) == (3, 9)
    for name, col in zip(("stream", "id", "ts", "key", "value"), (stream, ids, ts, keys, values)):
        np.testing.assert_array_equal(msg.rows[name], col)
    end = wire.decode(wire.encode_end(2.5, sender=3), ACCEPT, 100)
    assert end.kind == wire.Frame.END and end.blocked == 2.5 and end.rows is None
    assert wire.HEADER.itemsize == 64 and wire.TUPLE_RECORD.itemsize == 33
    assert msg.origin is None and end.origin is None  # anonymous


def test_origin_frame_names_the_producer_its_token_run_and_position():
    digest = wire.token_digest("s3cret")
    o = wire.origin("feed-7", digest, run=12, offset=4000)
    msg = wire.decode(wire.encode_tuples([0, 1], [1, 2], [5, 6], [0, 0], [0.0, 0.0], seq=3, origin_frame=o), ACCEPT, 9)
    end = wire.decode(wire.encode_end(0.5, seq=4, origin_frame=o), ACCEPT, 9)
    for m in (msg, end):
        assert bytes(m.origin["producer"]) == b"feed-7" and m.origin["token"].tobytes() == digest
        assert (int(m.origin["run"]), int(m.origin["offset"])) == (12, 4000)
    assert len(msg.rows) == 2 and wire.ORIGIN.itemsize == 112 and wire.token_digest("") == bytes(32)
    with pytest.raises(ValueError, match="producer id"):
        wire.origin("x" * 65, digest)


def rows_of(frames):
    return np.frombuffer(frames[1], dtype=wire.TUPLE_RECORD).copy()


def with_rows(frames, rows):
    return [frames[0], rows.tobytes()]


def with_header(frames, **fields):
    h = np.frombuffer(frames[0], dtype=wire.HEADER).copy()
    for k, v in fields.items():
        h[k] = v
    return [h.tobytes(), *frames[1:]]


def mutations(rng, frames):
    """(reason, bad frames) for each way a message can be wrong."""
    rows = rows_of(frames)
    n = len(rows)
    out = [
        ("frames", []),
        ("frames", frames[:1]),
        ("origin", frames + [b"x"]),
        ("frames", [frames[0], wire.origin("p", bytes(32)), frames[1], b"x"]),
        ("header", [frames[0][: int(rng.integers(0, 32))], frames[1]]),
        ("header", [frames[0] + b"\0", frames[1]]),
        ("magic", with_header(frames, magic=b"XXXX")),
        ("version", with_header(frames, version=int(rng.choice([1, int(rng.integers(3, 60000))])))),
        ("kind", with_header(frames, kind=wire.Frame.RESULTS)),
        ("kind", with_header(frames, kind=int(rng.integers(5, 60000)))),
        ("too_large", with_header(frames, count=1000 + n)),
        ("size", [frames[0], frames[1][: int(rng.integers(0, len(frames[1])))]]),
        ("size", [frames[0], frames[1] + bytes(int(rng.integers(1, 40)))]),
        ("frames", with_header(wire.encode_end(0.0), count=3)),
    ]
    bad = rows.copy()
    bad["stream"][rng.integers(0, n)] = rng.choice([2, 3, -1, 127])
    out.append(("stream", with_rows(frames, bad)))
    bad = rows.copy()
    bad["ts"][rng.integers(0, n)] = rng.choice([2**61, -(2**61), np.iinfo(np.int64).min, np.iinfo(np.int64).max])
    out.append(("ts", with_rows(frames, bad)))
    if n > 1:
        bad = rows.copy()
        i, j = rng.choice(n, 2, replace=False)
        bad["id"][j], bad["stream"][j] = bad["id"][i], bad["stream"][i]
        out.append(("duplicate_id", with_rows(frames, bad)))
    return out


def test_every_bad_message_is_rejected_with_its_reason_and_good_ones_around_it_pass():
    # a bounded seeded loop (hypothesis is not installed): good, bad, good, ... for every kind of fault
    rng = np.random.default_rng(2024)
    seen = set()
    for round_ in range(150):
        frames = good(rng)
        for reason, bad in mutations(rng, frames):
            got = wire.decode(bad, ACCEPT, 1000)
            assert isinstance(got, wire.Rejection) and got.reason == reason, (round_, reason, got)
            assert got.reason in wire.REASONS
            seen.add(reason)
            ok = good(rng)
            msg = wire.decode(ok, ACCEPT, 1000)
            assert isinstance(msg, wire.Message) and len(msg.rows) == len(rows_of(ok))
    assert seen == set(wire.REASONS) - wire.BATCH_REASONS  # those: tests/cluster/test_live_streams.py


def test_random_bytes_and_truncations_never_crash_and_never_pass_invalid_rows():
    rng = np.random.default_rng(7)
    for _ in range(3000):
        frames = good(rng, n=int(rng.integers(0, 20)))
        choice = rng.integers(0, 4)
        if choice == 0:  # random frames
            frames = [rng.bytes(int(rng.integers(0, 80))) for _ in range(int(rng.integers(0, 4)))]
        elif choice == 1:  # flip random bytes anywhere
            blob = bytearray(b"".join(frames))
            for i in rng.integers(0, len(blob), int(rng.integers(1, 6))):
                blob[i] = int(rng.integers(0, 256))
            frames = [bytes(blob[:32]), bytes(blob[32:])]
        elif choice == 2:  # truncate the message anywhere
            blob = b"".join(frames)
            cut = int(rng.integers(0, len(blob)))
            frames = [blob[: min(cut, 32)], blob[32:cut]] if cut > 32 else [blob[:cut]]
        got = wire.decode(frames, ACCEPT, 1000)
        assert isinstance(got, (wire.Rejection, wire.Message))
        if isinstance(got, wire.Message) and got.rows is not None:
            r = got.rows
            assert np.isin(r["stream"], (0, 1)).all() and (np.abs(r["ts"]) < 2**61).all()
            pairs = np.stack([r["id"], r["stream"].astype(np.int64)], axis=1)
            assert len(np.unique(pairs, axis=0)) == len(r)


def test_results_buffer_unpack_including_an_empty_batch():
    rows = np.zeros(3, dtype=wire.RESULT_RECORD)
    rows["r_id"] = [1, 2, 3]
    for r, floor in ((rows, wire.MORE), (rows[:0], 0)):
        buf, body = wire.results_buffer(len(r), sender=4, seq=11, floor=floor)
        body[:] = r
        msg = wire.decode(wire.unpack(buf), (wire.Frame.RESULTS,), 10)
        assert isinstance(msg, wire.Message) and (msg.sender, msg.seq, msg.floor) == (4, 11, floor)
        np.testing.assert_array_equal(msg.rows, r)


def test_each_header_field_means_one_thing_in_every_kind():
    end = wire.decode(wire.encode_end(3.25, seq=5), tuple(wire.Frame), 10)
    punct = wire.decode(wire.encode_punct(-3.25, seq=6), tuple(wire.Frame), 10)
    ack = wire.decode(wire.encode_ack(77, np.zeros(0, wire.ACK_RECORD), True, sender=1), tuple(wire.Frame), 10)
    assert (end.kind, end.blocked, end.punctuation, end.seq) == (wire.Frame.END, 3.25, 0.0, 5)
    assert (punct.kind, punct.punctuation, punct.blocked, punct.seq) == (wire.Frame.PUNCT, -3.25, 0.0, 6)
    assert (ack.run, ack.final, ack.seq) == (77, True, 0)  # the run is not a message number
    offsets = [wire.HEADER.fields[n][1] for n in wire.HEADER.names]
    assert len(set(offsets)) == len(offsets)


def test_rows_of_other_join_types_travel_with_their_kind_and_stream_time():
    rows = np.zeros(2, dtype=wire.ROW_RECORD)
    rows["r_ts"], rows["s_ts"], rows["time"] = [1.0, 2.0], [3.0, np.nan], [3.0, 2.5]
    rows["kind"] = [wire.ROW_KINDS.index("matched"), wire.ROW_KINDS.index("left_unmatched")]
    msg = wire.decode(wire.encode_results(rows, seq=3), tuple(wire.Frame), 10)
    assert msg.kind == wire.Frame.ROWS and wire.ROW_RECORD.itemsize == 81
    np.testing.assert_array_equal(wire.stream_time(msg.rows), [3.0, 2.5])  # a lone row's own time, not its ts
    pair = np.zeros(1, wire.RESULT_RECORD)
    pair["r_ts"], pair["s_ts"] = 4.0, 1.5
    np.testing.assert_array_equal(wire.stream_time(pair), [4.0])  # a pair's: its later ts
    buf, body = wire.results_buffer(2, sender=1, seq=4, floor=0, record=wire.ROW_RECORD)
    body[:] = rows
    assert wire.decode(wire.unpack(buf), (wire.Frame.ROWS,), 10).kind == wire.Frame.ROWS
    held = [rows.copy()]
    np.testing.assert_array_equal(wire.take_due(held, 2.75)["r_ts"], [2.0])  # released by time 2.5, not ts 2.0


def test_a_table_of_declared_streams_travels_whole_and_is_released_in_stream_time_order():
    table = pa.table(
        {
            "views_user": ["u_1", None, "u_3"],
            "views_at": pa.array([5, 6, 7], pa.timestamp("us", "UTC")),
            "kind": ["matched", "right_unmatched", "left_unmatched"],
            "time": [3.0, 1.0, 2.0],
        }
    )
    msg = wire.decode(wire.encode_table(table, sender=2, seq=9), tuple(wire.Frame), 10)
    assert (msg.kind, msg.sender, msg.seq, msg.rows) == (wire.Frame.TABLE, 2, 9, None)
    assert wire.read_table(msg.arrow).equals(table)  # every column, its type and its nulls
    buf = wire.table_buffer(table, sender=1, seq=4, floor=12)  # a slave's, over MPI
    msg = wire.decode(wire.unpack(buf), (wire.Frame.TABLE,), 10)
    assert wire.read_table(msg.arrow).equals(table) and msg.floor == 12
    empty = wire.decode(wire.unpack(wire.table_buffer(pa.table({}), 1, 5, 0)), (wire.Frame.TABLE,), 10)
    assert wire.read_table(empty.arrow) is None
    held = [table.slice(0, 2), table.slice(2)]
    due = wire.take_due(held, 2.5)
    assert due["time"].to_pylist() == [1.0, 2.0] and due["views_user"].to_pylist() == [None, "u_3"]
    assert len(held) == 1 and held[0]["time"].to_pylist() == [3.0]


@pytest.mark.parametrize("micros", [0, -7, (1 << 53) + 1, (1 << 61) - 1, -(1 << 61) + 1, 1 << 62, -(1 << 62)])
def test_a_watermark_as_floor_is_read_back_exactly(micros):
    buf, _ = wire.results_buffer(0, sender=1, seq=2, floor=micros)
    msg = wire.decode(wire.unpack(buf), (wire.Frame.RESULTS,), 10)
    assert msg.floor == micros != wire.MORE
