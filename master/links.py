"""The master's MPI edge: it carries out the desks' effects (master/state/channels.py) and takes the slaves' words.

Everything the master does over MPI besides the result stream happens here:
the Isend of each message the desks asked for (kept with its request until the
slave's report answers it, when its buffer becomes the next one's), the
reports and the words of slaves still joining, the orders between dispatchers
(master.coordination), the start and the summaries at the end.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import time

import numpy as np
from mpi4py import MPI

from master.coordination import Orders
from master.state.channels import Channels, Send, Tell
from protocol import faults, liveness
from protocol.mpi import wait_all_started
from protocol.messages import REPORT_BYTES, TAG_DATA, TAG_JOINING, TAG_REPORT, TAG_SUMMARY, decode_report

if TYPE_CHECKING:
    from protocol.plan import Plan


class Links:
    def __init__(self, comm: MPI.Comm, index: int, k: int, channels: Channels):
        self.comm, self.index, self.channels = comm, index, channels
        #: several dispatchers (BiStream 3.2.3): the order channel between them (master.coordination)
        self.orders = Orders(comm) if k > 1 else None
        self.requests: dict[int, MPI.Request] = {}  #: rank -> the Isend of its unanswered message
        self._report = np.empty(REPORT_BYTES, dtype=np.uint8)
        self._joining = np.empty(3, dtype=np.int64)

    def perform(self, effect: Send | Tell) -> None:
        """Send a message to a slave or an order to other dispatchers."""
        if isinstance(effect, Tell):
            self.orders.send(effect.dests, effect.order, **effect.fields)
            return
        faults.jitter()
        if faults.fires(self.index, "drop"):  # a channel that loses a batch: the slave must notice
            self.channels.lost(effect.rank)
            return
        self.requests[effect.rank] = self.comm.Isend([effect.buf, MPI.BYTE], dest=effect.rank, tag=TAG_DATA)

    def reports(self) -> list[tuple[int, dict, np.ndarray]]:
        """(rank, counters, histograms) of every report waiting; one that answers a message of ours frees its
        buffer for the next message to that slave."""
        got, status = [], MPI.Status()
        while self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=TAG_REPORT, status=status):
            rank = status.Get_source()
            self.comm.Recv([self._report, MPI.BYTE], source=rank, tag=TAG_REPORT)
            counters, hist = decode_report(self._report)
            if rank in self.channels.stopping:
                liveness.forget(rank)
            if self.channels.answered(rank, counters, time.monotonic()):
                self.requests.pop(rank).Wait()  # before its buffer is built into again
            got.append((rank, counters, hist))
        return got

    def joining(self) -> list[tuple[int, int, float]]:
        """(rank, results so far, seconds the batch has taken) of every word from a slave still joining a long
        batch (protocol.messages.joining_message)."""
        got, status = [], MPI.Status()
        while self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=TAG_JOINING, status=status):
            rank = status.Get_source()
            self.comm.Recv(self._joining, source=rank, tag=TAG_JOINING)
            got.append((rank, int(self._joining[1]), int(self._joining[2]) / 1000))
        return got

    def arrived(self) -> list:
        """(source, kind, fields) of every order from another dispatcher waiting."""
        return self.orders.arrived() if self.orders else []

    def close(self) -> None:
        if self.orders:
            self.orders.close()

    # -- the start and the end of the run ------------------------------------------------------------------
    def wait_all_started(self, plan: Plan) -> list[str]:
        """Every rank's host, once all are ready; the heartbeats run from then on (protocol.liveness)."""
        return wait_all_started(self.comm, plan, lambda rank: self.channels.about(rank, time.monotonic()))

    def send_summary(self, counters: dict) -> None:
        """Another dispatcher: its counters to rank 0, which writes the summary."""
        self.comm.send(counters, dest=0, tag=TAG_SUMMARY)

    def summaries(self, k: int) -> list[dict]:
        """Rank 0: the counters of dispatchers 1..k-1 (their last word: no longer watched then)."""
        got = []
        for other in range(1, k):
            got.append(self.comm.recv(source=other, tag=TAG_SUMMARY))
            liveness.forget(other)
        return got
