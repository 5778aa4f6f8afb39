"""The slave's MPI loop: receive a batch, join it, write results, report (thin shell around JoinModule).

Besides batches it serves the two halves of a partition-group move (paper 003,
IV-C): as supplier, on the master's MOVE order it sends the group's state to the
consumer; as consumer, it installs a state that arrives and tells the master.
On a CHECKPOINT order it flushes its results and writes every group's state
(protocol.checkpoint); on a recovery it starts from that state.
"""
from __future__ import annotations

import resource
import signal
import sys
import time
from pathlib import Path

import numpy as np
import psutil
from mpi4py import MPI

from protocol import checkpoint, delays, eventtime, faults
from protocol.arrays import whole_buffer
from protocol.messages import HISTOGRAMS, TAG_DATA, TAG_JOINING, TAG_REPORT, TAG_STATE, Ack, Kind, batch_groups, \
    batch_rows, decode_head, encode_report, hot_key, joining_message
from protocol.lifetime import CHANNEL, USER_ERROR
from protocol.startup import pss_bytes
from protocol.mpi import next_arrival, recv_bytes, wait_all_started, wait_probe_any
from protocol.predicates import time_bounds
from protocol.tuples import tuple_dtype
from slave.aggregate import PartialAggregator
from slave.join import JoinModule
from protocol.payload import payload_reader
from slave.result_files import ResultWriter
from slave.results_out import ResultSender
from slave.state import decode_group, decode_move, encode_group, encode_move


