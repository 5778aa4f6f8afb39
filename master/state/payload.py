"""The payload desk: the payload log's segments that no result can need any more are removed as the run goes.

With declared streams every row's own columns wait in the payload log (protocol.payload) until a result
gathers them.  A row of R with time t has its last partner at t + upper and is decided alone (outer joins)
once the watermark passes t + upper (slave.window: the expiry rule); a row of S likewise at t - lower.  So a
row is done with once every slave has answered a batch whose watermark W lies above both its own time (it was
sent: BiStream's punctuation) and that bound: a segment goes when all its rows are done with and every
dispatcher has taken them all in (late rows gather their columns when taken).

A slave's `done` is the watermark of the last message it answered (the batch is joined, its results written
with their columns); only slaves holding a partition-group count.  A moved group's rows are decided up to
its supplier's floor (the watermark of the last batch to it) until the consumer installs it, and then until
the consumer answers again.  A recovery replays from the newest complete checkpoint whose state
still holds undecided rows: the log keeps what any kept checkpoint's cut needs (the smallest `done` at its
cut, from the moment it is taken).  Before the first checkpoint a restart reads the input again from its
start and writes the log anew.

With several dispatchers (BiStream 3.2.3) a slave's watermark is the smallest of theirs: each keeps this desk
for its own batches (a move's floor from its HOLD, the install from RELEASE) and tells rank 0 its watermark
and rows taken (PAYLOAD) when they change, at most once a slot; rank 0 removes segments by the smallest of
all.  A report may be old, never above what the dispatcher's state allows now: its watermark falls only at an
install, below the move's floor that its reports were already under.  Dispatchers that share Kafka partitions
out each write only their own rows' segments (protocol.payload.ROW_BLOCK): rank 0 removes its own and tells
the others the times below which theirs may go (PRUNE); each removes those of its rows it has taken.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from collections import deque

from protocol import eventtime

if TYPE_CHECKING:
    from protocol.plan import Plan


class PayloadDesk:
    def __init__(self, plan: Plan, index: int, slaves: list[int]):
        """`index`: the dispatcher's."""
        lower, upper = plan.join.bounds
        #: per side: how far after a row's own time its last partner may lie (never below its own time)
        self.reach = (max(0, upper), max(0, -lower))
        self.done = {rank: eventtime.NEG_INF for rank in slaves}  #: per slave: the watermark it answered last
        self.moving: dict[int, int] = {}  #: partition-groups on their way to a consumer: their floors
        #: the smallest `done` at each kept complete checkpoint's cut (a recovery may start from any of them)
        self.kept: deque = deque(maxlen=max(1, plan.checkpoint.keep))
        self.open: int | None = None  #: the cut of the checkpoint being taken
        #: rank 0: the other dispatchers' last reports, (watermark, rows taken per side); none yet: nothing
        self.others = {d: (eventtime.NEG_INF, (0, 0)) for d in range(1, plan.cluster.dispatchers * (index == 0))}
        self.reported = None  #: another dispatcher: what it told rank 0 last
        self.pruned: list[int] | None = None  #: rank 0: the bounds it told the others last (PRUNE)

    def on_answer(self, rank: int, watermark: int) -> None:
        """`rank` answered the message it was sent last, under `watermark` (its last batch's)."""
        self.done[rank] = watermark

    def on_move(self, partition: int, floor: int) -> None:
        """Group `partition` leaves its supplier, decided up to `floor` (the watermark of the last batch to the
        supplier): until its consumer installs it, nothing it may still need is done with."""
        self.moving[partition] = floor

    def on_installed(self, partition: int, consumer: int) -> None:
        """`consumer` installed group `partition`, decided up to the move's floor until it answers again."""
        self.done[consumer] = min(self.done[consumer], self.moving.pop(partition, eventtime.NEG_INF))

    def watermark(self, holders) -> int:
        """Below what every row that a slave holding a group (`holders`), or about to, is done with, as far
        as this dispatcher's batches go; with rank 0, the others' as they last reported."""
        own = min([self.done[r] for r in holders] + list(self.moving.values()), default=eventtime.NEG_INF)
        return min([own] + [w for w, _ in self.others.values()])

    def report(self, taken: tuple[int, int], holders) -> dict | None:
        """Another dispatcher: its PAYLOAD report for rank 0 if it changed since the last, else None."""
        now = {"watermark": self.watermark(holders), "taken": tuple(taken)}
        if now == self.reported:
            return None
        self.reported = now
        return now

    def on_report(self, dispatcher: int, watermark: int, taken) -> None:
        """Rank 0: another dispatcher's PAYLOAD report."""
        self.others[dispatcher] = (watermark, tuple(taken))

    def cut(self, holders) -> int:
        """What the checkpoint being taken now needs kept (the cut is quiet).  It holds from now on: the slaves
        may answer later batches before the checkpoint is complete."""
        self.open = self.watermark(holders)
        return self.open

    def on_commit(self, cut: int) -> None:
        """A checkpoint taken at `cut` is complete; the oldest beyond `checkpoint.keep` is gone."""
        self.kept.append(cut)
        self.open = None

    def restore(self, cuts: list[int]) -> None:
        """A recovery: the cuts of the complete checkpoints on disk, oldest first."""
        self.kept.extend(cuts)

    def prune(self, released: list[tuple[int, int, int]]) -> list[int] | None:
        """Rank 0, dispatchers writing their own rows: the bounds of `released` (`release`) per side for the
        others' PRUNE, if they changed since the last."""
        below = [b for _, _, b in released]
        if not below or below == self.pruned:
            return None
        self.pruned = below
        return below

    def release(self, taken: tuple[int, int], holders) -> list[tuple[int, int, int]]:
        """Rank 0: what the payload log may remove, per side (side, rows taken in by every dispatcher, the time
        its rows' last partner lies below): protocol.payload.PayloadLog.release, done by the shell.  `taken`:
        per side, the rows it has taken in; `holders`: the slaves holding a partition-group (one that holds
        none needs nothing)."""
        w = min([self.watermark(holders), *self.kept, *([] if self.open is None else [self.open])])
        if w == eventtime.NEG_INF:
            return []
        taken = [min([taken[side]] + [t[side] for _, t in self.others.values()]) for side in (0, 1)]
        return [(side, taken[side], w - self.reach[side]) for side in (0, 1)]
