"""master/punctuation.py: the result stream's punctuation bound, as pure bookkeeping."""

from __future__ import annotations

import numpy as np

from protocol.eventtime import NEG_INF, POS_INF
from master.punctuation import Punctuator


def test_bound_is_the_min_of_future_buffered_and_outstanding():
    p = Punctuator(4)
    counts = np.zeros((2, 4), dtype=np.int64)
    assert p.bound(10, counts) == 10  # nothing buffered or in flight: only future tuples
    counts[1, 2] = 5
    assert p.bound(10, counts) == NEG_INF  # partition 2 has tuples and was never drained
    p.sent(1, 1, np.array([2, 3]), min_ts=4, floor_now=7)
    assert p.bound(10, counts) == 4  # batch (1, 1) still out, its oldest tuple is 4
    p.done(1, 1)
    assert p.bound(10, counts) == 7  # partition 2 buffered since a drain at floor 7
    counts[:] = 0
    assert p.bound(POS_INF, counts) == POS_INF


def test_a_moving_group_keeps_its_old_floor_while_others_advance():
    # partition 0's tuples are held (moving) since its last drain at floor 2; partition 1 drains on
    p = Punctuator(2)
    counts = np.array([[3, 0], [0, 0]])
    p.sent(1, 1, np.array([0, 1]), 1, 2)
    p.done(1, 1)
    for epoch, floor in enumerate([5, 8, 11], start=2):
        p.sent(2, epoch, np.array([1]), floor, floor)
        p.done(2, epoch)
        assert p.bound(12, counts) == 2


def test_advance_is_strictly_increasing():
    p = Punctuator(1)
    counts = np.zeros((2, 1), dtype=np.int64)
    assert p.advance(10, counts) == 10
    assert p.advance(10, counts) is None
    assert p.advance(5, counts) is None
    assert p.advance(20, counts) == 20
    assert p.last == 20


def test_tuples_rerouted_by_a_hot_key_split_keep_the_floor_of_the_partition_they_came_from():
    # partition 0 (the hot key's home) was last drained at floor 3; sub-group slots 2 and 3 at floor 9 (an
    # earlier hot key's): its buffered tuples now wait in 2 and 3, so those bound results from 3 on, not 9
    p = Punctuator(4)
    p.sent(1, 1, np.array([0]), 3, 3)
    p.sent(1, 2, np.array([2, 3]), 9, 9)
    p.done(1, 1)
    p.done(1, 2)
    counts = np.array([[0, 0, 4, 4], [0, 0, 0, 0]])
    assert p.bound(20, counts) == 9  # without the reroute: results from 3 on could be punctuated away
    p.rerouted([0], [2, 3])
    assert p.bound(20, counts) == 3
    p.rerouted([2, 3], [0])  # the merge back: the home partition takes the lowest of the sub-groups
    assert p.drain_floor[0] == 3


# -- rows without a partner (left, right, full, anti): each partition's floor of rows still undecided ----------


def lone(partitions: int, lead: int = 5) -> tuple[Punctuator, np.ndarray]:
    return Punctuator(partitions, lead), np.zeros((2, partitions), dtype=np.int64)


def test_a_row_alone_bounds_the_punctuation_by_the_watermark_its_slave_last_decided_by():
    p, empty = lone(2)
    p.sent(1, 1, np.array([0, 1]), min_ts=100, floor_now=100)
    assert p.bound(200, empty) == NEG_INF  # the first batch listing them: rows of other dispatchers may be there
    p.done(1, 1, watermark=40)  # the slave decided by 40: rows still undecided there become final at 40 or later
    assert p.bound(200, empty) == 40  # pairs alone would allow 200 (nothing out, nothing buffered)
    assert Punctuator(2).bound(200, empty) == 200  # inner and semi: no floor of rows alone
    p.sent(1, 2, np.array([0, 1]), min_ts=150, floor_now=150)
    assert p.bound(200, empty) == 40  # the batch out may decide rows of final time 40 or later
    p.done(1, 2, watermark=120)
    assert p.bound(200, empty) == 120
    p.sent(1, 3, np.array([0, 1]), min_ts=100, floor_now=150)
    assert p.bound(200, empty) == 100  # its fresh tuples' rows: final time >= ts + lead >= 100


