"""The slave's shell: receive a dispatcher's message, let the state machine (slave/state.py) say what it means,
do it (slave/joining.py), report.

Besides batches it serves the two halves of a partition-group move (paper 003, IV-C): as supplier, on the
master's MOVE order it sends the group's state to the consumer; as consumer, it installs a state that arrives
and tells the master.  On a checkpoint it flushes its results and writes every group's state
(protocol.checkpoint); on a recovery it starts from that state.
"""

from __future__ import annotations

import sys
import time

import numpy as np
from mpi4py import MPI

from protocol import delays, faults
from protocol.arrays import whole_buffer
from protocol.lifetime import CHANNEL, USER_ERROR, ignore_stop_signals
from protocol.messages import (
    HISTOGRAMS,
    TAG_JOINING,
    TAG_REPORT,
    TAG_STATE,
    Ack,
    Kind,
    batch_groups,
    batch_rows,
    decode_head,
    encode_report,
    hot_key,
)
from protocol.mpi import receive_start, recv_bytes, wait_all_started, wait_probe_any
from protocol.startup import pss_bytes
from protocol.tuples import tuple_dtype
from slave.joining import Joiner
from slave.mover import decode_move, encode_move
from slave.state import Acknowledge, Finish, Join, Lost, SlaveState, WriteCheckpoint


class Slave:
    def __init__(self, comm: MPI.Comm, cfg: dict):
        self.comm, self.dtype = comm, tuple_dtype(cfg["generator"]["tuple_bytes"])
        self.state = SlaveState(cfg["cluster"]["dispatchers"], cfg["epochs"]["distribution"])
        self.work = Joiner(comm, cfg, self.dtype)
        self.outgoing: list[tuple[MPI.Request, np.ndarray]] = []  #: reports and group states on their way
        self.inbox: np.ndarray | None = None  #: the buffer batches are received into (serve)
        self.on_message = {
            Kind.BATCH: self.on_batch,
            Kind.MOVE: self.on_move,
            Kind.CHECKPOINT: self.on_marker,
            Kind.SPLIT: self.on_hot_key,
            Kind.MERGE: self.on_hot_key,
            Kind.STOP: self.on_stop,
        }

    def report(self, dest: int, counters: dict, hist: np.ndarray | None = None) -> None:
        """A report to dispatcher `dest`; it fits the eager limit (protocol.messages.REPORT_BYTES): the Isend
        completes without the master."""
        started = time.perf_counter()
        buf = encode_report(
            {**counters, **self.work.levels()}, np.zeros((HISTOGRAMS, delays.BINS), np.int64) if hist is None else hist
        )
        self.outgoing.append((self.comm.Isend(buf, dest=dest, tag=TAG_REPORT), buf))
        self.work.comm_seconds += time.perf_counter() - started

    def on_batch(self, source: int, head, buf: np.ndarray, seen: float) -> None:
        action = self.state.on_batch(source, int(head["seq"]), int(head["watermark"]), seen)
        if isinstance(action, Lost):
            print(
                f"error: slave {self.comm.rank}: batch {action.got} from dispatcher {action.dispatcher}, expected "
                f"{action.expected}: the channel lost or reordered a batch",
                file=sys.stderr,
                flush=True,
            )
            self.comm.Abort(CHANNEL)
        assert isinstance(action, Join)
        faults.at_batch(self.comm.rank, after_checkpoint=self.work.parts_written >= 2)
        say = lambda word: self.outgoing.append((self.comm.Isend(word, dest=source, tag=TAG_JOINING), word))  # noqa: E731
        counters, hists = self.work.join(
            source,
            head,
            *batch_rows(buf, head, self.dtype),
            batch_groups(buf, head) if head["table_rows"] else None,
            action.watermark,
            say,
        )
        self.report(source, {**counters, "ack": Ack.BATCH}, hists)

    def on_move(self, source: int, head, buf: np.ndarray, seen: float) -> None:
        """Supplier side: extract the group, send its state to the consumer, tell the master."""
        partition, consumer = int(head["partition"]), int(head["peer"])
        pg = self.work.module.extract(partition)
        faults.reached(self.comm.rank, "move")
        state = encode_move(partition, pg, int(head["floor"]))
        self.outgoing.append((self.comm.Isend([state, MPI.BYTE], dest=consumer, tag=TAG_STATE), state))
        self.report(
            source, {"seq": int(head["seq"]), "ack": Ack.MOVED, "partition": partition, "moved_tuples": len(pg)}
        )

    def on_state(self, buf: np.ndarray) -> None:
        """Consumer side: install a group's state, then tell the coordinator it may route the group here."""
        partition, pg, floor = decode_move(buf, self.work.module.new_group)
        self.state.on_state(floor)
        self.work.module.install(partition, pg)
        self.report(0, {"ack": Ack.INSTALLED, "partition": partition, "moved_tuples": len(pg)})

    def on_marker(self, source: int, head, buf: np.ndarray, seen: float) -> None:
        for action in self.state.on_marker(source, int(head["checkpoint"]), int(head["seq"])):
            if isinstance(action, Acknowledge):
                self.report(action.dispatcher, {"seq": action.seq, "ack": Ack.BATCH})
            elif isinstance(action, WriteCheckpoint):
                self.report(
                    0, {"seq": action.seq, "ack": Ack.CHECKPOINTED, **self.work.write_checkpoint(action.checkpoint)}
                )

    def on_hot_key(self, source: int, head, buf: np.ndarray, seen: float) -> None:
        """SPLIT a hot key out of its partition-group into its grid of sub-groups, or MERGE the grid back."""
        split = head["kind"] == Kind.SPLIT
        act = self.work.module.split_hot_key if split else self.work.module.merge_hot_key
        moved = act(int(head["partition"]), *hot_key(buf, head))
        self.report(
            source,
            {
                "seq": int(head["seq"]),
                "ack": Ack.SPLIT if split else Ack.MERGED,
                "partition": int(head["partition"]),
                "moved_tuples": moved,
            },
        )

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
            status = wait_probe_any(
                self.comm,
                self.state.channels(MPI.ANY_SOURCE, MPI.ANY_TAG),
                soon=self.state.next_batch(time.monotonic()),
            )
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
    cfg, resume = received or receive_start(comm)
    if cfg is None:  # the master refused the configuration, said why and exits with USER_ERROR
        return USER_ERROR
    if comm.rank < cfg["cluster"]["dispatchers"]:
        print(
            f"error: rank {comm.rank} runs `python -m slave` but is a dispatcher "
            f"(cluster.dispatchers = {cfg['cluster']['dispatchers']}): start ranks 0..k-1 with `python -m master`",
            file=sys.stderr,
            flush=True,
        )
        comm.Abort(USER_ERROR)
    ignore_stop_signals()
    slave = Slave(comm, cfg)
    if resume is not None:
        slave.state.resume([int(seqs.get(str(comm.rank), 0)) for seqs in resume["seqs"]])
        slave.work.resume(resume)
    wait_all_started(comm, cfg)
    # once every rank has imported: earlier, a rank that imported first counted the shared libraries whole
    slave.work.pss_start = pss_bytes()
    return slave.serve()
