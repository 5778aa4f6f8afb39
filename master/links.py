"""The master's MPI edge: batches and orders to slaves, their reports, orders between dispatchers.

Everything the master does over MPI besides the result stream happens here,
so the desks (master/state/) are plain classes tested with a fake of this
object.  A slave counts as busy from the send of a message until its report
answers it (paper 003, V-B: a slave still joining at its slot misses it); the
buffer of its last message is reused for the next one.  `seq` numbers the
messages on the FIFO channel to each slave (the header's `seq`,
protocol.messages), so a slave notices a lost one; it is not the distribution epoch.
"""

from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

from master.coordination import Orders
from protocol.orders import Order
from protocol import eventtime, faults, liveness
from protocol.arrays import whole_buffer
from protocol.mpi import wait_all_started
from protocol.messages import (
    REPORT_BYTES,
    TAG_DATA,
    TAG_JOINING,
    TAG_REPORT,
    TAG_SUMMARY,
    Ack,
    Kind,
    batch_message,
    decode_report,
    encode_order,
)


class Links:
    def __init__(self, comm: MPI.Comm, index: int, k: int, slaves: list[int], dtype: np.dtype):
        self.comm, self.index, self.dtype = comm, index, dtype
        #: several dispatchers (BiStream 3.2.3): the order channel between them (master.coordination)
        self.orders = Orders(comm) if k > 1 else None
        self.busy: dict[int, tuple[MPI.Request, np.ndarray]] = {}  #: rank -> (send request, its buffer)
        self.spare: dict[int, np.ndarray] = {}  #: rank -> the buffer of its last message, answered: reused
        self.seq = {r: 0 for r in slaves}  #: per slave: the sequence number of the last message on its channel
        #: per slave: (time.monotonic(), what) of the last report, for the failure detector's message
        self.last_report: dict[int, tuple[float, str]] = {}
        self.stopping: set[int] = set()  #: slaves sent STOP: their answer is their last word
        self._report = np.empty(REPORT_BYTES, dtype=np.uint8)
        self._joining = np.empty(3, dtype=np.int64)

    def is_busy(self, rank: int) -> bool:
        return rank in self.busy

    def batch(self, rank: int, watermark: float, n_r: int, n_s: int, groups: np.ndarray):
        """The next BATCH to `rank`, numbered, with room for its rows: (buffer, R rows, S rows) to fill, then
        `send`."""
        self.seq[rank] += 1
        return batch_message(self.seq[rank], watermark, n_r, n_s, self.dtype, groups, spare=self.spare.pop(rank, None))

    def order(self, rank: int, kind: Kind, watermark: int = eventtime.NONE, **fields) -> None:
        """An order without tuples (MOVE, CHECKPOINT, SPLIT, MERGE) to `rank`, under its last sequence number;
        `fields`: its named header fields (protocol.messages.encode_order)."""
        self.send(rank, encode_order(kind, self.seq[rank], watermark, **fields))

    def send(self, rank: int, buf: np.ndarray) -> None:
        """Isend a message; the slave counts as busy until its report for it arrives."""
        faults.jitter()
        if faults.fires(self.index, "drop"):  # a channel that loses a batch: the slave must notice
            self.seq[rank] += 1
            return
        self.busy[rank] = (self.comm.Isend([buf, MPI.BYTE], dest=rank, tag=TAG_DATA), buf)

    def reports(self) -> list[tuple[int, dict, np.ndarray]]:
        """(rank, counters, histograms) of every report waiting; a report that answers a message of ours (all
        but INSTALLED, the consumer's news) makes its slave idle."""
        got, status = [], MPI.Status()
        while self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=TAG_REPORT, status=status):
            rank = status.Get_source()
            self.comm.Recv([self._report, MPI.BYTE], source=rank, tag=TAG_REPORT)
            counters, hist = decode_report(self._report)
            self.last_report[rank] = (
                time.monotonic(),
                f"{Ack(int(counters['ack'])).name} report, message {int(counters['seq'])}",
            )
            if rank in self.stopping:
                liveness.forget(rank)
            if counters["ack"] != Ack.INSTALLED:
                request, buf = self.busy.pop(rank)
                request.Wait()
                self.spare[rank] = whole_buffer(buf)  # the next batch to it is built in it
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

    def stop(self) -> dict[int, int]:
        """STOP to every slave: each answers with its final report once its results are flushed.  Returns each
        slave's STOP sequence number (its answer on the result stream carries it)."""
        stops = {rank: seq + 1 for rank, seq in self.seq.items()}
        self.stopping.update(stops)
        for rank, seq in stops.items():
            buf = encode_order(Kind.STOP, seq, eventtime.POS_INF)
            self.busy[rank] = (self.comm.Isend([buf, MPI.BYTE], dest=rank, tag=TAG_DATA), buf)
        return stops

    # -- the other dispatchers (master.coordination) ------------------------------------------------------
    def tell(self, dests, order: Order, **fields) -> None:
        self.orders.send(dests, order, **fields)

    def arrived(self) -> list[tuple[int, Order, dict]]:
        return self.orders.arrived() if self.orders else []

    def close(self) -> None:
        if self.orders:
            self.orders.close()

    def state(self) -> dict:
        return {str(k): v for k, v in self.seq.items()}

    def restore(self, seq: dict) -> None:
        """Each channel's count at the checkpoint; a slave the checkpoint's run did not have starts at 0."""
        self.seq = {r: int(seq.get(str(r), 0)) for r in self.seq}

    # -- the start and the end of the run ------------------------------------------------------------------
    def wait_all_started(self, cfg: dict) -> list[str]:
        """Every rank's host, once all are ready; the heartbeats run from then on (protocol.liveness)."""
        return wait_all_started(self.comm, cfg, self.about)

    def about(self, rank: int) -> str:
        """What was last heard from slave `rank` besides heartbeats, and what it owes (a lost rank's message)."""
        said = []
        if rank in self.last_report:
            at, what = self.last_report[rank]
            said.append(f"its last report: {what}, {time.monotonic() - at:.1f}s ago")
        else:
            said.append("no report from it yet")
        if rank in self.busy:
            said.append(f"message {self.seq[rank]} to it unanswered")
        return "; ".join(said)

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
