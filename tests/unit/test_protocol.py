"""Tests of protocol/: messages, delay histograms, group_pairs, tuples."""

from __future__ import annotations

import subprocess
import sys
import math
import time

import numpy as np
import pyarrow as pa
import pytest

from protocol import delays
from protocol.arrays import group_pairs, whole_buffer
from protocol.messages import (
    GROUP_ROW,
    HEADER,
    HISTOGRAMS,
    REPORT,
    REPORT_BYTES,
    Kind,
    batch_groups,
    batch_message,
    decode_batch,
    decode_report,
    encode_batch,
    encode_order,
    encode_report,
    hot_key,
)
from protocol.eventtime import NEG_INF, NONE, POS_INF
from protocol.tuples import BASE_TUPLE_BYTES, directory_hash, mix64, partition_of, tuple_dtype


# --------------------------------------------------------------------------- messages


def random_rows(rng, dtype, n):
    rows = np.zeros(n, dtype=dtype)
    rows["id"] = rng.integers(-(2**62), 2**62, n)
    rows["ts"] = rng.integers(-(2**61) + 1, 2**61, n)
    rows["key"] = rng.integers(-(2**62), 2**62, n)
    rows["value"] = rng.normal(size=n)
    rows["arrival"] = rng.uniform(1.7e9, 1.8e9, n)
    if "pad" in dtype.names and n:
        raw = rows.view(np.uint8).reshape(n, dtype.itemsize)
        raw[:, BASE_TUPLE_BYTES:] = rng.integers(0, 256, (n, dtype.itemsize - BASE_TUPLE_BYTES), dtype=np.uint8)
        assert rows["pad"].tobytes() != bytes(len(rows["pad"].tobytes()))
    return rows


@pytest.mark.parametrize("tuple_bytes", [40, 64])
@pytest.mark.parametrize("n_r,n_s", [(0, 0), (0, 3), (5, 0), (1, 1), (37, 100)])
def test_batch_round_trip(tuple_bytes, n_r, n_s):
    rng = np.random.default_rng(n_r * 1000 + n_s + tuple_bytes)
    dt = tuple_dtype(tuple_bytes)
    r, s = random_rows(rng, dt, n_r), random_rows(rng, dt, n_s)
    before = time.time()
    buf = encode_batch(12345, -3_250_000, r, s)
    after = time.time()
    assert buf.dtype == np.uint8
    assert len(buf) == HEADER.itemsize + (n_r + n_s) * tuple_bytes
    head, r2, s2 = decode_batch(buf, dt)
    assert int(head["kind"]) == Kind.BATCH and Kind(int(head["kind"])) is Kind.BATCH
    assert int(head["seq"]) == 12345 and int(head["table_rows"]) == 0
    assert int(head["watermark"]) == -3_250_000
    assert before <= float(head["sent"]) <= after  # the master's send time: the delay decomposition
    assert (int(head["n_r"]), int(head["n_s"])) == (n_r, n_s)
    assert r2.dtype == dt and s2.dtype == dt
    assert len(r2) == n_r and len(s2) == n_s
    assert r2.tobytes() == r.tobytes() and s2.tobytes() == s.tobytes()  # bit-exact, padding included
    for f in ("id", "ts", "key", "value", "arrival"):
        np.testing.assert_array_equal(r2[f], r[f])
        np.testing.assert_array_equal(s2[f], s[f])


def test_a_batch_message_is_built_in_an_earlier_buffer_that_is_large_enough():
    rng = np.random.default_rng(5)
    dt = tuple_dtype(64)
    big = encode_batch(1, 0, random_rows(rng, dt, 300), random_rows(rng, dt, 200))
    r, s = random_rows(rng, dt, 40), random_rows(rng, dt, 70)
    buf, body_r, body_s = batch_message(2, 1_500_000, len(r), len(s), dt, spare=big)
    body_r[:], body_s[:] = r, s
    assert np.shares_memory(buf, big) and len(buf) == HEADER.itemsize + 110 * 64  # exact size, in the spare
    head, r2, s2 = decode_batch(buf, dt)
    assert int(head["seq"]) == 2 and r2.tobytes() == r.tobytes() and s2.tobytes() == s.tobytes()
    assert whole_buffer(buf) is big  # kept as the next spare: a later batch up to its size fits again
    larger, _, _ = batch_message(3, 2_000_000, 400, 200, dt, spare=whole_buffer(buf))
    assert not np.shares_memory(larger, big) and len(larger) == HEADER.itemsize + 600 * 64  # too small: fresh


