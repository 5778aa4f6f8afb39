"""Several dispatchers, one decision maker: rank 0 coordinates moves and the end of the run (BiStream 3.2.3).

Every dispatcher routes with the same partition map, so a move must change it
everywhere without losing a pair.  Rank 0 (paper 003's controller) alone
decides moves.  A group may leave its supplier only once no dispatcher has a
batch on its way to the supplier or the consumer that was sent before the group
was held: such a batch may hold tuples of the group, or carry a watermark not
capped by the held tuples (the consumer could expire installed blocks those
tuples still have to join).  So on HOLD every dispatcher holds the group's
tuples, caps its watermarks, and answers READY, with its cap, once its earlier
batches to both slaves have been joined (their reports are back); rank 0 sends
the MOVE order when every dispatcher is ready, with the lowest cap as a floor:
the consumer may hold an uncapped punctuation of some dispatcher from before
the move, which must not count above that dispatcher's held tuples.  The
consumer's INSTALLED goes to rank 0, which tells every dispatcher to RELEASE
the group to its new slave.  MPI keeps the
messages between two ranks in order, so a RELEASE never overtakes its HOLD.

Checkpoints are a Chandy-Lamport cut with k senders: rank 0, with no batch or
move in flight, snapshots its side, sends its marker (a CHECKPOINT batch) to
every slave and CHECKPOINT to the others; each does the same once its own
batches are joined and answers SNAPSHOT with its part.  A slave writes its
state when it has every dispatcher's marker and meanwhile receives nothing
from a dispatcher whose marker it has (protocol.mpi.wait_probe_any), so no
batch crosses the cut.  The manifest is written when all parts are in.

A hot key's split or merge is fenced the same way (master.state.hot_keys):
HOT_HOLD makes every other dispatcher hold the groups its tuples of the key go
to and answer HOT_READY once its earlier batches to the key's owner are joined;
rank 0 then orders SPLIT or MERGE, and on the owner's answer HOT_RELEASE makes
the others route by the new grid.  They send rank 0 their frequent-keys
counters (SKETCH), which it sums to decide.

Band and inequality joins route by key ranges (master.state.ranges): rank 0 decides
them from its first keys and sends them (RANGES); the others take no input
until they have them, so every dispatcher sends a key to the same partition.

The same channel ends the run: a dispatcher whose input is exhausted and
joined says DONE and keeps serving orders until rank 0, done too and with no
move in flight, says FINISH.  A dispatcher's ZeroMQ producers learn what a
checkpoint made durable from it: rank 0 sends each other dispatcher COMMITTED
with the source position of its part once the manifest is written.  The orders,
their fields and their encoding are protocol.orders'; no tuple data.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from protocol.messages import TAG_ORDER
from protocol import orders
from protocol.orders import Order


class Orders:
    """The order channel of one dispatcher: non-blocking sends of encoded orders, and whatever has arrived."""

    def __init__(self, comm: MPI.Comm):
        self.comm = comm
        self._sending: list[tuple[MPI.Request, np.ndarray]] = []  #: requests with their buffers

    def send(self, dests, order: Order, **fields) -> None:
        self._sending = [(r, b) for r, b in self._sending if not r.Test()]
        buf = orders.encode(order, **fields)
        for dest in dests:
            self._sending.append((self.comm.Isend([buf, MPI.BYTE], dest=dest, tag=TAG_ORDER), buf))

    def arrived(self) -> list[tuple[int, Order, dict]]:
        """(source, kind, fields) of every order waiting, in arrival order."""
        got, status = [], MPI.Status()
        while self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=TAG_ORDER, status=status):
            buf = np.empty(status.Get_count(MPI.BYTE), dtype=np.uint8)
            self.comm.Recv([buf, MPI.BYTE], source=status.Get_source(), tag=TAG_ORDER)
            got.append((status.Get_source(), *orders.decode(buf)))
        return got

    def close(self) -> None:
        MPI.Request.Waitall([r for r, _ in self._sending])
        self._sending = []
