"""The stall watch: a cluster whose pending work stops moving ends with a message instead of waiting forever.

Work is pending while tuples are buffered, a message to a slave is unanswered,
a move is queued or in flight, a hot key's split or merge waits, or a
checkpoint is being taken.  The master makes progress when it takes input,
sends a message or gets a report, or when a slave says it is still joining a
long batch (a hot key's billions of pairs are written in chunks and reported
at the end).  Pending work with no progress for longer than the bound means
the master waits for something that will not come (a report, an idle owner, a
move); it then names what it waits for and the job ends with a non-zero exit,
so a supervisor restarts it from its last checkpoint.  The bound
(`master.stall_timeout`, 0 = automatic) is a few distribution epochs beyond the
slowest batch a slave has taken so far.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from protocol.plan import Plan


class StallError(RuntimeError):
    """The cluster stopped making progress with work pending; the message says what it waited for."""


class StallWatch:
    def __init__(self, plan: Plan, buffers, controller, channels, coordinator: bool = True):
        """`coordinator`: rank 0, which drives the moves; another dispatcher holds a moving group's tuples and
        waits for rank 0's RELEASE, which is rank 0's work to watch, not its own."""
        self.buffers, self.controller, self.channels, self.coordinator = buffers, controller, channels, coordinator
        self.timeout = plan.master.stall_timeout
        self.epoch = plan.epochs.distribution
        self.slowest = 0.0  #: the longest a slave took over one batch so far (seconds)
        self.reports = 0  #: reports received
        self.orders = 0  #: orders received from other dispatchers (rank 0's HOLD, RELEASE, ...)
        self.joining = 0  #: words from slaves still joining a long batch (protocol.messages.joining_message)
        self._last = None  #: the progress counters seen last
        self._since = 0.0  #: when they last changed, or pending work began

    def on_report(self, batch_seconds: float | None) -> None:
        self.reports += 1
        if batch_seconds is not None:
            self.slowest = max(self.slowest, float(batch_seconds))

    def bound(self) -> float:
        """How long pending work may stand still."""
        return self.timeout or max(10.0, 8 * self.epoch) + 2 * self.slowest

    def watch(
        self, now: float, consumed: int, hot: dict, checkpoint: str, fences: str = "", subscriber_behind: bool = False
    ) -> None:
        """Raise StallError when pending work has stood still past the bound.  `consumed`: input taken;
        `hot`: hot keys waiting for their owner ({"split": .., "merge": ..}); `checkpoint`: what a checkpoint
        waits for ("" when none is being taken); `fences`: what held moves wait for (READY, earlier batches);
        `subscriber_behind`: the ordered result stream holds slaves' results back for a subscriber, which
        `output.subscriber_timeout` bounds, not this watch."""
        c = self.controller
        mine = len(self.buffers) if self.coordinator else int(self.buffers.counts[:, ~c.moving].sum())
        pending = bool(mine or self.channels.busy or (c.busy and self.coordinator) or any(hot.values()) or checkpoint)
        progress = (consumed, sum(self.channels.seq.values()), self.reports, self.orders, self.joining)
        if progress != self._last or not pending or subscriber_behind:
            self._last, self._since = progress, now
            return
        still = now - self._since
        if still <= self.bound():
            return
        lines = [
            f"stalled: no input taken, no message sent and no report for {still:.1f}s with work pending (no slave "
            f"said it was still joining)"
        ]
        if self.channels.busy:
            lines.append(f"  waiting for the report of slave(s) {sorted(self.channels.busy)} (a message is unanswered)")
        counts = self.buffers.counts.sum(axis=0)
        if counts.any():
            top = sorted(counts.nonzero()[0].tolist(), key=lambda g: -counts[g])[:8]
            lines.append(
                f"  {int(counts.sum()):,} tuples buffered, unsent; most in partition-groups "
                + ", ".join(
                    f"{g} ({int(counts[g]):,}, slave {int(c.partition_map[g])}{', moving' if c.moving[g] else ''})"
                    for g in top
                )
            )
        if c.queue:
            lines.append(f"  moves queued: {c.queue}")
        if c.in_flight:
            lines.append(f"  moves in flight (held until INSTALLED): {[m for m, *_ in c.in_flight.values()]}")
        if fences:
            lines.append(f"  held moves wait for: {fences}")
        if any(hot.values()):
            lines.append(f"  hot keys waiting for their owner to be idle: {hot}")
        if checkpoint:
            lines.append(f"  checkpoint: {checkpoint}")
        raise StallError("\n".join(lines))