def test_stop_message_with_infinite_watermark():
    dt = tuple_dtype(64)
    empty = np.empty(0, dtype=dt)
    buf = encode_order(Kind.STOP, 7, POS_INF)
    assert len(buf) == HEADER.itemsize
    head, r, s = decode_batch(buf, dt)
    assert int(head["kind"]) == Kind.STOP and head["watermark"] == POS_INF and int(head["seq"]) == 7
    assert len(r) == 0 and len(s) == 0
    for none in (NONE, NEG_INF):  # the other sentinels travel as they are
        assert decode_batch(encode_order(Kind.CHECKPOINT, 1, none, checkpoint=2), dt)[0]["watermark"] == none
    with pytest.raises(TypeError):  # seconds as a float would be truncated to whole microseconds unseen
        encode_batch(1, 2.5, empty, empty)


def test_decode_survives_a_copied_buffer():
    rng = np.random.default_rng(1)
    dt = tuple_dtype(48)
    r, s = random_rows(rng, dt, 4), random_rows(rng, dt, 6)
    raw = bytes(encode_batch(1, 500_000, r, s))  # as received off the wire
    head, r2, s2 = decode_batch(np.frombuffer(bytearray(raw), dtype=np.uint8), dt)
    assert r2.tobytes() == r.tobytes() and s2.tobytes() == s.tobytes()


@pytest.mark.parametrize("tuple_bytes", [40, 64])
def test_decode_rejects_truncated_and_oversized(tuple_bytes):
    rng = np.random.default_rng(2)
    dt = tuple_dtype(tuple_bytes)
    buf = encode_batch(3, 1_000_000, random_rows(rng, dt, 3), random_rows(rng, dt, 2))
    for cut in (0, 1, HEADER.itemsize - 1, HEADER.itemsize, HEADER.itemsize + 1, len(buf) - tuple_bytes, len(buf) - 1):
        with pytest.raises(ValueError, match="bytes"):
            decode_batch(buf[:cut], dt)
    with pytest.raises(ValueError, match="bytes"):
        decode_batch(np.concatenate([buf, np.zeros(tuple_bytes, np.uint8)]), dt)
    # decoding with the wrong tuple size is detected as well
    other = tuple_dtype(tuple_bytes + 8)
    with pytest.raises(ValueError, match="bytes"):
        decode_batch(buf, other)


def test_a_batch_carries_its_group_table_in_groups():
    rng = np.random.default_rng(6)
    dt = tuple_dtype(40)
    r, s = random_rows(rng, dt, 5), random_rows(rng, dt, 4)
    groups = np.array(
        [
            [3, 2, 1, -(2**63), 2**63 - 1, 2**63 - 1, -(2**63)],  # with each group each stream's span
            [9, 3, 3, -5, 40, -5, 40],
        ]
    )
    buf = encode_batch(17, 2_000_000, r, s, groups)
    assert len(buf) == HEADER.itemsize + 9 * 40 + groups.size * 8
    head, r2, s2 = decode_batch(buf, dt)
    assert (int(head["seq"]), int(head["table_rows"])) == (17, 2) and batch_groups(
        buf, head
    ).tolist() == groups.tolist()
    assert r2.tobytes() == r.tobytes() and s2.tobytes() == s.tobytes()
    assert (int(head["partition"]), int(head["peer"])) == (-1, -1)  # a batch names no partition-group, no peer
    with pytest.raises(ValueError, match="rows of 7 int64"):  # a row without its spans would shift every row after it
        encode_batch(17, 2_000_000, r, s, groups[:, :3])


def test_a_move_order_names_its_partition_group_its_peer_and_its_floor():
    head, r, s = decode_batch(encode_order(Kind.MOVE, 4, partition=11, peer=3, floor=1_250_000), tuple_dtype(64))
    assert Kind(int(head["kind"])) is Kind.MOVE and int(head["seq"]) == 4 and head["floor"] == 1_250_000
    assert head["watermark"] == NONE  # a floor is no punctuation
    assert (int(head["partition"]), int(head["peer"]), int(head["table_rows"])) == (11, 3, 0)
    assert len(r) == len(s) == 0


def test_a_checkpoint_order_names_its_checkpoint_id():
    buf = encode_order(Kind.CHECKPOINT, 8, checkpoint=42)
    assert len(buf) == HEADER.itemsize
    head, _, _ = decode_batch(buf, tuple_dtype(40))
    assert Kind(int(head["kind"])) is Kind.CHECKPOINT and int(head["seq"]) == 8 and int(head["checkpoint"]) == 42
    assert head["watermark"] == NONE and head["floor"] == NONE and int(head["peer"]) == int(head["partition"]) == -1


