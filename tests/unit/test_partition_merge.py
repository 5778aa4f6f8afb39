"""The per-partition watermark merge of a partitioned stream (master.sources.partitions), on synthetic partitions:
what it releases and when, in what order, and that the master's stream-level lateness over that order is each
partition's own lateness (tests.reference.late_flags per partition)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
from master.sources.partitions import PartitionMerge
from protocol.eventtime import NEG_INF
from tests.reference import late_flags

DELAY = 1_000  # microseconds


def merge(partitions: int, high=None, bounded=True, idle_timeout=0.0) -> PartitionMerge:
    high = np.full(partitions, 1 << 40) if high is None else np.asarray(high)
    m = PartitionMerge(np.zeros(partitions, np.int64), high, bounded, DELAY, idle_timeout)
    m.start(0.0)
    return m


def feed(m: PartitionMerge, partition, offset, ts, now: float = 0.0, good=None) -> None:
    partition, offset, ts = (np.asarray(x, np.int64) for x in (partition, offset, ts))
    m.read(partition, offset, now)
    m.add(
        partition,
        offset,
        ts,
        np.ones(len(ts), bool) if good is None else np.asarray(good),
        pa.table({"p": partition, "o": offset, "ts": ts}),
    )


def released(m: PartitionMerge, now: float = 0.0) -> list[tuple[int, int]]:
    r = m.release(now)
    if r is None:
        return []
    assert r.table["p"].to_pylist() == r.partition.tolist() and r.table["o"].to_pylist() == r.offset.tolist()
    return list(zip(r.partition.tolist(), r.offset.tolist()))


def test_rows_wait_for_every_partition_that_can_still_bring_rows_and_leave_strictly_below_the_floor():
    m = merge(2)
    feed(m, [0, 0, 0], [0, 1, 2], [10_000, 11_000, 12_000])  # watermarks 9_000, 10_000, 11_000
    assert released(m) == []  # partition 1 has brought nothing: it may bring anything
    feed(m, [1], [0], [11_000])  # watermark 10_000: the floor
    assert released(m) == [(0, 0)]  # strictly below it
    feed(m, [1], [1], [13_000])  # the floor is partition 0's 11_000
    assert released(m) == [(0, 1), (1, 0)]  # both at 10_000: partition 0 first


def test_ties_go_by_partition_then_offset_and_a_row_that_fails_the_checks_moves_no_watermark():
    m = merge(3, high=[2, 2, 2])
    feed(
        m,
        [2, 1, 0, 2, 1, 0],
        [0, 0, 0, 1, 1, 1],
        [5_000, 5_000, 5_000, 5_000, 99_000, 5_000],
        good=[True, True, True, True, False, True],
    )
    assert m.running.tolist() == [5_000] * 3 and m.done is False
    assert released(m) == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]  # all at 4_000, every partition ended
    assert m.done


def read_randomly(m: PartitionMerge, rng, sizes, ts, start, batch: int, cut: int | None = None):
    """Partition p's records from offset start[p] to sizes[p] (times ts[p]) fed in random batches of up to `batch`
    from random partitions: the (partition, offset) handed on, and the merge's place once `cut` rows are (the rows
    handed on then, unreleased offsets, running maxima there, end offsets)."""
    taken, out, place = start.copy(), [], None
    while (taken < sizes).any():
        p = rng.choice(np.flatnonzero(taken < sizes))
        offsets = np.arange(taken[p], min(taken[p] + int(rng.integers(1, batch)), sizes[p]))
        feed(m, np.full(len(offsets), p), offsets, ts[p][offsets])
        taken[p] += len(offsets)
        out += released(m)
        if cut is not None and place is None and len(out) >= cut:
            place = (len(out), m.unreleased(), m.handed.copy(), m.end.copy())
    return out + released(m), place


def test_the_merged_order_does_not_depend_on_how_the_partitions_are_read_and_stream_lateness_is_per_partition():
    """Random partitions (some empty), each out of order on its own by up to twice DELAY and far apart from each
    other in time, read in random batches: the rows come out in one order, and the stream-level rule over that
    order (late iff below the largest earlier time minus DELAY) flags exactly the rows late within their own
    partition -- where reading the partitions one after another would flag almost all."""
    rng = np.random.default_rng(7)
    parts = 6
    sizes = np.r_[rng.integers(1, 400, parts - 1), 0]
    ts = [p * 50_000 + np.cumsum(rng.integers(0, 300, n)) - rng.integers(0, 2 * DELAY, n) for p, n in enumerate(sizes)]
    orders = []
    for attempt in range(3):
        m = merge(parts, high=sizes)
        out, _ = read_randomly(m, rng, sizes, ts, np.zeros(parts, np.int64), 60)
        assert m.done and len(out) == sizes.sum()
        orders.append(out)
    assert orders[0] == orders[1] == orders[2]
    stream_late = late_flags(np.array([ts[p][o] for p, o in orders[0]]), DELAY / 1e6)
    own_late = {(p, o): flag for p in range(parts) for o, flag in enumerate(late_flags(ts[p], DELAY / 1e6))}
    assert stream_late.tolist() == [own_late[k] for k in orders[0]]
    assert 0 < stream_late.sum() and late_flags(np.concatenate(ts[::-1]), DELAY / 1e6).sum() > sizes.sum() / 2


def test_an_ended_or_caught_up_partition_holds_nothing_back_until_its_next_record():
    m = merge(3, high=[1, 5, 5])
    feed(m, [0, 2], [0, 0], [50_000, 3_000])  # partition 0 at its end
    assert released(m) == []  # partition 1 has not been read: it may bring anything
    m.reached_end(1, 0)  # read up to its high watermark: nothing there for now
    feed(m, [2], [1], [10_000])  # the floor: partition 2's 9_000
    assert released(m) == [(2, 0)]
    feed(m, [1], [0], [2_000])  # its next record: it holds back again, at 1_000
    assert released(m) == []
    m.reached_end(1, 5), m.reached_end(2, 5)  # both at their end (past offsets the client skips, e.g. markers)
    assert released(m) == [(1, 0), (2, 1), (0, 0)] and m.done


def test_an_unbounded_stream_never_ends_and_a_partition_empty_at_the_broker_holds_nothing_back():
    m = merge(2, high=[0, 3], bounded=False)  # partition 0 empty at the start
    feed(m, [1, 1, 1], [0, 1, 2], [1_000, 2_000, 9_000])
    assert released(m) == [(1, 0), (1, 1)]  # below partition 1's own 8_000
    m.reached_end(1, 3)
    assert released(m) == [(1, 2)] and not m.done
    feed(m, [0], [0], [500])  # partition 0's first record: its time is far below what went on (late there)
    assert released(m) == [] and not m.done


def test_an_idle_partition_stops_holding_back_after_the_idle_timeout_until_its_next_record():
    m = merge(2, idle_timeout=2.0)
    feed(m, [0], [0], [1_000], now=0.0)  # watermark 0
    feed(m, [1, 1], [0, 1], [20_000, 21_000], now=1.0)
    assert released(m, now=1.9) == []  # partition 0 holds everything at or above 0 back
    assert released(m, now=2.5) == [(0, 0), (1, 0)]  # partition 0 idle: no record since 0.0
    feed(m, [0], [1], [5_000], now=2.6)  # it counts again: partition 1's next rows wait for it
    assert released(m, now=2.6) == []
    assert released(m, now=4.7) == [(0, 1), (1, 1)]  # idle again
    unstarted = PartitionMerge(np.zeros(2, np.int64), np.full(2, 9), True, DELAY, 2.0)
    feed(unstarted, [1], [0], [20_000], now=100.0)
    assert unstarted.holding(100.0).tolist() == [True, True]  # before reading starts no partition is quiet


def test_a_partition_read_far_ahead_is_paused_until_half_of_its_rows_are_handed_on_and_the_lowest_never():
    m = merge(2)
    m.limit = 4
    feed(m, [1] * 6, range(6), np.arange(6) * 1_000 + 100_000)  # far ahead in time: watermarks 99_000 ...
    feed(m, [0], [0], [0])
    assert m.crowded(0.0).tolist() == [False, True]
    feed(m, [0] * 6, range(1, 7), np.arange(1, 7) * 1_000)
    assert len(released(m)) == 6  # partition 0's below its 5_000
    assert m.crowded(0.0).tolist() == [False, True]  # partition 1's 6 rows still wait
    feed(m, [0], [7], [200_000])  # partition 0 passes partition 1, which is the lowest now: resumed
    assert m.crowded(0.0).tolist() == [False, False]
    assert released(m) == [(0, 6)] + [(1, o) for o in range(5)] and m.unreleased().tolist() == [7, 5]


def test_positions_to_commit_are_each_partitions_oldest_record_not_handed_on():
    m = merge(2, high=[3, 3])
    feed(m, [0, 0, 1], [0, 1, 0], [1_000, 2_000, 1_500])
    m.read(np.array([0]), np.array([2]), 0.0)  # a record set aside: partition 0 is at its end
    assert m.unreleased().tolist() == [0, 0]
    assert released(m) == [(0, 0)]  # partition 1 holds back at 500
    assert m.unreleased().tolist() == [1, 0]
    feed(m, [1, 1], [1, 2], [1_600, 1_700])
    assert released(m) == [(1, 0), (1, 1), (1, 2), (0, 1)] and m.unreleased().tolist() == [3, 3]


def test_a_merge_restored_at_its_unreleased_offsets_goes_on_in_the_uninterrupted_order():
    """A checkpoint's place (each partition's oldest offset not handed on, its running maximum there, the end
    offsets) taken at random moments: a fresh merge restored there and fed the records from those offsets on, in
    other batches, hands on exactly the rows the uninterrupted merge hands on after that moment, in its order."""
    rng = np.random.default_rng(8)
    parts = 5
    sizes = rng.integers(1, 300, parts)
    ts = [p * 20_000 + np.cumsum(rng.integers(0, 300, n)) - rng.integers(0, 2 * DELAY, n) for p, n in enumerate(sizes)]

    run = lambda m, start, cut=None: read_randomly(m, rng, sizes, ts, start, 40, cut)
    whole, _ = run(merge(parts, high=sizes), np.zeros(parts, np.int64))
    for cut in (1, len(whole) // 3, len(whole) // 2):
        before, (at, offsets, running, end) = run(merge(parts, high=sizes), np.zeros(parts, np.int64), cut)
        assert before == whole
        fresh = merge(parts, high=np.full(parts, 1 << 40))  # the broker has more now: the first run's ends hold
        fresh.restore(offsets, running, end)
        after, _ = run(fresh, offsets.copy())
        assert whole[:at] + after == whole and fresh.done
        assert offsets.tolist() == [min([o for q, o in whole[at:] if q == p], default=sizes[p]) for p in range(parts)]


def test_an_unbounded_merge_restored_holds_back_for_a_partition_with_records_at_the_broker_now():
    """Restored where partition 1 had been read to its end then: the broker has more of it now, so it holds the
    other back (it is not caught up) until it is read; one with nothing more now holds nothing back."""
    for high_now, holds in (([3, 9], True), ([3, 3], False)):
        m = merge(2, high=high_now, bounded=False)
        m.restore(np.array([2, 3]), np.array([NEG_INF, 10_000]), np.array([3, 3]))
        feed(m, [0], [2], [20_000])
        m.reached_end(0, 3)  # partition 0 read to its end
        assert (released(m) == []) is holds


def test_a_partition_whose_records_were_deleted_reads_on_past_them_and_a_bounded_one_ends_there():
    """Records deleted before they were read (master.sources.kafka_input, on_lost = "skip"): the partition's
    position moves past them, so its next offset to hand on and a checkpoint's offset are there, never below."""
    m = merge(2, high=[10, 10])
    feed(m, [0, 0], [0, 1], [1_000, 2_000])
    m.skip(0, 6)
    assert m.position.tolist() == [6, 0] and m.unreleased().tolist() == [0, 0]  # rows 0, 1 still wait
    m.skip(0, 4)  # never back
    assert m.position[0] == 6
    m.skip(1, 10)  # bounded: everything up to its end deleted
    assert m.ended().tolist() == [False, True]
    feed(m, [0], [6], [3_000])
    m.reached_end(0, 10)
    assert released(m) == [(0, 0), (0, 1), (0, 6)] and m.unreleased().tolist() == [10, 10] and m.done
