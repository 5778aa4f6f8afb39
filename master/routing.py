"""How the master's loop routes what comes to it (paper 003, IV-C; BiStream 3.2.3): each slave report by what
it answers (`Ack`) and each order from another dispatcher by its kind (protocol.orders.Order) to the desks'
handlers.  A part of the Master class (master/run.py), apart so that the loop reads as the loop.
"""

from __future__ import annotations

import time

from master.state.balance import Move
from protocol.messages import Ack
from protocol.orders import Order


class Routing:
    def _routes(self) -> None:
        """The tables: what each report answers -> its handlers (any other ack answers a batch or an order of
        ours); each order's kind -> its handler."""
        self.on_ack = {Ack.INSTALLED: (self._installed,), Ack.CHECKPOINTED: (self._checkpointed, self._answered)}
        if self.hot is not None:  # rank 0 with several dispatchers: a fenced split or merge is done
            for ack in (Ack.SPLIT, Ack.MERGED):
                self.on_ack[ack] = (self._answered, lambda rank, c: self.hot.on_regrouped(int(c["partition"])))
        self.on_order = {
            Order.HOLD: self._hold,
            Order.READY: self.moves.on_ready,
            Order.RELEASE: self._release,
            Order.CHECKPOINT: self.checkpoints.on_order,
            Order.SNAPSHOT: self._snapshot,
            Order.DONE: lambda source, _: self.done_from.add(source),
            Order.FINISH: self._finish,
            Order.RANGES: lambda source, order: self.ingest.use_ranges(order["bounds"]),
            Order.COMMITTED: lambda source, order: self.checkpoints.on_commit(order),
            Order.PAYLOAD: lambda source, order: self.payload.on_report(source, order["watermark"], order["taken"]),
            Order.PRUNE: lambda source, order: self._prune(order["below"]),
            Order.HOT_HOLD: lambda source, order: self.hot.on_hold(source, order),
            Order.HOT_READY: lambda source, order: self.hot.on_ready(source, order),
            Order.HOT_RELEASE: lambda source, order: self.distribution.owe(self.hot.on_release(order)),
            Order.SKETCH: lambda source, order: self.hot.on_sketch(source, order),
        }

    def _route_reports(self) -> int:
        """Every waiting slave report to its ack's handlers (`on_ack`); returns how many came."""
        for rank, results, seconds in self.links.joining():
            self.stall.joining += 1
            self.stats.joining[rank] = (results, seconds)
        reports = self.links.reports()
        for rank, counters, hist in reports:
            self.stats.add_report(rank, counters, hist)
            self.stall.on_report(counters["busy"])
            for handle in self.on_ack.get(Ack(int(counters["ack"])), (self._answered,)):
                handle(rank, counters)
        return len(reports)

    def _answered(self, rank: int, counters: dict) -> None:
        self.controller.on_work(rank, int(counters["tuples_r"] + counters["tuples_s"]), counters["busy"])
        self.moves.on_answer(rank)
        if self.hot is not None:
            self.hot.on_answer(rank)
        if self.payload is not None:
            self.payload.on_answer(rank, self.distribution.sent_watermark[rank])

    def _checkpointed(self, rank: int, counters: dict) -> None:
        self.checkpoints.on_checkpointed(rank, counters, time.time())

    def _snapshot(self, source: int, order: dict) -> None:
        self.checkpoints.on_snapshot(source, order, time.time())

    def _installed(self, rank: int, counters: dict) -> None:
        """Not an answer to a message of ours: the consumer's news; the group's held tuples go out at once."""
        consumer = self.moves.on_installed(counters, time.time())
        self.distribution.owe(consumer)
        if self.payload is not None:
            self.payload.on_installed(int(counters["partition"]), consumer)

    def _committed(self, section: dict) -> None:
        """A checkpoint is complete: producers learn what it made durable, the payload log what it must keep."""
        self.intake.committed(section)
        if self.payload is not None and self.index == 0:
            self.payload.on_commit(section["payload_cut"])

    def _route_orders(self) -> None:
        """Every order from another dispatcher to its kind's handler (`on_order`), then READY where due."""
        for source, kind, order in self.links.arrived():
            self.stall.orders += 1
            self.on_order[kind](source, order)
        self.moves.send_ready()

    def _hold(self, source: int, order: dict) -> None:
        move = Move(**order)
        self.moves.on_hold(move, self.distribution.sent_watermark[move.supplier], time.time())
        if self.payload is not None:
            self.payload.on_move(move.partition, self.distribution.sent_watermark[move.supplier])

    def _release(self, source: int, order: dict) -> None:
        consumer = self.moves.on_release(order, time.time())
        self.distribution.owe(consumer)
        if self.payload is not None:
            self.payload.on_installed(order["partition"], consumer)

    def _payload(self) -> None:
        """Rank 0 removes the payload log's segments no result can still need; another dispatcher tells it how
        far its own batches are done with (master.state.payload)."""
        holders = self.controller.holders()
        if self.index == 0:
            released = self.payload.release(self.source.rows_taken, holders)
            for side, taken, below in released:
                self.source.log.release(side, taken, below)
            if self.source.own_rows and (below := self.payload.prune(released)) is not None:
                self.channels.tell(range(1, self.k), Order.PRUNE, below=below)
        elif (report := self.payload.report(self.source.rows_taken, holders)) is not None:
            self.channels.tell([0], Order.PAYLOAD, **report)

    def _prune(self, below: list[int]) -> None:
        """Rank 0 says which times no result needs any more: this dispatcher's own segments of them go."""
        for side, bound in enumerate(below):
            self.source.log.release(side, self.source.rows_taken[side], bound)

    def _finish(self, source: int, order: dict) -> None:
        self.finished = True