@pytest.mark.parametrize("kind", [Kind.SPLIT, Kind.MERGE])
def test_split_and_merge_orders_name_their_partition_group_and_hot_key(kind):
    buf = encode_order(kind, 6, partition=5, hot_key=(-(2**40), 128, 3))
    assert len(buf) == HEADER.itemsize + GROUP_ROW * 8
    head, _, _ = decode_batch(buf, tuple_dtype(40))
    assert Kind(int(head["kind"])) is kind and int(head["seq"]) == 6 and int(head["partition"]) == 5
    assert int(head["table_rows"]) == 1 and hot_key(buf, head) == (-(2**40), 128, 3)


def test_only_split_and_merge_carry_a_hot_key_and_a_batch_is_not_an_order():
    rng = np.random.default_rng(7)
    dt = tuple_dtype(40)
    batch = encode_batch(1, 0, random_rows(rng, dt, 1), random_rows(rng, dt, 1), np.array([[0, 1, 1, 0, 9, 0, 9]]))
    for buf in (batch, encode_order(Kind.MOVE, 1, partition=2, peer=1), encode_order(Kind.SPLIT, 1, partition=2)):
        with pytest.raises(ValueError, match="carries no hot key"):
            hot_key(buf, decode_batch(buf, dt)[0])
    with pytest.raises(ValueError, match="encode_batch"):
        encode_order(Kind.BATCH, 1)


def test_every_header_field_has_bytes_of_its_own():
    offsets = [HEADER.fields[name][1] for name in HEADER.names]
    assert len(set(offsets)) == len(offsets) and HEADER.itemsize == 8 * len(offsets)
    named = set(HEADER.names)
    assert {"seq", "checkpoint", "partition", "table_rows"} <= named and not {"epoch", "groups"} & named


def test_report_round_trip():
    rng = np.random.default_rng(3)
    counters = {
        f: float(rng.random()) if REPORT[f].kind == "f" else int(rng.integers(0, 2**62))  # beyond 2**53
        for f in REPORT.names
    }
    counters["busy"] = 0.123456789
    counters["delay_max"] = 1e-7
    hist = rng.integers(0, 2**32, (HISTOGRAMS, delays.BINS))
    hist[0, 0] = 2**32 - 1  # the most one bin of one batch carries
    buf = encode_report(counters, hist)
    assert buf.dtype == np.uint8 and len(buf) == REPORT_BYTES <= 4096  # Open MPI's shared-memory eager limit
    c2, h2 = decode_report(buf)
    assert c2 == counters and all(type(c2[f]) is type(counters[f]) for f in counters)
    assert list(c2) == list(REPORT.names)
    assert h2.dtype == np.int64
    np.testing.assert_array_equal(h2, hist)


def test_report_refuses_a_bin_it_cannot_carry():
    hist = np.zeros((HISTOGRAMS, delays.BINS), dtype=np.int64)
    hist[1, 3] = 2**32
    with pytest.raises(OverflowError, match="more than a report carries"):
        encode_report({}, hist)


def test_report_missing_counters_are_zero_and_an_unknown_one_is_refused():
    hist = np.zeros((HISTOGRAMS, delays.BINS), dtype=np.int64)
    hist[0, 5], hist[2, 7] = 3, 4
    c, h = decode_report(encode_report({"seq": 4, "results": 17}, hist))
    assert c["seq"] == 4 and c["results"] == 17
    assert all(c[f] == 0 for f in REPORT.names if f not in ("seq", "results"))
    np.testing.assert_array_equal(h, hist)
    with pytest.raises(ValueError, match="bogus"):
        encode_report({"bogus": 1}, hist)


# --------------------------------------------------------------------------- delays


def test_histogram_bins():
    assert delays.BINS == len(delays.EDGES) + 1
    d = np.array([0.0, 1e-7, 1e-6, 1e-3, 0.5, 1e4, 1e5])
    h = delays.histogram(d)
    assert h.dtype == np.int64 and len(h) == delays.BINS and h.sum() == len(d)
    assert h[0] == 2  # underflow: below 1 us
    assert h[-1] == 2  # overflow: 1e4 and above
    for x in (1e-3, 0.5):
        b = int(np.searchsorted(delays.EDGES, x, side="right"))
        assert delays.EDGES[b - 1] <= x < delays.EDGES[b] and h[b] >= 1
    np.testing.assert_array_equal(delays.histogram(np.empty(0)), np.zeros(delays.BINS, np.int64))


