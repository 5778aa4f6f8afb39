"""The slave's shell: receive a dispatcher's message, let the state machine (slave/state.py) say what it means,
do it (slave/joining.py), report.

Besides batches it serves the two halves of a partition-group move (paper 003, IV-C): as supplier, on the
master's MOVE order it sends the group's state to the consumer; as consumer, it installs a state that arrives
and tells the master.  On a checkpoint it flushes its results and writes every group's state
(protocol.checkpoint); on a recovery it starts from that state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import sys
import time

import numpy as np
from mpi4py import MPI

from protocol import faults
from protocol.arrays import whole_buffer
from protocol.errors import SinkError
from protocol.lifetime import CHANNEL, SINK, USER_ERROR, ignore_stop_signals
from protocol.messages import TAG_JOINING, TAG_REPORT, TAG_STATE, Ack, Kind, decode_head
from protocol.mpi import receive_start, recv_bytes, wait_all_started, wait_probe_any
from protocol.startup import pss_bytes
from slave.joining import Joiner
from slave.state import Acknowledge, Finish, Join, Lost, SlaveState, WriteCheckpoint

if TYPE_CHECKING:
    from protocol.plan import Plan


class Slave:
    def __init__(self, comm: MPI.Comm, plan: Plan):
        self.comm, self.dtype = comm, plan.dtype
        self.state = SlaveState(plan.cluster.dispatchers, plan.epochs.distribution)
        self.work = Joiner(comm, plan, self.dtype)
        self.outgoing: list[tuple[MPI.Request, object]] = []  #: reports and group states on their way (request, buffer)
        self.inbox: np.ndarray | None = None  #: the buffer batches are received into (serve)
        self.on_message = {kind: getattr(self, f"on_{kind.name.lower()}") for kind in Kind}  #: Kind -> on_<kind>

    def send(self, buf, dest: int, tag: int) -> None:
        """Isend `buf`, kept until it is sent."""
        self.outgoing.append((self.comm.Isend(buf, dest=dest, tag=tag), buf))

    def report(self, dest: int, counters: dict, hists: np.ndarray | None = None) -> None:
        """A report to dispatcher `dest`; it fits the eager limit (protocol.messages.REPORT_BYTES): the Isend
        completes without the master."""
        started = time.perf_counter()
        self.send(self.work.report(counters, hists), dest, TAG_REPORT)
        self.work.comm_seconds += time.perf_counter() - started

    def on_batch(self, source: int, head, buf: np.ndarray, seen: float) -> None:
        action = self.state.on_batch(source, int(head["seq"]), int(head["watermark"]), seen)
        if isinstance(action, Lost):
            print(action.message(self.comm.rank), file=sys.stderr, flush=True)
            self.comm.Abort(CHANNEL)
        assert isinstance(action, Join)
        faults.at_batch(self.comm.rank, after_checkpoint=self.work.parts_written >= 2)
        say = lambda word: self.send(word, source, TAG_JOINING)  # noqa: E731
        counters, hists = self.work.join(source, head, buf, action.watermark, say)
        self.report(source, {**counters, "ack": Ack.BATCH}, hists)

    def on_move(self, source: int, head, buf: np.ndarray, seen: float) -> None:
        """Supplier side: extract the group, send its state to the consumer, tell the master."""
        state, counters = self.work.hand_over(head)
        self.send([state, MPI.BYTE], int(head["peer"]), TAG_STATE)
        self.report(source, {**counters, "ack": Ack.MOVED})

    def on_state(self, buf: np.ndarray) -> None:
        """Consumer side: install a group's state, then tell the coordinator it may route the group here."""
        floor, counters = self.work.take_over(buf)
        self.state.on_state(floor)
        self.work.installed(int(self.state.watermarks.min()))
        self.report(0, {**counters, "ack": Ack.INSTALLED})

    def on_checkpoint(self, source: int, head, buf: np.ndarray, seen: float) -> None:
        for action in self.state.on_marker(source, int(head["checkpoint"]), int(head["seq"])):
            if isinstance(action, Acknowledge):
                self.report(action.dispatcher, {"seq": action.seq, "ack": Ack.BATCH})
            elif isinstance(action, WriteCheckpoint):
                say = lambda word: self.send(word, 0, TAG_JOINING)  # noqa: E731
                try:
                    counters = self.work.write_checkpoint(action.checkpoint, say)
                except SinkError as e:  # the broker took no row for output.kafka.timeout (docs/operating.md)
                    print(f"error: slave {self.comm.rank}: kafka sink: {e}", file=sys.stderr, flush=True)
                    self.comm.Abort(SINK)
                self.report(0, {"seq": action.seq, "ack": Ack.CHECKPOINTED, **counters})

    def on_split(self, source: int, head, buf: np.ndarray, seen: float) -> None:
        """SPLIT a hot key out of its partition-group into its grid of sub-groups, or MERGE the grid back."""
        split = head["kind"] == Kind.SPLIT
        self.report(source, {**self.work.regroup(head, buf, split), "ack": Ack.SPLIT if split else Ack.MERGED})

    on_merge = on_split

    def on_stop(self, source: int, head, buf: np.ndarray, seen: float) -> None:
        """A dispatcher has no more input; with the last one's STOP the final report (every move has been
        acknowledged before the master stops)."""
        action = self.state.on_stop(source, int(head["seq"]))
        if isinstance(action, Acknowledge):
            self.work.results_out.answer(source, action.seq)
            self.report(source, {"seq": action.seq, "ack": Ack.BATCH})
            return
        assert isinstance(action, Finish)
        MPI.Request.Waitall([req for req, _ in self.outgoing])
        self.report(source, {**self.work.finish(source, action.seq), "ack": Ack.BATCH})
        MPI.Request.Waitall([req for req, _ in self.outgoing])

    def serve(self) -> int:
        while not self.state.stopped:
            self.outgoing = [(req, buf) for req, buf in self.outgoing if not req.Test()]
            channels = self.state.channels(MPI.ANY_SOURCE, MPI.ANY_TAG)
            status = wait_probe_any(self.comm, channels, soon=self.state.next_batch(time.monotonic()))
            started, seen = time.perf_counter(), time.monotonic()  # from the probe on: the transfer, not the wait
            if status.Get_tag() == TAG_STATE:  # installed as it is: its own buffer
                buf = recv_bytes(self.comm, status)
                self.work.comm_seconds += time.perf_counter() - started
                self.on_state(buf)
                continue
            # a batch is copied into the window and the results before the next message: its buffer is reused
            buf = recv_bytes(self.comm, status, self.inbox)
            self.inbox = whole_buffer(buf)
            self.work.comm_seconds += time.perf_counter() - started
            head = decode_head(buf, self.dtype)
            self.on_message[Kind(int(head["kind"]))](status.Get_source(), head, buf, seen)
        return 0


def run(comm: MPI.Comm, received: tuple | None = None) -> int:
    """Serve as a slave; `received` is (config, resume) when `python -m master` already took them."""
    plan, resume = received or receive_start(comm)
    if plan is None:  # the master refused the configuration, said why and exits with USER_ERROR
        return USER_ERROR
    if comm.rank < (dispatchers := plan.cluster.dispatchers):
        what = f"rank {comm.rank} runs `python -m slave` but is a dispatcher (cluster.dispatchers = {dispatchers})"
        print(f"error: {what}: start ranks 0..k-1 with `python -m master`", file=sys.stderr, flush=True)
        comm.Abort(USER_ERROR)
    ignore_stop_signals()
    slave = Slave(comm, plan)
    if resume is not None:
        slave.state.resume([int(seqs.get(str(comm.rank), 0)) for seqs in resume["seqs"]])
        slave.work.resume(resume)
    wait_all_started(comm, plan)
    # once every rank has imported: earlier, a rank that imported first counted the shared libraries whole
    slave.work.pss_start = pss_bytes()
    return slave.serve()