def test_a_negative_lead_lowers_the_bound_of_tuples_not_yet_joined():
    # a final time before the ts (time bounds with upper < 0): an unjoined tuple's row alone may be below it
    p, empty = lone(1, lead=-30)
    assert p.bound(200, empty) == 170


def test_results_of_an_older_batch_coming_back_late_do_not_override_a_newer_floor():
    p, empty = lone(1)
    p.sent(1, 1, np.array([0]), 10, 10)  # to the supplier
    p.sent(2, 1, np.array([0]), 50, 50)  # to the consumer, after the move
    p.done(2, 1, watermark=60)
    p.done(1, 1, watermark=10)  # the supplier's results arrive last
    assert p.lone_floor[0] == 60 and p.bound(POS_INF, empty) == 60


def test_a_moving_group_keeps_its_floor_of_rows_alone_while_the_slaves_advance():
    # group 0 is held (moving): no batch lists it; the consumer's watermark is far above the group's rows
    p, empty = lone(2)
    p.sent(1, 1, np.array([0, 1]), 10, 10)
    p.done(1, 1, watermark=20)
    for seq, w in enumerate([50, 80, 110], start=2):
        p.sent(2, seq, np.array([1]), w, w)
        p.done(2, seq, watermark=w)
    assert p.bound(POS_INF, empty) == 20
    p.sent(2, 9, np.array([0, 1]), 120, 120)  # installed: the consumer's batch lists it
    assert p.bound(POS_INF, empty) == 20  # until it is back
    p.done(2, 9, watermark=115)
    assert p.bound(POS_INF, empty) == 115


def test_a_hot_key_split_lowers_its_sub_groups_to_the_floor_of_the_partition_its_rows_came_from():
    # partition 0 (the key's home) decided by 30; slots 2 and 3 (an earlier key's) by 90; the split moves rows
    # of partition 0 into them, and a batch sent before the split, back after it, must not raise them again
    p, empty = lone(4)
    p.sent(1, 1, np.array([0, 1]), 20, 20)
    p.sent(1, 2, np.array([2, 3]), 80, 80)
    p.done(1, 1, watermark=30)
    p.sent(1, 3, np.array([2, 3]), 95, 95)
    p.done(1, 2, watermark=90)
    p.rerouted([0], [2, 3])
    p.done(1, 3, watermark=100)  # sent before the split
    assert list(p.lone_floor[[2, 3]]) == [30, 30] and p.bound(POS_INF, empty) == 30
    p.sent(1, 4, np.array([0, 1, 2, 3]), 110, 110)  # after the SPLIT order on the same channel
    p.done(1, 4, watermark=105)
    assert p.bound(POS_INF, empty) == 105
    p.rerouted([2, 3], [0])  # the merge back
    assert p.lone_floor[0] == 105


def test_unused_slots_do_not_hold_the_punctuation_and_a_recovered_group_does_until_its_first_batch():
    p, empty = lone(4)  # partitions 2, 3: hot-key slots no slave holds
    p.sent(1, 1, np.array([0, 1]), 10, 10)
    p.done(1, 1, watermark=40)
    assert p.bound(POS_INF, empty) == 40
    p.may_hold(np.array([False, False, True, False]))  # a recovered run: slot 2 holds a restored group
    assert p.bound(POS_INF, empty) == NEG_INF


def test_with_several_dispatchers_each_bounds_the_rows_its_own_batches_decide():
    # dispatcher B never sent partition 1 a batch; its first one (here its STOP, answered with NEG_INF) may
    # decide rows that A's batches left: B's floor for 1 starts at NEG_INF, not at POS_INF
    a, b, empty = Punctuator(2, 5), Punctuator(2, 5), np.zeros((2, 2), dtype=np.int64)
    a.sent(1, 1, np.array([0, 1]), 10, 10)
    a.done(1, 1, watermark=50)
    b.sent(1, 1, np.array([0]), 10, 10)
    b.done(1, 1, watermark=45)
    assert a.bound(POS_INF, empty) == 50 and b.bound(POS_INF, empty) == 45
    b.sent(1, 2, np.array([0, 1]), POS_INF, POS_INF)  # B's STOP, listing every group of the slave
    assert b.bound(POS_INF, empty) == NEG_INF
    b.done(1, 2, watermark=NEG_INF)
    assert b.advance(POS_INF, empty) is None  # 45 was handed out already
    assert b.end() == POS_INF and b.end() is None  # every STOP answered: nothing more on B's stream
