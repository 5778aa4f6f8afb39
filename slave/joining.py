"""One batch joined and its results put out: written to result files, pre-aggregated, sent to the result
stream, counted for the report; the slave's partition-groups as they move, split a hot key, go to a checkpoint
or come back; and the reports' bytes.

The slave's shell (slave/run.py) decides when (slave/state.py), this does it.  A batch's results are built in
chunks of at most `output.result_chunk_rows` rows (slave.join), each written, aggregated and sent before the
next is built, so a hot key's billions of pairs cost time, not memory.
"""

from __future__ import annotations

import resource
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np
import psutil
import pyarrow as pa

from protocol import checkpoint, delays, eventtime, faults, wire
from protocol.messages import HISTOGRAMS, batch_groups, batch_rows, encode_report, hot_key, joining_message
from protocol.output import MATCHED, empty_table, result_schema
from protocol.payload import payload_reader
from slave.aggregate import ColumnAggregator
from slave.join import JoinModule
from slave.mover import decode_group, decode_move, encode_group, encode_move
from slave.result_files import ResultWriter, with_columns
from slave.results_out import ResultSender

if TYPE_CHECKING:
    from protocol.plan import Plan


class Joiner:
    def __init__(self, comm, plan: Plan, dtype: np.dtype):
        tuning, join, out = plan.tuning, plan.join, plan.output
        self.rank = comm.rank
        self.epoch = plan.epochs.distribution  #: a long batch says it is still joining once per epoch
        self.module = JoinModule(
            dtype,
            plan.partitioning.partitions,
            join.bounds,
            tuning.block_size,
            tuning.theta_min,
            tuning.theta_max,
            tuning.max_depth,
            join.predicate,
            join.band,
            join.type,
            wire.chunk_rows(out),
            plan.query.condition if plan.query is not None else None,
        )
        payload = payload_reader(plan)
        if payload is not None:  # results named as the query's SELECT says
            payload.plan = plan.query
        self.writer = ResultWriter(f"{out.path}/results", comm.rank, out.format, out.flush_rows, join.type, payload)
        agg = plan.aggregate  # phase one of the two-phase aggregation (paper 001, 3.4.2)
        # with checkpoints, partials are staged until a checkpoint covers them (protocol/checkpoint.py)
        staged = f"{out.path}/{checkpoint.PENDING_AGGREGATES if plan.checkpoint.enabled else 'aggregates'}"
        self.aggregator = None
        if agg.enabled:  # over the results' own columns (protocol.aggregation)
            slaves = comm.size - plan.cluster.dispatchers
            self.aggregator = ColumnAggregator(staged, comm.rank, agg.flush_interval, agg.view, slaves, self.no_results)
        self.results_out = ResultSender(comm, plan)
        sink = out.kafka
        #: with checkpoints its own result files go to Kafka, a transaction per checkpoint (protocol.kafka_sink)
        self.sink = None
        if sink.topic and plan.checkpoint.enabled and not sink.complete:
            from protocol.kafka_sink import ResultProducer  # confluent-kafka: only where a sink is configured

            self.sink = ResultProducer(plan, comm.rank, self.writer.prefix)
            self.sink.begin()
        self.covered = 0  #: its result files the last checkpoint it wrote a part of covers
        self.checkpoints = plan.checkpoint.root
        self.process = psutil.Process()
        self.pss_start = 0  #: before any data: imports, MPI, kernels (protocol.startup)
        self.comm_seconds = 0.0  #: receiving messages and sending reports (paper 003 VI: communication time)
        self.splits = self.merges = 0
        self.parts_written = 0  #: checkpoint parts this slave wrote (fault injection: after a complete one)

    def join(
        self, dispatcher: int, head, buf: np.ndarray, watermark: int, say: Callable[[np.ndarray], None]
    ) -> tuple[dict, np.ndarray]:
        """Join batch `head` (its rows and group table: in `buf`) expiring below `watermark`; once a distribution
        epoch the slave `say`s it is still joining (a hot key's billions of pairs outlast the stall watch's
        bound).  Returns the report's counters and the delay histograms."""
        seq = int(head["seq"])
        fresh_r, fresh_s = batch_rows(buf, head, self.module.dtype)
        groups = batch_groups(buf, head) if head["table_rows"] else None
        started, started_wall = time.perf_counter(), time.time()
        said = started
        faults.straggle(self.rank)
        results = chunks = 0
        files = self.writer.files
        delay_max = 0.0
        hists = np.zeros((HISTOGRAMS, delays.BINS), dtype=np.int64)
        alone = self.module.join_type != "inner"  # its rows alone are the batch's last results message
        for chunk in self.module.chunks(fresh_r, fresh_s, watermark, groups):
            delay, hist = chunk.delays(float(head["sent"]), started_wall)
            faults.straggle(self.rank, "STREAMJOIN_SLOW_CHUNKS")
            table = self.writer.add_pairs(chunk.pairs, delay)
            if self.aggregator:
                self.aggregator.add_table(table)
            self.results_out.send(dispatcher, seq, chunk.pairs, delay, chunk.last and not alone, watermark, table)
            results, chunks, hists = results + len(delay), chunks + 1, hists + hist
            delay_max = max(delay_max, float(delay.max(initial=0.0)))
            del chunk, delay, table  # the next chunk is built without this one
            if (now := time.perf_counter()) - said >= self.epoch:
                say(joining_message(seq, results, round((now - started) * 1000)))
                said = now
        lone = self.take_lone(dispatcher, seq, watermark)
        if self.aggregator:
            self.aggregator.decided(watermark)
        return {
            "seq": seq,
            "tuples_r": len(fresh_r),
            "tuples_s": len(fresh_s),
            "results": results + lone,
            "chunks": chunks,
            "delay_max": delay_max,
            "files": self.writer.files - files,
            "busy": time.perf_counter() - started,
        }, hists

    def no_results(self) -> pa.Table:
        """An empty table of this run's result columns."""
        if self.writer.payload is None:  # the single file's
            return empty_table(result_schema(self.module.join_type))
        none = np.empty(0, np.int64)
        kind = None if self.module.join_type == "inner" else MATCHED
        return with_columns(self.writer.payload, none, none, np.empty(0), kind)

    def take_lone(self, dispatcher: int, seq: int, watermark: int) -> int:
        """Outer, semi and anti joins: write the rows the last epoch decided alone (known once its last chunk is
        taken), send them as the last results message of the batch (or STOP) `seq` decided by `watermark`, and
        aggregate them (phase one: each row in its `kind`).  Returns the rows."""
        lone_r, lone_s = self.module.lone_r, self.module.lone_s
        table = self.writer.add_lone(lone_r, lone_s)
        if self.module.join_type != "inner":
            self.results_out.send_lone(dispatcher, seq, lone_r, lone_s, self.module.stream_times(), watermark, table)
        if self.aggregator:
            self.aggregator.add_table(table)
        return len(lone_r) + len(lone_s)

    def hand_over(self, head) -> tuple[np.ndarray, dict]:
        """Supplier side of MOVE `head`: take the group out; its state for the consumer and the report's counters."""
        partition = int(head["partition"])
        pg = self.module.extract(partition)
        faults.reached(self.rank, "move")
        counters = {"seq": int(head["seq"]), "partition": partition, "moved_tuples": len(pg)}
        return encode_move(partition, pg, int(head["floor"])), counters

    def take_over(self, buf: np.ndarray) -> tuple[int, dict]:
        """Consumer side: install the group's state; the move's floor and the report's counters."""
        partition, pg, floor = decode_move(buf, self.module.new_group)
        self.module.install(partition, pg)
        return floor, {"partition": partition, "moved_tuples": len(pg)}

    def installed(self, watermark: int) -> None:
        """A moved group is installed, its rows bound by the lowered `watermark` only: partials say so in a file
        written before INSTALLED lets the supplier's watermark rise (slave.aggregate.ColumnAggregator)."""
        if self.aggregator:
            self.aggregator.installed(watermark)

    def regroup(self, head, buf: np.ndarray, split: bool) -> dict:
        """SPLIT (`split`) a hot key out of its partition-group into its grid of sub-groups, or MERGE the grid back;
        the report's counters."""
        act = self.module.split_hot_key if split else self.module.merge_hot_key
        moved = act(int(head["partition"]), *hot_key(buf, head))
        return {"seq": int(head["seq"]), "partition": int(head["partition"]), "moved_tuples": moved}

    def finish(self, dispatcher: int, seq: int) -> dict:
        """The last STOP: every row still undecided is decided now, everything is flushed; the final report's
        counters."""
        lone, files = 0, self.writer.files
        if self.module.join_type != "inner":
            none = np.empty(0, self.module.dtype)
            self.module.process(none, none, eventtime.POS_INF)  # no fresh tuples: no pairs
            lone = self.take_lone(dispatcher, seq, eventtime.POS_INF)
        else:
            self.results_out.answer(dispatcher, seq)
        if self.aggregator:
            self.aggregator.decided(eventtime.POS_INF)
            self.aggregator.flush()
        self.results_out.wait()
        self.writer.flush()
        self.writer.wait()
        return {"seq": seq, "files": self.writer.files - files, "results": lone}

    def write_checkpoint(self, ckpt: int, say: Callable[[np.ndarray], None] = lambda word: None) -> dict:
        """Send the files the checkpoint before covers to Kafka (rank 0 orders one only once the one before is
        complete: they are final), flush the results (they are this checkpoint's commit) and write every
        partition-group's state; the CHECKPOINTED report's counters.  While it sends, the slave `say`s once a
        distribution epoch that it is still at work (a slow broker must not look like a stall)."""
        if self.sink is not None and self.covered > self.sink.sent.get(self.writer.prefix, 0):
            started = said = time.perf_counter()

            def alive() -> None:
                nonlocal said
                if (now := time.perf_counter()) - said >= self.epoch:
                    say(joining_message(ckpt, 0, round((now - started) * 1000)))
                    said = now

            self.sink.alive = alive
            self.sink.transaction({self.writer.prefix: self.covered}, ckpt - 1)
        files = self.writer.flush()
        self.writer.wait()
        self.covered = self.writer.files
        if self.aggregator:
            self.aggregator.flush()
        part = checkpoint.pack([encode_group(p, pg) for p, pg in sorted(self.module.groups.items())])
        faults.reached(self.rank, "checkpoint")
        directory = self.checkpoints / checkpoint.name_of(ckpt)
        size = checkpoint.write_atomic(directory / checkpoint.slave_part(self.rank), part)
        self.parts_written += 1
        return {
            "files": files,
            "result_files": self.writer.files,
            "part_bytes": size,
            "aggregate_files": self.aggregator.files if self.aggregator else 0,
        }

    def resume(self, resume: dict) -> None:
        """Start from a checkpoint (what rank 0 sends: master.__main__): this slave's `groups` are [slave part,
        partition-groups (None: all)] pairs, its own part on the same slaves, the parts of others when the
        checkpoint was taken on another slave count.  Result and aggregate files number on from it."""
        if self.aggregator:
            self.aggregator.files = int(resume["aggregate_files"].get(f"slave-{self.rank:03d}", 0))
        for part, partitions in resume["groups"][str(self.rank)]:
            wanted = None if partitions is None else set(partitions)
            for buf in checkpoint.read_part(Path(resume["dir"]) / part):
                if wanted is None or checkpoint.group_partition(buf) in wanted:
                    self.module.install(*decode_group(buf, self.module.new_group))
        self.writer.files = self.covered = int(resume["result_files"].get(str(self.rank), 0))
        if self.sink is not None:  # rank 0 sent what the checkpoint covers before the run went on (master.sink)
            self.sink.sent = {self.writer.prefix: self.covered}

    def report(self, counters: dict, hists: np.ndarray | None = None) -> np.ndarray:
        """A report of `counters`, what every report carries (`levels`) and a batch's delay histograms (else
        zeros)."""
        hists = np.zeros((HISTOGRAMS, delays.BINS), np.int64) if hists is None else hists
        return encode_report({**counters, **self.levels()}, hists)

    def levels(self) -> dict:
        """What every report carries besides its own counters: the window, splits and merges since the last
        report, the process's memory and time."""
        stored_r, stored_s = self.module.stored()
        cpu = self.process.cpu_times()
        levels = {
            "window_r": stored_r,
            "window_s": stored_s,
            "window_bytes": self.module.nbytes,
            "splits": self.module.splits - self.splits,
            "merges": self.module.merges - self.merges,
            "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # its peak (Linux: KiB)
            "cpu": cpu.user + cpu.system,
            "comm": self.comm_seconds,
            "pss_start": self.pss_start,
        }
        self.splits, self.merges = self.module.splits, self.module.merges
        return levels
