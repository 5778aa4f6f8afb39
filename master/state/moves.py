"""The moves desk: the controller's planned moves run as paper 003's protocol (IV-C), fenced across dispatchers.

A queued move whose supplier and consumer are idle is held: the group's
tuples wait here and watermarks are capped.  With several dispatchers (BiStream
3.2.3; master.coordination) rank 0 sends HOLD, each other dispatcher answers
READY once its batches sent before the hold are joined, and rank 0 orders the
MOVE from the supplier when all are ready and the supplier is idle.  The
consumer's INSTALLED routes the group to it (RELEASE to the others), and the
tuples held meanwhile are owed to it at once.
"""

from __future__ import annotations

from dataclasses import asdict

from master.state.balance import Move
from protocol.orders import Order
from protocol.messages import Kind


class MovesDesk:
    def __init__(self, k: int, controller, stats, channels):
        self.k, self.controller, self.stats, self.channels = k, controller, stats, channels
        #: rank 0: held moves -> [move, dispatchers not yet READY, lowest watermark cap of the group's holders]
        self.unready: dict[int, list] = {}
        self.fences: dict[int, tuple[Move, set[int]]] = {}  #: others: held moves -> slaves with an earlier batch

    def waits_for(self) -> set[int]:
        """Slaves a move waits to find idle: not to be sent a batch meanwhile."""
        waiting = {r for m in self.controller.queue for r in (m.supplier, m.consumer)}
        waiting.update(m.supplier for m, *_ in self.unready.values())  # its MOVE order waits for it to be idle
        return waiting

    def waiting_for(self) -> str:
        """What the held moves wait for (the stall watch names it)."""
        ready = [f"group {p}: READY from dispatcher(s) {sorted(w)}" for p, (_, w, _) in self.unready.items() if w]
        idle = [f"group {p}: its supplier {m.supplier} to be idle" for p, (m, w, _) in self.unready.items() if not w]
        fenced = [f"group {p}: the answers of slave(s) {sorted(w)} before READY" for p, (_, w) in self.fences.items()]
        return "; ".join(ready + idle + fenced)

    def start(self, last_watermark, now: float, hold: bool = True) -> list[Move]:
        """Queued moves whose supplier and consumer are idle here are held, at every dispatcher (HOLD); each
        is ordered from its supplier (MOVE) once the others are READY and the supplier is idle.  Returns the
        moves ordered; `last_watermark(rank)`: the watermark of the last batch to `rank`.  Without `hold` (a
        checkpoint waits for quiet) no new move is held, but the held ones are still ordered: the checkpoint
        waits for them to finish."""
        idle = lambda rank: not self.channels.is_busy(rank)  # noqa: E731
        for move in self.controller.next_orders(idle, last_watermark, now) if hold else ():
            self.unready[move.partition] = [move, set(range(1, self.k)), self.controller.in_flight[move.partition][3]]
            if self.k > 1:
                self.channels.tell(range(1, self.k), Order.HOLD, **asdict(move))
        ordered = []
        for partition, (move, waiting, floor) in list(self.unready.items()):
            if waiting or self.channels.is_busy(move.supplier):
                continue
            del self.unready[partition]
            self.channels.order(move.supplier, Kind.MOVE, partition=move.partition, peer=move.consumer, floor=floor)
            ordered.append(move)
        return ordered

    def on_answer(self, rank: int) -> None:
        """`rank` answered a message: a batch sent to it before a HOLD has been joined."""
        for _, waiting in self.fences.values():
            waiting.discard(rank)

    def on_installed(self, counters: dict, now: float) -> int:
        """Rank 0: the consumer installed the group; the others RELEASE it too.  Returns the consumer."""
        move = self.controller.on_installed(int(counters["partition"]), int(counters["moved_tuples"]), now)
        self.stats.tuples_moved += int(counters["moved_tuples"])
        if self.k > 1:
            self.channels.tell(range(1, self.k), Order.RELEASE, partition=move.partition)
        self.channels.say(
            f"moved partition-group {move.partition}: slave {move.supplier} -> {move.consumer} "
            f"({int(counters['moved_tuples']):,} tuples, {move.reason})"
        )
        return move.consumer

    # -- orders from rank 0 or to it (master.coordination) --------------------------------------------------
    def on_hold(self, move: Move, last_watermark: float, now: float) -> None:
        """Another dispatcher: hold the group; its earlier batches to both slaves are the fence."""
        self.controller.hold(move, last_watermark, now)
        self.fences[move.partition] = (move, {r for r in (move.supplier, move.consumer) if self.channels.is_busy(r)})

    def on_ready(self, source: int, order: dict) -> None:
        entry = self.unready[order["partition"]]
        entry[1].discard(source)
        entry[2] = min(entry[2], order["cap"])

    def on_release(self, order: dict, now: float) -> int:
        """Another dispatcher: rank 0 saw the group installed.  Returns the consumer."""
        return self.controller.on_installed(order["partition"], 0, now).consumer

    def send_ready(self) -> None:
        """READY for the held moves whose earlier batches have all been joined."""
        for partition, (move, waiting) in list(self.fences.items()):
            if not waiting:
                del self.fences[partition]
                self.channels.tell([0], Order.READY, partition=partition, cap=self.controller.in_flight[partition][3])