class Slave:
    def __init__(self, comm: MPI.Comm, cfg: dict):
        self.comm = comm
        self.dtype = tuple_dtype(cfg["generator"]["tuple_bytes"])
        tuning = cfg["tuning"]
        join = cfg["join"]
        out = cfg["output"]
        self.module = JoinModule(self.dtype, cfg["partitioning"]["partitions"], time_bounds(join),
                                 tuning["block_size"], tuning["theta_min"], tuning["theta_max"], tuning["max_depth"],
                                 join["predicate"], join["band"], join["type"], out["result_chunk_rows"])
        self.writer = ResultWriter(f"{out['path']}/results", comm.rank, out["format"], out["flush_rows"],
                                   join["type"], payload_reader(cfg))
        agg = cfg["aggregate"]  # phase one of the two-phase aggregation (paper 001, 3.4.2)
        # with checkpoints, partials are staged until a checkpoint covers them (protocol/checkpoint.py)
        staged = f"{out['path']}/{checkpoint.PENDING_AGGREGATES if cfg['checkpoint']['interval'] else 'aggregates'}"
        self.aggregator = PartialAggregator(staged, comm.rank, agg) if agg["enabled"] else None
        self.results_out = ResultSender(comm, cfg)
        self.process = psutil.Process()
        self.pss_start = 0  #: before any data: imports, MPI, kernels (protocol.startup); taken in `run`
        self.splits = self.merges = 0
        self.comm_seconds = 0.0  #: receiving messages and sending reports (paper 003 VI: communication time)
        self.outgoing: list[tuple[MPI.Request, np.ndarray]] = []  #: reports and group states on their way
        self.checkpoints = checkpoint.root_of(cfg)
        self.epoch = cfg["epochs"]["distribution"]  #: a long batch says it is still joining once per epoch
        k = cfg["cluster"]["dispatchers"]
        #: per dispatcher (ranks 0..k-1; BiStream 3.2.3): the punctuation of its last batch -- every later tuple
        #: from it has ts >= this (microseconds) -- and the sequence number of that batch on the FIFO channel from it
        self.watermarks = np.full(k, eventtime.NEG_INF, dtype=np.int64)
        self.sequence = np.zeros(k, dtype=np.int64)
        self.batch_came: list[float | None] = [None] * k  #: per dispatcher, when its last batch was seen (monotonic)
        self.stops = 0
        self.marked: set[int] = set()  #: dispatchers whose marker of the checkpoint being taken has come
        self.reply_to = 0  #: the dispatcher whose message is being served
        self.inbox: np.ndarray | None = None  #: the buffer batches are received into (serve)
        #: a dispatcher's message by its kind (protocol.messages.Kind): each handler takes (header, buffer)
        self.on_message = {Kind.BATCH: self.on_batch, Kind.MOVE: self.on_move, Kind.CHECKPOINT: self.on_checkpoint,
                           Kind.SPLIT: self.on_hot_key, Kind.MERGE: self.on_hot_key, Kind.STOP: self.on_stop}
        self.stopped = False  #: the last dispatcher's STOP is served: `serve` returns

    def report(self, counters: dict, hist: np.ndarray | None = None) -> None:
        stored_r, stored_s = self.module.stored()
        cpu = self.process.cpu_times()
        counters.update(window_r=stored_r, window_s=stored_s, window_bytes=self.module.nbytes,
                        splits=self.module.splits - self.splits, merges=self.module.merges - self.merges,
                        rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # its peak (Linux: KiB)
                        cpu=cpu.user + cpu.system, comm=self.comm_seconds, pss_start=self.pss_start)
        self.splits, self.merges = self.module.splits, self.module.merges
        if hist is None:
            hist = np.zeros((HISTOGRAMS, delays.BINS), dtype=np.int64)
        started = time.perf_counter()
        # a report fits the eager limit (protocol.messages.REPORT_BYTES): the Isend completes without the master
        buf = encode_report(counters, hist)
        self.outgoing.append((self.comm.Isend(buf, dest=self.reply_to, tag=TAG_REPORT), buf))
        self.comm_seconds += time.perf_counter() - started

    def on_batch(self, head, buf: np.ndarray) -> None:
        self.check_sequence(int(head["seq"]))
        fresh_r, fresh_s = batch_rows(buf, head, self.dtype)
        groups = batch_groups(buf, head) if head["table_rows"] else None
        faults.reached(self.comm.rank, "batch")
        faults.hangs(self.comm.rank, "batch")
        faults.fail("batch")
        started, started_wall = time.perf_counter(), time.time()
        faults.straggle(self.comm.rank)
        # expire only below every dispatcher's punctuation: a tuple still to come from any of them may need it
        self.watermarks[self.reply_to] = int(head["watermark"])
        # each chunk of results is written, aggregated and sent before the next is built (output.result_chunk_rows)
        results = chunks = 0
        files = self.writer.files
        delay_max = 0.0
        hists = np.zeros((HISTOGRAMS, delays.BINS), dtype=np.int64)
        watermark = int(self.watermarks.min())
        alone = self.module.join_type != "inner"  # its rows alone are the batch's last results message
        said = started
        for chunk in self.module.chunks(fresh_r, fresh_s, watermark, groups):
            delay, hist = chunk.delays(float(head["sent"]), started_wall)
            faults.straggle(self.comm.rank, "STREAMJOIN_SLOW_CHUNKS")
            table = self.writer.add(chunk.pairs, delay)
            if self.aggregator:
                self.aggregator.add(chunk.pairs)
            self.results_out.send(self.reply_to, int(head["seq"]), chunk.pairs, delay, chunk.last and not alone,
                                  watermark, table)
            results, chunks, hists = results + len(delay), chunks + 1, hists + hist
            delay_max = max(delay_max, float(delay.max(initial=0.0)))
            del chunk, delay, table  # the next chunk is built without this one
            said = self.say_joining(int(head["seq"]), results, started, said)
        lone = self.take_lone(int(head["seq"]), watermark)
        self.report({"seq": float(head["seq"]), "tuples_r": len(fresh_r), "tuples_s": len(fresh_s),
                     "results": results + lone, "chunks": chunks, "delay_max": delay_max,
                     "files": self.writer.files - files,
                     "busy": time.perf_counter() - started, "ack": Ack.BATCH}, hists)

    def say_joining(self, seq: int, results: int, started: float, said: float) -> float:
        """Tell the dispatcher that its batch `seq` (begun at `started`) is still being joined, once a
        distribution epoch has passed since the batch began or this was last said (a hot key's batch of billions
        of pairs outlasts the stall watch's bound); returns when it was last said."""
        now = time.perf_counter()
        if now - said < self.epoch:
            return said
        buf = joining_message(seq, results, round((now - started) * 1000))
        self.outgoing.append((self.comm.Isend(buf, dest=self.reply_to, tag=TAG_JOINING), buf))
        return now

    def take_lone(self, seq: int, watermark: int) -> int:
        """Outer, semi and anti joins: write the rows the last epoch decided alone (known once its last chunk is
        taken), send them as the last results message of the batch (or STOP) `seq` decided by `watermark`, and,
        with a semi or anti join, aggregate them (phase one; the configuration refuses aggregation with left,
        right and full joins, whose rows mix pairs and lone rows).  Returns the rows."""
        lone_r, lone_s = self.module.lone_r, self.module.lone_s
        table = self.writer.add_lone(lone_r, lone_s)
        if self.module.join_type != "inner":
            self.results_out.send_lone(self.reply_to, seq, lone_r, lone_s, self.module.stream_times(), watermark,
                                       table)
        if self.aggregator and len(lone_r) and not self.module.emit_pairs:
            self.aggregator.add_rows(lone_r["key"], lone_r["ts"], lone_r["value"])
        return len(lone_r) + len(lone_s)

    def on_move(self, head, buf: np.ndarray) -> None:
        """Supplier side: extract the group, send its state to the consumer, tell the master."""
        partition, consumer = int(head["partition"]), int(head["peer"])
        pg = self.module.extract(partition)
        faults.reached(self.comm.rank, "move")
        state = encode_move(partition, pg, int(head["watermark"]))
        self.outgoing.append((self.comm.Isend([state, MPI.BYTE], dest=consumer, tag=TAG_STATE), state))
        self.report({"seq": float(head["seq"]), "ack": Ack.MOVED, "partition": partition,
                     "moved_tuples": len(pg)})

    def on_state(self, buf: np.ndarray) -> None:
        """Consumer side: install a group's state, then tell the master it may route the group here.

        A dispatcher's last punctuation here may lie above tuples of the group it still holds (they were bound
        for the supplier): until each sends again, no punctuation counts above the move's floor."""
        partition, pg, floor = decode_move(buf, self.module.new_group)
        self.watermarks = np.minimum(self.watermarks, floor)
        self.module.install(partition, pg)
        self.reply_to = 0  # the coordinator's news, not an answer to the supplier
        self.report({"ack": Ack.INSTALLED, "partition": partition, "moved_tuples": len(pg)})

    def on_checkpoint(self, head, buf: np.ndarray) -> None:
        """A dispatcher's marker: with the last one, flush results (they are the checkpoint's commit) and write
        every partition-group's state; until then nothing more is taken from a dispatcher whose marker came
        (`channels`), so no batch crosses the cut (master.coordination)."""
        self.marked.add(self.reply_to)
        if self.reply_to != 0:  # rank 0 gets CHECKPOINTED; another dispatcher may go on (its batches wait)
            self.report({"seq": float(head["seq"]), "ack": Ack.BATCH})
        if len(self.marked) < len(self.watermarks):
            return
        self.marked.clear()
        self.reply_to = 0
        files = self.writer.flush()
        self.writer.wait()
        if self.aggregator:
            self.aggregator.flush()
        part = checkpoint.pack([encode_group(p, pg) for p, pg in sorted(self.module.groups.items())])
        faults.reached(self.comm.rank, "checkpoint")
        directory = self.checkpoints / checkpoint.name_of(int(head["checkpoint"]))
        size = checkpoint.write_atomic(directory / checkpoint.slave_part(self.comm.rank), part)
        self.report({"seq": float(head["seq"]), "ack": Ack.CHECKPOINTED, "files": files,
                     "result_files": self.writer.files, "part_bytes": size,
                     "aggregate_files": self.aggregator.files if self.aggregator else 0})

    def on_hot_key(self, head, buf: np.ndarray) -> None:
        """SPLIT a hot key out of its partition-group into its grid of sub-groups, or MERGE the grid back."""
        split = head["kind"] == Kind.SPLIT
        act = self.module.split_hot_key if split else self.module.merge_hot_key
        moved = act(int(head["partition"]), *hot_key(buf, head))
        self.report({"seq": float(head["seq"]), "ack": Ack.SPLIT if split else Ack.MERGED,
                     "partition": int(head["partition"]), "moved_tuples": moved})

    def on_stop(self, head, buf: np.ndarray) -> None:
        """A dispatcher has no more input; with the last one's STOP, flush everything and send the final report
        (every move has been acknowledged before the master stops)."""
        self.stops += 1
        if self.stops < len(self.watermarks):  # other dispatchers still send
            self.watermarks[self.reply_to] = eventtime.POS_INF
            self.results_out.answer(self.reply_to, int(head["seq"]))
            self.report({"seq": float(head["seq"]), "ack": Ack.BATCH})
            return
        MPI.Request.Waitall([req for req, _ in self.outgoing])
        lone, files = 0, self.writer.files
        if self.module.join_type != "inner":  # the end of input: every row still undecided is decided now
            none = np.empty(0, self.dtype)
            self.module.process(none, none, eventtime.POS_INF)  # no fresh tuples: no pairs
            lone = self.take_lone(int(head["seq"]), eventtime.POS_INF)
        else:
            self.results_out.answer(self.reply_to, int(head["seq"]))
        if self.aggregator:
            self.aggregator.flush()
        self.results_out.wait()
        self.writer.flush()
        self.writer.wait()
        self.report({"seq": float(head["seq"]), "files": self.writer.files - files, "ack": Ack.BATCH,
                     "results": lone})
        MPI.Request.Waitall([req for req, _ in self.outgoing])
        self.stopped = True

    def resume(self, directory: str, groups: list, result_files: int, aggregate_files: int,
               sequences: list[int]) -> None:
        """Start from a checkpoint: `groups` are [slave part, partition-groups (None: all)] pairs, this slave's
        own part on the same slaves, the parts of others when the checkpoint was taken on another slave count.
        Result files and each dispatcher's batches number on from the checkpoint."""
        self.sequence[:] = sequences
        if self.aggregator:
            self.aggregator.files = aggregate_files
        for part, partitions in groups:
            wanted = None if partitions is None else set(partitions)
            for buf in checkpoint.read_part(Path(directory) / part):
                if wanted is None or checkpoint.group_partition(buf) in wanted:
                    self.module.install(*decode_group(buf, self.module.new_group))
        self.writer.files = result_files

    def check_sequence(self, number: int) -> None:
        """Batches from one dispatcher are numbered 1, 2, ...; MPI keeps a channel in order, so a gap means a
        batch was lost: stop the job rather than silently join without it."""
        expected = self.sequence[self.reply_to] + 1
        if number != expected:
            print(f"error: slave {self.comm.rank}: batch {number} from dispatcher {self.reply_to}, expected "
                  f"{expected}: the channel lost or reordered a batch", file=sys.stderr, flush=True)
            self.comm.Abort(CHANNEL)
        self.sequence[self.reply_to] = number

    def channels(self) -> list[tuple[int, int]]:
        """What may be received now: anything, or while a checkpoint's markers come in, group states and the
        batches of dispatchers whose marker has not come yet."""
        if not self.marked:
            return [(MPI.ANY_SOURCE, MPI.ANY_TAG)]
        return [(MPI.ANY_SOURCE, TAG_STATE)] + [(d, TAG_DATA) for d in range(len(self.watermarks))
                                                 if d not in self.marked]

    def serve(self) -> int:
        while not self.stopped:
            self.outgoing = [(req, buf) for req, buf in self.outgoing if not req.Test()]
            status = wait_probe_any(self.comm, self.channels(), soon=self.next_batch())
            started = time.perf_counter()  # from the probe on: the transfer, not the idle wait for a message
            seen = time.monotonic()
            if status.Get_tag() == TAG_STATE:  # installed as it is: its own buffer
                buf = recv_bytes(self.comm, status)
                self.comm_seconds += time.perf_counter() - started
                self.on_state(buf)
                continue
            # a batch is copied into the window and the results before the next message: its buffer is reused
            buf = recv_bytes(self.comm, status, self.inbox)
            self.inbox = whole_buffer(buf)
            self.comm_seconds += time.perf_counter() - started
            head = decode_head(buf, self.dtype)
            self.reply_to = status.Get_source()
            if head["kind"] == Kind.BATCH:
                self.batch_came[self.reply_to] = seen
            self.on_message[Kind(int(head["kind"]))](head, buf)
        return 0

    def next_batch(self) -> float | None:
        """When the next batch should come (time.monotonic): a dispatcher serves each slave once per distribution
        epoch, at its slot, so a whole number of epochs after its last; None before the first."""
        return next_arrival(self.batch_came, self.epoch, time.monotonic())


