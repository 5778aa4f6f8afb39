"""The master's channels as pure state, and the effects the desks ask for (dask's SchedulerState model).

The desks decide; the shell (master/links.py, master/run.py) carries out.  A
desk asks for a message to a slave, an order to another dispatcher, a line for
the operator or a checkpoint file through this object, which only records it
as an effect; the loop takes the effects after each step and performs them in
order.  What the desks must know at once is kept here: a slave counts as busy
from the message sent to it until its report answers it (paper 003, V-B: a
slave still joining at its slot misses it), and `seq` numbers the messages on
the FIFO channel to each slave (the header's `seq`, protocol.messages) so that
a slave notices a lost one; it is not the distribution epoch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from protocol import eventtime
from protocol.arrays import whole_buffer
from protocol.messages import Ack, Kind, batch_message, encode_order
from protocol.orders import Order


@dataclass(frozen=True)
class Send:
    """A message to slave `rank` on its channel, answered by its report."""

    rank: int
    buf: np.ndarray


@dataclass(frozen=True)
class Tell:
    """An order to other dispatchers (BiStream 3.2.3; protocol.orders)."""

    dests: tuple[int, ...]
    order: Order
    fields: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Say:
    """A line for the operator (standard error)."""

    line: str


@dataclass(frozen=True)
class WritePart:
    """The master's part of a checkpoint, written atomically in `directory` (a new one if `fresh`: an unfinished
    attempt of a crashed run is replaced)."""

    directory: Path
    name: str
    data: bytes
    fresh: bool


@dataclass(frozen=True)
class WriteManifest:
    """The manifest that makes a checkpoint complete (protocol.checkpoint.write_manifest)."""

    directory: Path
    manifest: dict


@dataclass(frozen=True)
class Publish:
    """Staged partial aggregates below each slave's committed count (all, with None) made final for the merger
    (protocol.checkpoint.publish_aggregates)."""

    output: Path
    counts: dict | None


@dataclass(frozen=True)
class Prune:
    """Checkpoints older than the `keep` newest complete ones removed (protocol.checkpoint.prune)."""

    root: Path
    keep: int


class Channels:
    def __init__(self, slaves: list[int], dtype: np.dtype):
        self.dtype = dtype
        self.seq = {r: 0 for r in slaves}  #: per slave: the sequence number of the last message on its channel
        self.busy: dict[int, np.ndarray] = {}  #: rank -> the buffer of its unanswered message
        self.spare: dict[int, np.ndarray] = {}  #: rank -> the buffer of its last message, answered: reused
        self.stopping: set[int] = set()  #: slaves sent STOP: their answer is their last word
        #: per slave: (monotonic time, what) of the last report, for a lost rank's message
        self.last_report: dict[int, tuple[float, str]] = {}
        self.effects: list = []

    def take(self) -> list:
        """The effects asked for since the last take, in order."""
        effects, self.effects = self.effects, []
        return effects

    def is_busy(self, rank: int) -> bool:
        return rank in self.busy

    def batch(self, rank: int, watermark: int, n_r: int, n_s: int, groups: np.ndarray):
        """The next BATCH to `rank`, numbered, with room for its rows: (buffer, R rows, S rows) to fill, then
        `send`."""
        self.seq[rank] += 1
        return batch_message(self.seq[rank], watermark, n_r, n_s, self.dtype, groups, spare=self.spare.pop(rank, None))

    def order(self, rank: int, kind: Kind, watermark: int = eventtime.NONE, **fields) -> None:
        """An order without tuples (MOVE, CHECKPOINT, SPLIT, MERGE) to `rank`, under its last sequence number;
        `fields`: its named header fields (protocol.messages.encode_order)."""
        self.send(rank, encode_order(kind, self.seq[rank], watermark, **fields))

    def send(self, rank: int, buf: np.ndarray) -> None:
        """A message to `rank`; it counts as busy until its report for it arrives."""
        self.busy[rank] = buf
        self.effects.append(Send(rank, buf))

    def lost(self, rank: int) -> None:
        """The channel lost the message just sent to `rank` (a fault): the slave must notice the gap."""
        self.busy.pop(rank)
        self.seq[rank] += 1

    def tell(self, dests, order: Order, **fields) -> None:
        self.effects.append(Tell(tuple(dests), order, fields))

    def say(self, line: str) -> None:
        self.effects.append(Say(line))

    def write(self, effect: WritePart | WriteManifest | Publish | Prune) -> None:
        self.effects.append(effect)

    def answered(self, rank: int, counters: dict, now: float) -> bool:
        """A report from `rank`: true when it answers a message of ours (all but INSTALLED, the consumer's
        news), which makes the slave idle and its message's buffer the next one's."""
        self.last_report[rank] = (now, f"{Ack(int(counters['ack'])).name} report, message {int(counters['seq'])}")
        if counters["ack"] == Ack.INSTALLED:
            return False
        self.spare[rank] = whole_buffer(self.busy.pop(rank))
        return True

    def stop(self) -> dict[int, int]:
        """STOP to every slave: each answers with its final report once its results are flushed.  Returns each
        slave's STOP sequence number (its answer on the result stream carries it)."""
        stops = {rank: seq + 1 for rank, seq in self.seq.items()}
        self.stopping.update(stops)
        for rank, seq in stops.items():
            self.send(rank, encode_order(Kind.STOP, seq, eventtime.POS_INF))
        return stops

    def about(self, rank: int, now: float) -> str:
        """What was last heard from slave `rank` besides heartbeats, and what it owes (a lost rank's message)."""
        if rank in self.last_report:
            at, what = self.last_report[rank]
            said = [f"its last report: {what}, {now - at:.1f}s ago"]
        else:
            said = ["no report from it yet"]
        if rank in self.busy:
            said.append(f"message {self.seq[rank]} to it unanswered")
        return "; ".join(said)

    def state(self) -> dict:
        return {str(k): v for k, v in self.seq.items()}

    def restore(self, seq: dict) -> None:
        """Each channel's count at the checkpoint; a slave the checkpoint's run did not have starts at 0."""
        self.seq = {r: int(seq.get(str(r), 0)) for r in self.seq}
