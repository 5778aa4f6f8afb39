"""Tests of master/state/lateness.py and master/state/packing.py and master/state/buffers.py (mini-buffers)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from master.state.buffers import MiniBuffers
from master.state.lateness import Lateness
from master.state.packing import to_wire, to_wire_hashed
from protocol.eventtime import NEG_INF
from protocol.tuples import STREAM_R, STREAM_S, partition_of, tuple_dtype
from tests.reference import late_flags, micros

DT = tuple_dtype(64)


# --------------------------------------------------------------------------- lateness, both streams together


def prev_max_loop(ts):
    out, running = [], NEG_INF
    for t in ts.tolist():
        out.append(running)
        running = max(running, t)
    return np.array(out)


def judge(lateness, ts, stream=None):
    ts = np.asarray(ts, dtype=np.int64)
    late, bound, below_watermark = lateness.judge(ts, np.zeros(len(ts), np.int8) if stream is None else stream, 0.0)
    assert not below_watermark.any()  # one running max: W never passes a tuple's own bound
    return late, bound


@pytest.mark.parametrize("seed", range(20))
def test_lateness_batches_with_carry_equal_whole_array(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 3000))
    max_delay = float(rng.choice([0.0, 0.3, 2.0]))
    ts = np.cumsum(rng.exponential(0.05, n)) - rng.exponential(0.3, n)
    if seed % 4 == 0:
        ts = np.round(ts * 4) / 4  # many ties, exact ts == max - max_delay cases
    if seed % 4 == 1:
        ts = np.round(ts, 1)  # decimals a float misses: ts == max - max_delay holds in decimals only
    expected = late_flags(ts, max_delay)
    ts, max_delay = micros(ts), micros(max_delay)
    stream = rng.integers(0, 2, n).astype(np.int8)  # both streams together: the stream does not matter
    cuts = np.sort(rng.integers(0, n + 1, int(rng.integers(0, 12))))
    lateness = Lateness([max_delay])
    flags, bounds = [], []
    for part in np.split(np.arange(n), cuts):
        before = lateness.running[0]
        late, bound = judge(lateness, ts[part], stream[part])
        assert late.dtype == bool and len(late) == len(part) == len(bound)
        assert lateness.running[0] == max([before, *ts[part].tolist()])
        assert lateness.watermark == lateness.running[0] - max_delay
        flags.append(late)
        bounds.append(bound)
    np.testing.assert_array_equal(np.concatenate(flags), expected)
    np.testing.assert_array_equal(np.concatenate(bounds), prev_max_loop(ts) - max_delay)
    whole = Lateness([max_delay])
    np.testing.assert_array_equal(judge(whole, ts, stream)[0], expected)
    assert whole.running[0] == (ts.max() if n else NEG_INF)
    np.testing.assert_array_equal(whole.late, [expected[stream == 0].sum(), expected[stream == 1].sum()])
    if n > 100 and max_delay < 1:
        assert expected.any() and not expected.all()


def test_lateness_boundary_and_carry():
    # a tuple exactly max_delay behind is on time; just beyond is late; the first tuple never is
    lateness = Lateness([500_000])
    late, bound = judge(lateness, [10_000_000, 9_500_000, 9_499_999, 12_000_000])
    assert late.tolist() == [False, False, True, False]
    assert bound.tolist() == [NEG_INF - 500_000, 9_500_000, 9_500_000, 9_500_000] and lateness.running[0] == 12_000_000
    # carried running max makes the first tuple of the next batch late
    late, _ = judge(lateness, [11_000_000, 11_500_000])
    assert late.tolist() == [True, False] and lateness.running[0] == 12_000_000
    # an empty batch keeps the running max
    late, _ = judge(lateness, [])
    assert len(late) == 0 and lateness.running[0] == 12_000_000 and lateness.watermark == 11_500_000


# --------------------------------------------------------------------------- lateness per stream ([streams])

S_ = 1_000_000  # a second in microseconds


def per_stream(ts, stream, lateness, now):
    late, bound, below_watermark = lateness.judge(np.array(ts, np.int64) * S_, np.array(stream, np.int8), now)
    return late.tolist(), (bound // S_).tolist(), below_watermark.tolist()


def test_each_stream_is_judged_by_its_own_largest_ts_and_max_delay():
    lateness = Lateness([1 * S_, 5 * S_])  # R may be 1 s out of order, S 5 s
    late, bound, _ = per_stream([10, 10, 9, 5, 8, 4, 12], [0, 1, 0, 1, 0, 1, 1], lateness, 0.0)
    assert late == [False, False, False, False, True, True, False]  # R 8 < 10 - 1; S 4 < 10 - 5
    assert bound[2:6] == [9, 5, 9, 5]
    assert lateness.watermark == 7 * S_  # min(10 - 1, 12 - 5)
    assert lateness.late.tolist() == [1, 1]


def test_an_ended_stream_stops_holding_the_watermark_back_and_none_left_gives_the_largest():
    lateness = Lateness([1 * S_, 2 * S_])
    per_stream([10, 30], [0, 1], lateness, 0.0)
    assert lateness.tick(0.5, [False, False]) == 9 * S_
    assert lateness.tick(0.6, [True, False]) == 28 * S_  # R has ended: S's bound alone
    per_stream([40], [1], lateness, 0.7)
    assert lateness.tick(0.8, [True, True]) == 38 * S_ and lateness.periods == []


def test_an_idle_stream_stops_holding_the_watermark_and_resuming_its_tuples_below_it_are_late():
    lateness = Lateness([1 * S_, 5 * S_], [2.0, 0.0])  # R idle after 2 s without a tuple; S never
    lateness.start(0.0)
    per_stream([10, 10], [0, 1], lateness, 0.1)
    assert lateness.tick(2.0, [False, False]) == 5 * S_ and lateness.idle == [False, False]  # 1.9 s: not yet
    assert lateness.tick(2.1, [False, False]) == 5 * S_ and lateness.idle == [True, False]
    per_stream([30], [1], lateness, 3.0)
    assert lateness.watermark == 25 * S_  # S's bound alone
    late, bound, below = per_stream([24, 26, 25], [0, 0, 0], lateness, 3.5)  # R resumes
    assert late == [True, False, False] and below == [True, False, False] and bound == [25, 25, 25]
    assert lateness.late.tolist() == [1, 0] and lateness.idle == [False, False]
    assert lateness.watermark == 25 * S_  # R counts again (26 - 1), W never falls
    assert lateness.periods == [
        {"stream": "R", "began": 2.1, "ended": 3.5, "watermark": 5 * S_, "watermark_ended": 25 * S_, "resumed": True}
    ]
    # both idle: none counts, W is the largest bound; the run's end closes the periods
    lateness = Lateness([1 * S_, 5 * S_], [1.0, 1.0])
    lateness.start(0.0)
    per_stream([10, 30], [0, 1], lateness, 0.0)
    assert lateness.tick(1.0, [False, False]) == 25 * S_ and lateness.idle == [True, True]
    restored = Lateness([1 * S_, 5 * S_], [1.0, 1.0])
    restored.restore(json.loads(json.dumps(lateness.state())))  # a checkpoint keeps the open periods open
    for x in (lateness, restored):
        x.finish(4.0)
        assert [(p["stream"], p["began"], p["ended"], p["resumed"]) for p in x.periods] == [
            ("R", 1.0, 4.0, False),
            ("S", 1.0, 4.0, False),
        ]


def reference_per_stream(batches, delays, timeouts):
    """Tuple by tuple, the rule as the issue states it: (late flags, W after each batch); `batches` are
    (now, ts, stream, ended), a tick at `now` before each."""
    running, last, idle, w, flags, marks = [None, None], [0.0, 0.0], [False, False], -(2**70), [], []

    def watermark(w, ended):
        bounds = [-(2**70) if r is None else r - d for r, d in zip(running, delays)]
        counting = [b for b, e, i in zip(bounds, ended, idle) if not e and not i]
        return max(w, min(counting) if counting else max(bounds))

    for now, ts, stream, ended in batches:
        idle = [not e and t > 0 and (now - x >= t or i) for e, t, x, i in zip(ended, timeouts, last, idle)]
        w = watermark(w, ended)
        for t, x in zip(ts, stream):
            own = -(2**70) if running[x] is None else running[x] - delays[x]
            flags.append(t < own or t < w)
            running[x] = t if running[x] is None else max(running[x], t)
            last[x], idle[x] = now, False
        w = watermark(w, ended)
        marks.append(w)
    return flags, marks


@pytest.mark.parametrize("seed", range(12))
def test_lateness_per_stream_with_idleness_and_ends_equals_the_rule_tuple_by_tuple(seed):
    rng = np.random.default_rng(seed)
    delays = [int(d) for d in rng.choice([0, 300_000, 2_000_000], 2)]
    timeouts = [float(t) for t in rng.choice([0.0, 0.5, 1.5], 2)]
    lateness, batches, now, ended = Lateness(delays, timeouts), [], 0.0, [False, False]
    lateness.start(0.0)
    clock = [0, 0]  # each stream's event time moves on at its own pace, with pauses
    for _ in range(60):
        now += float(rng.choice([0.05, 0.4, 1.0]))
        n = int(rng.integers(0, 40))
        stream = rng.integers(0, 2, n).astype(np.int8)
        stream[~np.isin(stream, np.flatnonzero(~np.array(ended)))] = -1
        stream = stream[stream >= 0]
        if rng.random() < 0.3 and len(stream):  # one stream pauses for this batch
            stream = stream[stream == stream[0]]
        ts = np.empty(len(stream), np.int64)
        for x in (0, 1):
            k = int((stream == x).sum())
            ts[stream == x] = clock[x] + np.cumsum(rng.integers(0, 200_000, k)) - rng.integers(0, 2_500_000, k)
            clock[x] += int(rng.integers(0, 200_000)) * k
        if rng.random() < 0.03:
            ended[int(rng.integers(0, 2))] = True
        batches.append((now, ts.tolist(), stream.tolist(), list(ended)))
    flags, marks = [], []
    for now, ts, stream, ended in batches:
        lateness.tick(now, ended)
        flags += lateness.judge(np.array(ts, np.int64), np.array(stream, np.int8), now)[0].tolist()
        marks.append(None if lateness.watermark <= NEG_INF else lateness.watermark)  # before any bound
    expected_flags, expected_marks = reference_per_stream(batches, delays, timeouts)
    assert flags == expected_flags
    assert marks == [None if w < -(2**62) else w for w in expected_marks]
    assert any(flags) and not all(flags)


def test_to_wire_packs_columns():
    rows = to_wire(
        DT,
        np.array([1, 2]),
        np.array([500_000, 1_500_000]),
        np.array([7, 8]),
        np.array([0.1, 0.2]),
        np.array([100.0, 101.0]),
    )
    assert rows.dtype == DT
    assert rows["id"].tolist() == [1, 2] and rows["ts"].tolist() == [500_000, 1_500_000]
    assert rows["key"].tolist() == [7, 8] and rows["value"].tolist() == [0.1, 0.2]
    assert rows["arrival"].tolist() == [100.0, 101.0]


@pytest.mark.parametrize("n,partitions,tuple_bytes", [(0, 4, 64), (1, 1, 64), (1000, 7, 40), (5000, 60, 64)])
def test_to_wire_hashed_is_each_streams_on_time_rows_stably_sorted_by_partition(n, partitions, tuple_bytes):
    rng = np.random.default_rng(n + partitions)
    dt = tuple_dtype(tuple_bytes)
    stream = rng.integers(0, 2, n).astype(np.int8)
    cols = (
        rng.integers(-(2**62), 2**62, n),
        rng.integers(-(2**60), 2**60, n),
        rng.integers(-99, 99, n),
        rng.random(n),
        rng.random(n),
    )
    late = rng.random(n) < 0.2
    routed = to_wire_hashed(dt, stream, *cols, late, partitions)
    for st, (rows, sizes) in zip((STREAM_R, STREAM_S), routed):
        index = np.flatnonzero(~late & (stream == st))
        part = partition_of(cols[2][index], partitions)
        order = index[np.argsort(part, kind="stable")]
        want = np.zeros(len(index), dt)  # padding zero: nothing of the master's memory goes on the wire
        for field, col in zip(("id", "ts", "key", "value", "arrival"), cols):
            want[field] = col[order]
        assert rows.dtype == dt and rows.tobytes() == want.tobytes()
        assert sizes.tolist() == np.bincount(part, minlength=partitions).tolist()
        assert to_wire(dt, *cols, order).tobytes() == want.tobytes()  # rows in the order given


@pytest.mark.parametrize("partitions", [1, 7, 60, 1000])
def test_the_compiled_routing_hashes_every_int64_key_as_partition_of(partitions):
    keys = np.concatenate(
        [
            np.random.default_rng(partitions).integers(-(2**63), 2**63 - 1, 2000, dtype=np.int64),
            np.arange(-50, 50),
            [np.iinfo(np.int64).min, np.iinfo(np.int64).max],
        ]
    )
    n = len(keys)
    (rows, sizes), _ = to_wire_hashed(
        DT,
        np.zeros(n, np.int8),
        np.arange(n),
        np.zeros(n, np.int64),
        keys,
        np.zeros(n),
        np.zeros(n),
        np.zeros(n, bool),
        partitions,
    )
    part = partition_of(keys, partitions)
    assert sizes.tolist() == np.bincount(part, minlength=partitions).tolist()
    np.testing.assert_array_equal(partition_of(rows["key"], partitions), np.repeat(np.arange(partitions), sizes))


# --------------------------------------------------------------------------- MiniBuffers


def test_minibuffers_oldest_arrival_is_the_earliest_of_the_partitions_asked():
    rng = np.random.default_rng(3)
    buf = MiniBuffers(5, DT)
    assert buf.oldest_arrival(np.arange(5)) == np.inf
    rows = []
    for step in range(6):  # chunks come in arrival order; a re-routed chunk may be older than the one before
        for stream in (STREAM_R, STREAM_S):
            chunk = np.zeros(int(rng.integers(1, 40)), DT)
            chunk["key"] = rng.integers(0, 100, len(chunk))
            chunk["arrival"] = np.sort(rng.uniform(step, step + 2, len(chunk)))
            buf.add(stream, chunk)
            rows.append(chunk)
    rows = np.concatenate(rows)
    part = partition_of(rows["key"], 5)
    for asked in ([0], [1, 3], [0, 1, 2, 3, 4], []):
        want = rows["arrival"][np.isin(part, asked)].min(initial=np.inf)
        assert buf.oldest_arrival(np.array(asked, dtype=np.int64)) == want


def batch(rng, first_id, n, n_keys):
    rows = np.zeros(n, dtype=DT)
    rows["id"] = np.arange(first_id, first_id + n)
    rows["key"] = rng.integers(0, n_keys, n)
    rows["ts"] = rng.integers(0, 10_000_000, n)
    return rows


@pytest.mark.parametrize("seed", range(10))
def test_minibuffers_drain_subset(seed):
    rng = np.random.default_rng(seed)
    P = int(rng.integers(1, 20))
    buf = MiniBuffers(P, DT)
    added = {STREAM_R: [], STREAM_S: []}
    next_id = 0
    for _ in range(int(rng.integers(1, 8))):
        for stream in (STREAM_R, STREAM_S):
            rows = batch(rng, next_id, int(rng.integers(0, 300)), n_keys=int(rng.integers(1, 500)))
            next_id += len(rows)
            buf.add(stream, rows)
            added[stream].append(rows)
    all_rows = {st: np.concatenate(added[st]) if added[st] else np.empty(0, DT) for st in added}
    parts = {st: partition_of(all_rows[st]["key"], P) for st in all_rows}
    for st in (STREAM_R, STREAM_S):
        np.testing.assert_array_equal(buf.counts[st], np.bincount(parts[st], minlength=P))
    assert len(buf) == len(all_rows[STREAM_R]) + len(all_rows[STREAM_S])

    chosen = np.sort(rng.choice(P, int(rng.integers(0, P + 1)), replace=False)).astype(np.int64)
    counts_before = buf.counts.copy()
    r, s = buf.drain(chosen)
    for st, got in ((STREAM_R, r), (STREAM_S, s)):
        assert got.dtype == DT
        # exactly the tuples of the chosen partitions, partition by partition, arrival order inside each
        expected = np.concatenate([all_rows[st][parts[st] == p] for p in chosen.tolist()] or [np.empty(0, DT)])
        assert got.tobytes() == expected.tobytes()
        got_parts = partition_of(got["key"], P)
        for p in chosen.tolist():
            ids = got["id"][got_parts == p]
            assert np.all(np.diff(ids) > 0)
    others = np.setdiff1d(np.arange(P), chosen)
    assert np.all(buf.counts[:, chosen] == 0)
    np.testing.assert_array_equal(buf.counts[:, others], counts_before[:, others])
    assert len(buf) == int(counts_before[:, others].sum())

    # the rest is untouched: draining it returns everything else, then the buffers are empty
    r2, s2 = buf.drain(others)
    for st, got in ((STREAM_R, r2), (STREAM_S, s2)):
        expected = np.concatenate([all_rows[st][parts[st] == p] for p in others.tolist()] or [np.empty(0, DT)])
        assert got.tobytes() == expected.tobytes()
    assert len(buf) == 0 and not buf.counts.any()
    r3, s3 = buf.drain(np.arange(P))
    assert len(r3) == len(s3) == 0 and r3.dtype == DT


def test_minibuffers_streams_are_separate_and_refill_after_drain():
    rng = np.random.default_rng(0)
    buf = MiniBuffers(4, DT)
    rows = batch(rng, 0, 50, 10)
    buf.add(STREAM_S, rows)
    buf.add(STREAM_R, rows[:0])
    assert buf.counts[STREAM_R].sum() == 0 and buf.counts[STREAM_S].sum() == 50
    r, s = buf.drain(np.arange(4))
    assert len(r) == 0 and sorted(s["id"].tolist()) == list(range(50))
    more = batch(rng, 50, 30, 10)
    buf.add(STREAM_S, more)
    r, s = buf.drain(np.arange(4))
    assert sorted(s["id"].tolist()) == list(range(50, 80))  # nothing of the first batch comes back


def test_run_stats_keep_each_slaves_communication_seconds_as_a_level():
    from master.state.stats import RunStats
    from protocol import delays
    from protocol.messages import HISTOGRAMS, REPORT

    stats = RunStats([1, 2], 100.0)
    hist = np.zeros((HISTOGRAMS, delays.BINS), dtype=np.int64)
    for comm in (0.25, 0.75):  # the slave reports its running total; the summary keeps the last one
        stats.add_report(1, {**dict.fromkeys(REPORT.names, 0), "comm": comm}, hist)
    from protocol.plan import load_plan

    summary = stats.summary(load_plan(), 103.0, 1 << 20)
    per_slave = summary["slaves"]
    assert per_slave["1"]["comm_seconds"] == 0.75 and per_slave["2"]["comm_seconds"] == 0.0
    assert summary["wall_seconds"] == 3.0 and summary["master_peak_rss_bytes"] == 1 << 20  # as it was told


def test_the_progress_line_names_the_slave_longest_at_one_batch_once_it_is_long():
    from master.state.stats import LONG_BATCH, RunStats
    from protocol import delays
    from protocol.messages import HISTOGRAMS, REPORT

    stats = RunStats([1, 2, 3], 0.0)
    stats.joining = {1: (10, LONG_BATCH / 2)}  # a busy host's batch: not named
    assert "still joining" not in stats.progress_line(1.0, 0, 3, 0)
    stats.joining = {1: (10, LONG_BATCH / 2), 2: (5000, LONG_BATCH + 1.2), 3: (7, LONG_BATCH + 0.2)}
    line = stats.progress_line(1.0, 0, 3, 0)
    assert line.endswith(
        f" | slave 2 still joining one batch after {LONG_BATCH + 1.2:.0f}s: 5,000 results so far (and 1 other slave)"
    ), line
    stats.add_report(2, dict.fromkeys(REPORT.names, 0), np.zeros((HISTOGRAMS, delays.BINS), dtype=np.int64))
    assert "slave 3 still joining" in stats.progress_line(1.0, 0, 3, 0)  # slave 2's report came: its batch is done
