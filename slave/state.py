"""The slave's state machine: what a message from a dispatcher means, apart from receiving and doing it.

Pure (no MPI, no files, no clock of its own): it takes each message's kind, source, sequence number and
watermark, and returns what the shell (slave/run.py) must do, as dask's worker state machine returns
instructions.  It holds, per dispatcher (ranks 0..k-1; BiStream 3.2.3):

* the punctuation of its last batch: every later tuple from it has ts >= this (microseconds); blocks expire
  only below the lowest of them, since a tuple still to come from any dispatcher may need them;
* the sequence number of its last batch: MPI keeps a channel in order, so a gap means a lost batch;
* whether its checkpoint marker has come (Chandy-Lamport with k senders: until every marker is in, nothing
  more is taken from a dispatcher whose marker came, so no batch crosses the cut);
* whether it has said STOP (the run ends with the last one), and when its last batch came (the next comes a
  distribution epoch later, at the slave's slot: paper 003, V-B).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from protocol import eventtime
from protocol.messages import TAG_DATA, TAG_STATE
from protocol.waiting import next_arrival


@dataclass(frozen=True)
class Join:
    """Join the batch, expiring below `watermark` (the lowest punctuation of all dispatchers)."""

    watermark: int


@dataclass(frozen=True)
class Lost:
    """The channel from `dispatcher` lost or reordered a batch: end the job."""

    dispatcher: int
    got: int
    expected: int

    def message(self, rank: int) -> str:
        """The line slave `rank` says as it ends the job."""
        return (
            f"error: slave {rank}: batch {self.got} from dispatcher {self.dispatcher}, expected {self.expected}: "
            "the channel lost or reordered a batch"
        )


@dataclass(frozen=True)
class Acknowledge:
    """Answer `dispatcher`'s message `seq` at once (a marker or a STOP that is not the last)."""

    dispatcher: int
    seq: int


@dataclass(frozen=True)
class WriteCheckpoint:
    """Every marker of checkpoint `checkpoint` is in: flush results, write every group's state, tell rank 0."""

    checkpoint: int
    seq: int


@dataclass(frozen=True)
class Finish:
    """The last STOP: decide every row still undecided, flush everything, send the final report."""

    seq: int


class SlaveState:
    def __init__(self, dispatchers: int, epoch: float):
        self.epoch = epoch
        self.watermarks = np.full(dispatchers, eventtime.NEG_INF, dtype=np.int64)
        self.sequence = np.zeros(dispatchers, dtype=np.int64)
        self.batch_came: list[float | None] = [None] * dispatchers  #: per dispatcher, time.monotonic()
        self.marked: set[int] = set()  #: dispatchers whose marker of the checkpoint being taken has come
        self.stops = 0
        self.stopped = False  #: the last STOP is served: the shell's loop ends

    @property
    def dispatchers(self) -> int:
        return len(self.watermarks)

    def resume(self, sequences: list[int]) -> None:
        """A recovery: each channel numbers on from the checkpoint."""
        self.sequence[:] = sequences

    def on_batch(self, dispatcher: int, seq: int, watermark: int, now: float) -> Join | Lost:
        expected = int(self.sequence[dispatcher]) + 1
        if seq != expected:
            return Lost(dispatcher, seq, expected)
        self.sequence[dispatcher] = seq
        self.watermarks[dispatcher] = watermark
        self.batch_came[dispatcher] = now
        return Join(int(self.watermarks.min()))

    def on_marker(self, dispatcher: int, checkpoint: int, seq: int) -> list:
        """A checkpoint marker: another dispatcher than rank 0 is answered at once (its batches wait, rank 0
        gets CHECKPOINTED); with the last marker the part is written."""
        self.marked.add(dispatcher)
        actions: list = [Acknowledge(dispatcher, seq)] if dispatcher != 0 else []
        if len(self.marked) == self.dispatchers:
            self.marked.clear()
            actions.append(WriteCheckpoint(checkpoint, seq))
        return actions

    def on_stop(self, dispatcher: int, seq: int) -> Acknowledge | Finish:
        """A dispatcher has no more input: no tuple will come from it (its punctuation is +inf); the last STOP
        ends the run."""
        self.stops += 1
        if self.stops < self.dispatchers:
            self.watermarks[dispatcher] = eventtime.POS_INF
            return Acknowledge(dispatcher, seq)
        self.stopped = True
        return Finish(seq)

    def on_state(self, floor: int) -> None:
        """A moved group arrives: a dispatcher's last punctuation here may lie above tuples of the group it
        still holds (they were bound for the supplier), so until each sends again none counts above the
        move's floor."""
        self.watermarks = np.minimum(self.watermarks, floor)

    def channels(self, any_source: int, any_tag: int) -> list[tuple[int, int]]:
        """The (source, tag) that may be received now: anything, or while a checkpoint's markers come in, group
        states and the batches of dispatchers whose marker has not come yet."""
        if not self.marked:
            return [(any_source, any_tag)]
        return [(any_source, TAG_STATE)] + [(d, TAG_DATA) for d in range(self.dispatchers) if d not in self.marked]

    def next_batch(self, now: float) -> float | None:
        """When the next batch should come: a whole number of epochs after each dispatcher's last."""
        return next_arrival(self.batch_came, self.epoch, now)