def run(comm: MPI.Comm, received: tuple | None = None) -> int:
    """Serve as a slave; `received` is (config, resume) when `python -m master` already took them."""
    if received is None:
        cfg = comm.bcast(None, root=0)
        if cfg is None:  # the master refused the configuration, said why and exits with USER_ERROR
            return USER_ERROR
        resume = comm.bcast(None, root=0)  # None, or where the recovered run starts from
    else:
        cfg, resume = received
    if comm.rank < cfg["cluster"]["dispatchers"]:
        print(f"error: rank {comm.rank} runs `python -m slave` but is a dispatcher "
              f"(cluster.dispatchers = {cfg['cluster']['dispatchers']}): start ranks 0..k-1 with `python -m master`",
              file=sys.stderr, flush=True)
        comm.Abort(USER_ERROR)
    # mpirun forwards stop signals to every rank; the master alone decides when to stop.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    slave = Slave(comm, cfg)
    if resume is not None:
        slave.resume(resume["dir"], resume["groups"][str(comm.rank)],
                     int(resume["result_files"].get(str(comm.rank), 0)),
                     int(resume["aggregate_files"].get(f"slave-{comm.rank:03d}", 0)),
                     [int(seqs.get(str(comm.rank), 0)) for seqs in resume["seqs"]])
    wait_all_started(comm, cfg)
    # once every rank has imported: earlier, a rank that imported first counted the shared libraries whole
    slave.pss_start = pss_bytes()
    return slave.serve()