def test_decomposition_parts_add_up_to_the_delay():
    rng = np.random.default_rng(5)
    arrival = 100.0 + rng.uniform(0, 0.5, 1000)
    sent, started, produced = 100.6, 100.65, 100.95
    parts = delays.decomposition(arrival, sent, started, produced)
    assert parts.shape == (len(delays.PARTS), delays.BINS) and (parts.sum(axis=1) == len(arrival)).all()
    np.testing.assert_array_equal(parts[0], delays.histogram(sent - arrival))
    (transfer,), (join,) = np.flatnonzero(parts[1]), np.flatnonzero(parts[2])  # one value each, all results
    assert delays.EDGES[transfer - 1] <= started - sent < delays.EDGES[transfer]
    assert delays.EDGES[join - 1] <= produced - started < delays.EDGES[join]
    # per-result production times (an array) are binned one by one
    produced_each = started + np.linspace(0.01, 0.3, len(arrival))
    np.testing.assert_array_equal(
        delays.decomposition(arrival, sent, started, produced_each)[2], delays.histogram(produced_each - started)
    )


def test_histograms_merge_by_addition():
    rng = np.random.default_rng(4)
    a, b = rng.lognormal(-3, 2, 1000), rng.lognormal(0, 1, 500)
    np.testing.assert_array_equal(delays.histogram(a) + delays.histogram(b), delays.histogram(np.concatenate([a, b])))


def test_percentiles_nan_when_empty():
    out = delays.percentiles(np.zeros(delays.BINS, np.int64))
    assert len(out) == 3 and all(math.isnan(x) for x in out)
    assert math.isnan(delays.percentiles(np.zeros(delays.BINS, np.int64), qs=(90,))[0])


def test_percentiles_exact_small_cases():
    d = np.array([1.05e-3, 1.05e-3, 1.05, 2000.0])  # bins with upper edges 10**-2.95, 10**0.05, 10**3.35
    h = delays.histogram(d)
    p50, p51, p100 = delays.percentiles(h, qs=(50, 51, 100))
    assert p50 == pytest.approx(10**-2.95)  # 2 of 4 values at or below: the 50th percentile is the 2nd value
    assert p51 == pytest.approx(10**0.05)
    assert p100 == pytest.approx(10**3.35)
    assert delays.percentiles(delays.histogram(np.array([1e6])), qs=(50,)) == [1e4]  # overflow: capped
    assert delays.percentiles(delays.histogram(np.array([0.0])), qs=(50,)) == [1e-6]  # underflow


def test_exact_percentiles_are_values_at_rank_ceil_q_n():
    d = np.array([0.4, 0.1, 0.3, 0.2])
    assert delays.exact_percentiles(d, (25, 50, 51, 75, 99, 100)) == [0.1, 0.2, 0.3, 0.3, 0.4, 0.4]
    assert all(math.isnan(x) for x in delays.exact_percentiles(np.empty(0)))


def test_read_tables_reads_only_the_columns_asked_for_from_parquet_and_csv_files(tmp_path):
    from protocol.output import read_tables, write_table

    t = pa.table({"a": np.arange(5, dtype=np.int64), "delay": np.linspace(0.1, 0.5, 5)})
    write_table(tmp_path, "one", t.slice(0, 2), "parquet")
    write_table(tmp_path, "two", t.slice(2), "csv")
    (tmp_path / "notes.txt").write_text("not a result file")
    got = read_tables(tmp_path, ["delay"])
    assert got.column_names == ["delay"]
    np.testing.assert_allclose(np.sort(got["delay"].to_numpy()), t["delay"].to_numpy())
    assert read_tables(tmp_path).column_names == ["a", "delay"] and read_tables(tmp_path / "missing", ["delay"]) is None


BIN_RATIO = 10 ** (1 / 20)  # one bin: the histogram's resolution


