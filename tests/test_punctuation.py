"""protocol/punctuation.py: the result stream's punctuation bound, as pure bookkeeping."""
from __future__ import annotations

import numpy as np

from protocol.eventtime import NEG_INF, POS_INF
from protocol.punctuation import Punctuator


def test_bound_is_the_min_of_future_buffered_and_outstanding():
    p = Punctuator(4)
    counts = np.zeros((2, 4), dtype=np.int64)
    assert p.bound(10, counts) == 10             # nothing buffered or in flight: only future tuples
    counts[1, 2] = 5
    assert p.bound(10, counts) == NEG_INF          # partition 2 has tuples and was never drained
    p.sent(1, 1, np.array([2, 3]), min_ts=4, floor_now=7)
    assert p.bound(10, counts) == 4              # batch (1, 1) still out, its oldest tuple is 4
    p.done(1, 1)
    assert p.bound(10, counts) == 7              # partition 2 buffered since a drain at floor 7
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
