"""The slave's state machine (slave/state.py) fed sequences of messages in-process, the awkward orders among
them: markers of two dispatchers interleaved with batches, a move arriving during a checkpoint, a stop while
another dispatcher still sends, a batch lost on one channel."""

from __future__ import annotations

import pytest

from protocol import eventtime
from protocol.messages import TAG_DATA, TAG_STATE
from slave.state import Acknowledge, Finish, Join, Lost, SlaveState, WriteCheckpoint

ANY_SOURCE, ANY_TAG = -1, -2


def test_a_batch_expires_below_the_lowest_punctuation_of_all_dispatchers():
    s = SlaveState(2, 0.25)
    assert s.on_batch(0, 1, 500, now=1.0) == Join(eventtime.NEG_INF)  # dispatcher 1 has sent nothing yet
    assert s.on_batch(1, 1, 300, now=1.1) == Join(300)
    assert s.on_batch(0, 2, 900, now=1.25) == Join(300)
    assert s.on_batch(1, 2, 1000, now=1.35) == Join(900)


def test_a_gap_on_one_channel_is_a_lost_batch_and_others_go_on():
    s = SlaveState(2, 0.25)
    s.on_batch(0, 1, 10, 0.0)
    assert s.on_batch(1, 1, 10, 0.0) == Join(10)
    assert s.on_batch(0, 3, 20, 0.1) == Lost(0, got=3, expected=2)
    assert s.on_batch(1, 1, 30, 0.1) == Lost(1, got=1, expected=2)  # a batch twice is no better
    line = Lost(0, got=3, expected=2).message(rank=1)
    assert line == "error: slave 1: batch 3 from dispatcher 0, expected 2: the channel lost or reordered a batch"


def test_a_recovery_numbers_on_from_the_checkpoint():
    s = SlaveState(2, 0.25)
    s.resume([41, 7])
    assert s.on_batch(0, 42, 10, 0.0) == Join(eventtime.NEG_INF) and s.on_batch(1, 8, 10, 0.0) == Join(10)


def test_the_cut_waits_for_every_marker_and_takes_nothing_from_a_dispatcher_whose_marker_came():
    s = SlaveState(2, 0.25)
    assert s.channels(ANY_SOURCE, ANY_TAG) == [(ANY_SOURCE, ANY_TAG)]
    assert s.on_marker(1, checkpoint=5, seq=3) == [Acknowledge(1, 3)]  # the other dispatcher may go on
    assert s.channels(ANY_SOURCE, ANY_TAG) == [(ANY_SOURCE, TAG_STATE), (0, TAG_DATA)]
    assert s.on_batch(0, 1, 50, 0.0) == Join(eventtime.NEG_INF)  # rank 0's batch before its marker: taken
    assert s.on_marker(0, checkpoint=5, seq=1) == [WriteCheckpoint(5, 1)]  # rank 0 gets CHECKPOINTED
    assert s.channels(ANY_SOURCE, ANY_TAG) == [(ANY_SOURCE, ANY_TAG)]
    assert s.on_marker(0, checkpoint=6, seq=1) == [] and s.on_marker(1, 6, 3) == [
        Acknowledge(1, 3),
        WriteCheckpoint(6, 3),
    ]


def test_a_moved_group_arriving_during_a_checkpoint_lowers_every_punctuation_to_its_floor():
    s = SlaveState(2, 0.25)
    s.on_batch(0, 1, 800, 0.0)
    s.on_batch(1, 1, 700, 0.0)
    s.on_marker(0, 9, 1)
    assert (ANY_SOURCE, TAG_STATE) in s.channels(ANY_SOURCE, ANY_TAG)  # a group's state still comes in
    s.on_state(floor=600)
    assert s.on_marker(1, 9, 1) == [Acknowledge(1, 1), WriteCheckpoint(9, 1)]
    assert s.on_batch(1, 2, 900, 0.1) == Join(600)  # dispatcher 0 has not sent again: its floor holds


def test_a_stop_of_one_dispatcher_while_another_sends_ends_nothing_but_its_punctuation():
    s = SlaveState(2, 0.25)
    s.on_batch(0, 1, 100, 0.0)
    s.on_batch(1, 1, 200, 0.0)
    assert s.on_stop(0, 2) == Acknowledge(0, 2) and not s.stopped
    assert s.on_batch(1, 2, 300, 0.1) == Join(300)  # dispatcher 0 holds nothing back any more
    assert s.on_stop(1, 3) == Finish(3) and s.stopped


def test_the_next_batch_is_due_a_whole_number_of_epochs_after_the_last():
    s = SlaveState(1, 0.25)
    assert s.next_batch(10.0) is None
    s.on_batch(0, 1, 0, now=10.0)
    assert s.next_batch(10.1) == pytest.approx(10.25)
    assert s.next_batch(10.3) == pytest.approx(10.5)  # the slot passed without a batch: the one after