@pytest.mark.parametrize("seed", range(12))
def test_percentiles_close_to_numpy(seed):
    rng = np.random.default_rng(seed)
    d = rng.lognormal(mean=rng.uniform(-8, 2), sigma=rng.uniform(0.3, 2.5), size=int(rng.integers(2000, 20000)))
    qs = (50, 90, 95, 99, 99.9)
    got = delays.percentiles(delays.histogram(d), qs=qs)
    for q, p, exact in zip(qs, got, delays.exact_percentiles(d, qs)):
        assert exact <= p <= exact * BIN_RATIO, (q, exact, p)  # the upper edge of the exact value's bin
        if q <= 95:  # away from the sparse tail, numpy's interpolated percentile is as close
            assert abs(p - np.percentile(d, q)) <= 0.125 * np.percentile(d, q)


# --------------------------------------------------------------------------- group_pairs


@pytest.mark.parametrize("seed", range(15))
def test_group_pairs_against_flatnonzero(seed):
    rng = np.random.default_rng(seed)
    n_r, n_s = (int(x) for x in rng.integers(0, 200, 2))
    k = int(rng.integers(1, 30))
    lr, ls = rng.integers(-5, k, n_r), rng.integers(0, k + 5, n_s)
    seen = []
    for label, ri, si in group_pairs(lr, ls):
        seen.append(label)
        np.testing.assert_array_equal(ri, np.flatnonzero(lr == label))  # arrival order
        np.testing.assert_array_equal(si, np.flatnonzero(ls == label))
        assert len(ri) + len(si) > 0
    assert seen == sorted(set(lr.tolist()) | set(ls.tolist()))


def test_group_pairs_empty_and_one_sided():
    e = np.empty(0, np.int64)
    assert list(group_pairs(e, e)) == []
    out = list(group_pairs(np.array([3, 1, 3]), e))
    assert [lab for lab, _, _ in out] == [1, 3]
    np.testing.assert_array_equal(out[1][1], [0, 2])
    assert len(out[1][2]) == 0


# --------------------------------------------------------------------------- tuples


@pytest.mark.parametrize("partitions", [1, 2, 7, 60, 1000])
def test_partition_of_in_range_and_deterministic(partitions):
    rng = np.random.default_rng(partitions)
    keys = np.concatenate([rng.integers(-(2**63), 2**63 - 1, 5000, dtype=np.int64), np.arange(-50, 50)])
    p = partition_of(keys, partitions)
    assert p.dtype == np.int64 and p.min() >= 0 and p.max() < partitions
    np.testing.assert_array_equal(p, partition_of(keys.copy(), partitions))
    # per-key, independent of the batch the key comes in
    np.testing.assert_array_equal(p[::-1], partition_of(keys[::-1], partitions))
    assert all(partition_of(keys[i : i + 1], partitions)[0] == p[i] for i in range(0, len(keys), 997))
    if 1 < partitions <= 60:
        counts = np.bincount(partition_of(np.arange(100000), partitions), minlength=partitions)
        assert counts.min() > 0.8 * 100000 / partitions  # well spread


def test_hashes_do_not_mutate_input_and_are_known_values():
    keys = np.array([0, 1, -1], dtype=np.int64)
    h = mix64(keys)
    np.testing.assert_array_equal(keys, [0, 1, -1])
    assert h.dtype == np.uint64 and int(h[0]) == 0
    assert int(h[1]) == 0x5692161D100B05E5  # splitmix64 finaliser of 1
    assert np.all(directory_hash(keys) == h & np.uint64(0xFFFFFFFF))


def test_tuple_dtype_sizes():
    assert BASE_TUPLE_BYTES == 40
    assert tuple_dtype().itemsize == 40 and "pad" not in tuple_dtype().names
    for size in (40, 41, 48, 64, 128):
        dt = tuple_dtype(size)
        assert dt.itemsize == size
        assert dt.names[:5] == ("id", "ts", "key", "value", "arrival")
    for size in (0, 8, 39):
        with pytest.raises(ValueError, match="40"):
            tuple_dtype(size)


def test_the_spark_side_and_the_protocol_import_without_numba():
    """Spark runs control/ code in Python workers that may lack numba (a checkpoint check failed there when
    protocol.tuples imported it): protocol/ and control/ must not need it."""
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys; sys.modules['numba'] = None\n"
        "import pkgutil, importlib, control, protocol\n"
        "for pkg in (control, protocol):\n"
        "    for m in pkgutil.iter_modules(pkg.__path__):\n"
        "        importlib.import_module(f'{pkg.__name__}.{m.name}')\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=Path(__file__).resolve().parent.parent.parent, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-2000:]
    # nor pyarrow, for what the checkpoint check's workers load (protocol.config imports protocol.eventtime)
    code = "import sys; sys.modules['pyarrow'] = None\nimport control.checkpoints, protocol.wire, protocol.config\n"
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=Path(__file__).resolve().parent.parent.parent, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-2000:]


