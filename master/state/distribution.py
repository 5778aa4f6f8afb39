"""The distribution desk: one slot per sub-group of slaves in every distribution epoch (paper 003, V-B).

At its slot a slave that has finished its previous batch gets the drained
mini-buffers of its partitions in one message; a slave still busy misses the
slot and keeps accumulating, which is the back-pressure that bounds the work
in flight.  A slave that missed its slot is served as soon as it is idle, if
the loop's rule (`may_serve`) lets it.  Each batch carries the watermark the
slave may expire by (BiStream, Theorem 1), capped while moves are in flight.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import numpy as np

from master.state.ranges import every_key
from protocol import eventtime

if TYPE_CHECKING:
    from protocol.plan import Plan


class DistributionDesk:
    def __init__(
        self,
        plan: Plan,
        slaves: list[int],
        buffers,
        controller,
        stats,
        channels,
        sent=lambda rank, seq, partitions, r, s, frontier: None,
        spans: Callable[[np.ndarray], np.ndarray] = every_key,
    ):
        """`sent(...)`: told of each batch (the result stream's punctuation, master.result_stream);
        `spans(partitions)`: per stream the (first, last) keys whose home each partition is (IngestDesk.spans),
        for the group table."""
        self.plan, self.buffers, self.controller, self.stats = plan, buffers, controller, stats
        self.channels, self.sent, self.spans = channels, sent, spans
        groups = min(plan.partitioning.subgroups, len(slaves))
        self.subgroups = [slaves[g::groups] for g in range(groups)]
        self.next_group = 0
        self.epochs_done = 0  #: distribution epochs completed (every sub-group served once)
        self.sent_watermark = {r: eventtime.NEG_INF for r in slaves}  #: the watermark of the last batch to each slave
        self.in_batch = dict.fromkeys(slaves, 0)  #: tuples of the batch each slave is joining
        #: serve a batch even without news: the input's end is held for a test's fault that counts a slave's
        #: batches (master.sources.HeldEnd), which would else never come after the input's last tuples
        self.empty_batches = False
        #: slaves owed a batch before their next slot: they were still joining at their last one, or a group
        #: whose tuples the master held during its move was just installed on them
        self.missed: set[int] = set()

    def slot(self, frontier: float, now: float, serve: bool = True) -> bool:
        """The next sub-group's slot (served unless `serve` is false); True when it ends a distribution epoch."""
        if serve:
            self.distribute(self.subgroups[self.next_group], frontier, now)
        self.next_group = (self.next_group + 1) % len(self.subgroups)
        if self.next_group == 0:
            self.epochs_done += 1
        return self.next_group == 0

    def distribute(self, group: list[int], frontier: float, now: float) -> None:
        """Serve one sub-group: every idle slave in it gets its partitions' tuples in one message; a slave
        still joining its last batch is owed one as soon as it reports (`serve_missed`)."""
        for rank in group:
            if self.channels.is_busy(rank):  # still joining its last batch: all of it and what waits here is unjoined
                mine = self.controller.partitions_of(rank)
                self.controller.on_slot(rank, self.in_batch[rank] + int(self.buffers.counts[:, mine].sum()))
                self.stats.per_slave[rank]["slots_missed"] += 1
                self.missed.add(rank)
                continue
            self.controller.on_slot(rank, 0)
            self.serve(rank, frontier, now)

    def owe(self, rank: int) -> None:
        """`rank` is owed a batch now (e.g. the consumer of a move, for the tuples held during it)."""
        self.missed.add(rank)

    def serve_missed(self, may_serve: Callable[[int], bool], frontier: float, now: float) -> None:
        """Send each slave that missed its slot its batch as soon as it is idle, instead of a whole
        distribution epoch later: its tuples have waited their epoch already, and the slave would sit idle
        until its next slot.  One the rule `may_serve` holds back waits for its next slot."""
        for rank in sorted(self.missed):
            if not self.channels.is_busy(rank):
                self.missed.discard(rank)
                if may_serve(rank):
                    self.serve(rank, frontier, now)

    def handed_over(self, rank: int) -> None:
        """`rank` was ordered to move a group out: it joins no batch meanwhile."""
        self.in_batch[rank] = 0

    def serve(self, rank: int, frontier: float, now: float) -> None:
        """Send the idle slave `rank` its partitions' buffered tuples in one message, if there is news;
        `frontier`: the watermark of what was ingested; `now`: wall-clock seconds."""
        watermark = min(frontier, self.controller.watermark_cap())
        mine = self.controller.partitions_of(rank)
        sizes = self.buffers.counts[:, mine].sum(axis=0)
        if len(mine) == 0 or (not sizes.any() and watermark <= self.sent_watermark[rank] and not self.empty_batches):
            return  # nothing new: no tuples and no punctuation that would let the slave expire blocks
        self.sent_watermark[rank] = watermark
        self.controller.on_batch(mine, sizes)
        # which rows belong to which group: copies (key ranges, hot-key grids) cannot be told apart otherwise,
        # and the slave need not hash and sort the batch again to find its groups; with each group the keys whose
        # home it is, so a full join's slave tells a tuple from its guest copies (slave.join)
        counts = self.buffers.counts[:, mine]
        nonempty = counts.any(axis=0)
        groups = np.column_stack([mine[nonempty], counts[0, nonempty], counts[1, nonempty], self.spans(mine[nonempty])])
        n_r, n_s = counts.sum(axis=1).tolist()
        # a tuple waits at most one epoch for its slave's slot; longer means the cluster is behind, even while
        # the mini-buffers still have room (ingest, and so the pacing lag, is held back only once they are full)
        waited = now - self.buffers.oldest_arrival(mine) - self.plan.epochs.distribution
        self.stats.backlog_max = max(self.stats.backlog_max, waited)
        buf, r, s = self.channels.batch(rank, watermark, n_r, n_s, groups)
        self.buffers.drain(mine, out=(r, s))
        self.in_batch[rank] = n_r + n_s
        self.sent(rank, self.channels.seq[rank], mine, r, s, frontier)
        self.channels.send(rank, buf)

    def state(self) -> dict:
        return {"epochs_done": self.epochs_done, "sent_watermark": {str(k): v for k, v in self.sent_watermark.items()}}

    def restore(self, m: dict) -> None:
        """The checkpoint's epochs and watermarks; taken on other slaves, each slave of this run counts as sent
        the lowest of them (its groups come from slaves that were sent any of them)."""
        self.epochs_done = m["epochs_done"]
        sent = {int(k): v for k, v in m["sent_watermark"].items()}
        lowest = min(sent.values(), default=eventtime.NEG_INF)
        self.sent_watermark = (
            sent if sent.keys() == self.sent_watermark.keys() else dict.fromkeys(self.sent_watermark, lowest)
        )