def test_a_slave_polls_finely_only_around_its_next_expected_batch():
    """protocol.mpi: an idle slave sleeps up to 5 ms between probes, except from 3 ms before the moment its next
    batch is due (one distribution epoch after the last from each dispatcher) to 10 ms after it."""
    from protocol.waiting import SOON_LEAD, SOON_PAUSE, SOON_WINDOW, next_arrival, sleep_for

    assert sleep_for(5e-3, 100.0, None) == 5e-3
    assert sleep_for(5e-3, 100.0, 100.5) == 5e-3  # far from it: the usual back-off
    assert sleep_for(5e-3, 100.0, 100.0 + SOON_LEAD + 0.001) == pytest.approx(0.001)  # wake as the lead begins
    assert sleep_for(5e-3, 100.0, 100.001) == SOON_PAUSE  # within the lead
    assert sleep_for(5e-3, 100.0, 100.0 - SOON_WINDOW / 2) == SOON_PAUSE  # a little late
    assert sleep_for(5e-3, 100.0, 100.0 - 2 * SOON_WINDOW) == 5e-3  # it did not come: back off again
    assert sleep_for(1e-4, 100.0, 100.001) == 1e-4  # a shorter pause stays
    assert next_arrival([None, None], 0.25, 10.0) is None
    assert next_arrival([9.9, None], 0.25, 10.0) == pytest.approx(10.15)
    assert next_arrival([9.1, 9.8], 0.25, 10.0) == pytest.approx(10.05)  # the soonest of the dispatchers (10.1)
    assert next_arrival([9.0], 0.25, 10.0) == pytest.approx(10.0)  # slots missed: the next one, whole epochs on


def test_a_tool_names_itself_as_a_checkout_runs_it():
    """In a checkout the tools are `python -m` modules (the installed tool's `streamjoin audit` and `streamjoin
    run` are checked by tests/cluster/test_install.py)."""
    from protocol.lifetime import invocation

    assert invocation("control.audit") == "python -m control.audit"
    assert invocation("deploy.launch") == "python -m deploy.launch"


def test_ranks_convert_arrays_without_pandas(tmp_path):
    """A rank tells pyarrow that pandas is absent (protocol.startup.without_pandas): its conversions, compute
    functions and Parquet files work the same, and pandas is never imported."""
    code = (
        "import sys; from protocol.startup import without_pandas; without_pandas()\n"
        "import numpy as np, pyarrow as pa, pyarrow.compute as pc, pyarrow.parquet as pq\n"
        "t = pa.table({'k': np.arange(3), 's': ['a', 'b', 'a']})\n"
        f"pq.write_table(t.filter(pc.equal(t['s'], 'a')), {str(tmp_path / 'x.parquet')!r})\n"
        f"print(pq.read_table({str(tmp_path / 'x.parquet')!r})['k'].to_pylist(), 'pandas' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout == "[0, 2] False\n"


def test_a_ranks_stderr_line_leaves_in_one_write():
    """protocol.startup.whole_lines: print's text and newline reach the file in one write (Open MPI's abort
    banner once landed between the two), where Python's stderr writes them apart."""
    code = (
        "import io, sys\n"
        "class Raw(io.RawIOBase):\n"
        "    writes = []\n"
        "    def writable(self): return True\n"
        "    def write(self, b): self.writes.append(bytes(b)); return len(b)\n"
        "def written(fix):\n"
        "    Raw.writes = []\n"
        "    sys.stderr = io.TextIOWrapper(Raw(), line_buffering=True, write_through=True)\n"
        "    if fix:\n"
        "        from protocol.startup import whole_lines; whole_lines()\n"
        "    print('error: lost', file=sys.stderr, flush=True)\n"
        "    return Raw.writes\n"
        "print(written(False), written(True))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout == "[b'error: lost', b'\\n'] [b'error: lost\\n']\n"


def test_slaves_import_beside_rank_0_on_the_cores_it_leaves_or_all_when_they_fit():
    """protocol.startup.early_importers: as many slaves import at once with rank 0 as leave no core idle."""
    from protocol.startup import early_importers

    assert [early_importers(ranks, 2) for ranks in (2, 3, 4, 17)] == [1, 2, 1, 1]
    assert [early_importers(ranks, 4) for ranks in (3, 5, 6, 17)] == [2, 4, 3, 3]
    assert early_importers(17, 1) == 0
