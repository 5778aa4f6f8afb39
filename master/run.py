"""The master's loop (paper 003, Algorithm 1): ingest, distribute per sub-group slot, collect reports.

Time is divided into distribution epochs; each epoch has one slot per
sub-group of slaves (section V-B).  At its slot a slave that has finished its
previous batch gets the drained mini-buffers of its partitions in one message;
a slave still busy keeps accumulating in the mini-buffers until its next slot,
which is the back-pressure that bounds the work in flight.  Ingest pauses while
the mini-buffers hold `master.buffer_capacity` tuples.
"""
from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
from mpi4py import MPI

from master.buffers import MiniBuffers
from master.controller import Controller
from master.ingest import late_mask, to_wire
from master.stats import RunStats, print_summary, write_summary
from protocol.messages import REPORT_LEN, TAG_DATA, TAG_REPORT, Ack, Kind, decode_report, encode_batch
from protocol.output import write_table
from protocol.tuples import STREAM_NAMES, STREAM_R, STREAM_S, tuple_dtype


class Master:
    def __init__(self, comm: MPI.Comm, cfg: dict, source):
        self.comm, self.cfg, self.source = comm, cfg, source
        self.slaves = list(range(1, comm.size))
        parts = cfg["partitioning"]["partitions"]
        groups = min(cfg["partitioning"]["subgroups"], len(self.slaves))
        self.controller = Controller(cfg, self.slaves, parts)
        self.subgroups = [self.slaves[g::groups] for g in range(groups)]
        self.dtype = tuple_dtype(cfg["generator"]["tuple_bytes"])
        self.buffers = MiniBuffers(parts, self.dtype)
        self.stats = RunStats(self.slaves)
        self.busy: dict[int, tuple[MPI.Request, np.ndarray]] = {}  #: rank -> (send request, its buffer)
        self.epoch = {r: 0 for r in self.slaves}
        self.sent_watermark = {r: -np.inf for r in self.slaves}
        self.in_batch = dict.fromkeys(self.slaves, 0)  #: tuples of the batch each slave is joining
        self.max_ts = -np.inf
        self.exhausted = False
        self._late_parts: list[pa.Table] = []
        self._late_files = 0
        self._stop_requested = False
        #: paced ingest tick: a tenth of a sub-group slot, at most 10 ms (bounds the delay it adds)
        self.ingest_interval = min(0.01, cfg["epochs"]["distribution"] / groups / 10)
        self._last_ingest = 0.0

    # -- ingest ---------------------------------------------------------------------------------
    def _ingest(self, now: float) -> int:
        """Pull what has arrived (paced) or what fits (unpaced) from the source; returns tuples taken."""
        src = self.cfg["source"]
        room = self.cfg["master"]["buffer_capacity"] - len(self.buffers)
        limit = min(src["batch"], room)
        if src["rate"] > 0:
            if now - self._last_ingest < self.ingest_interval:
                return 0  # paced input is taken in ticks, not tuple by tuple
            due = int((now - self.t0) * src["rate"]) - self.stats.ingested - self.stats.late
            # how far ingest is behind the pacing schedule: grows only when the cluster cannot keep up
            self.stats.pacing_lag_max = max(self.stats.pacing_lag_max, (due - limit) / src["rate"])
            limit = min(limit, due)
        if self.exhausted or limit <= 0:
            return 0
        self._last_ingest = now
        chunk = self.source.next_chunk(limit)
        if chunk is None:
            self.exhausted = True
            return 0
        n = len(chunk.ts)
        if src["rate"] > 0:  # nominal arrival of each tuple, so master-side queueing counts as delay
            first = self.stats.ingested + self.stats.late
            arrival = self.t0 + (first + np.arange(n)) / src["rate"]
        else:
            arrival = np.full(n, now)
        late, prev_max, self.max_ts = late_mask(chunk.ts, self.max_ts, self.cfg["join"]["max_delay"])
        if late.any():
            self._set_aside_late(chunk, late, prev_max)
        on_time = ~late
        for stream in (STREAM_R, STREAM_S):
            sel = on_time & (chunk.stream == stream)
            self.stats.input[STREAM_NAMES[stream]] += int(sel.sum())
            self.buffers.add(stream, to_wire(self.dtype, chunk.id[sel], chunk.ts[sel], chunk.key[sel],
                                             chunk.value[sel], arrival[sel]))
        return n

    def _set_aside_late(self, chunk, late: np.ndarray, prev_max: np.ndarray) -> None:
        md = self.cfg["join"]["max_delay"]
        self.stats.late += int(late.sum())
        bound = prev_max[late] - md
        self._late_parts.append(pa.table({
            "stream": np.array(STREAM_NAMES)[chunk.stream[late]], "id": chunk.id[late], "ts": chunk.ts[late],
            "key": chunk.key[late], "value": chunk.value[late],
            "reason": pa.repeat(f"late: ts below max ts seen before minus join.max_delay ({md})", int(late.sum())),
            "bound": bound,
        }))
        if sum(t.num_rows for t in self._late_parts) >= self.cfg["output"]["flush_rows"]:
            self._flush_late()

    def _flush_late(self) -> None:
        if self._late_parts:
            write_table(Path(self.cfg["output"]["path"]) / "late", f"late-{self._late_files:06d}",
                        pa.concat_tables(self._late_parts), self.cfg["output"]["format"])
            self._late_parts, self._late_files = [], self._late_files + 1

    # -- distribution -----------------------------------------------------------------------------
    def _distribute(self, group: list[int]) -> None:
        """Serve one sub-group: every idle slave in it gets its partitions' tuples in one message."""
        watermark = min(self.max_ts - self.cfg["join"]["max_delay"], self.controller.watermark_cap())
        for rank in group:
            mine = self.controller.partitions_of(rank)
            sizes = self.buffers.counts[:, mine].sum(axis=0)
            if rank in self.busy:  # still joining its last batch: all of it and what waits here is unjoined
                self.controller.on_slot(rank, self.in_batch[rank] + int(sizes.sum()))
                continue
            self.controller.on_slot(rank, 0)
            if len(mine) == 0 or (not sizes.any() and watermark <= self.sent_watermark[rank]):
                continue  # nothing new: no tuples and no punctuation that would let the slave expire blocks
            self.sent_watermark[rank] = watermark
            self.controller.on_batch(mine, sizes)
            r, s = self.buffers.drain(mine)
            self.epoch[rank] += 1
            self.in_batch[rank] = len(r) + len(s)
            self._send(rank, encode_batch(Kind.BATCH, self.epoch[rank], watermark, r, s))

    def _send(self, rank: int, buf: np.ndarray) -> None:
        """Isend a message; the slave counts as busy until its report for it arrives."""
        self.busy[rank] = (self.comm.Isend([buf, MPI.BYTE], dest=rank, tag=TAG_DATA), buf)

    def _start_moves(self) -> None:
        """MOVE orders to the suppliers of queued moves that are idle (paper IV-C)."""
        empty = np.empty(0, dtype=self.dtype)
        for move in self.controller.next_orders(lambda rank: rank not in self.busy, self.sent_watermark.get):
            self.in_batch[move.supplier] = 0
            self._send(move.supplier, encode_batch(Kind.MOVE, self.epoch[move.supplier], np.nan, empty, empty,
                                                   partition=move.partition, peer=move.consumer))

    def _collect_reports(self) -> int:
        got = 0
        status = MPI.Status()
        report = np.empty(REPORT_LEN, dtype=np.float64)
        while self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=TAG_REPORT, status=status):
            rank = status.Get_source()
            self.comm.Recv([report, MPI.DOUBLE], source=rank, tag=TAG_REPORT)
            counters, hist = decode_report(report)
            got += 1
            self.stats.add_report(rank, counters, hist)
            if counters["ack"] == Ack.INSTALLED:  # not an answer to a message of ours: the consumer's news
                move = self.controller.on_installed(int(counters["partition"]), int(counters["moved_tuples"]),
                                                    time.time())
                self.stats.tuples_moved += int(counters["moved_tuples"])
                print(f"moved partition-group {move.partition}: slave {move.supplier} -> {move.consumer} "
                      f"({int(counters['moved_tuples']):,} tuples, {move.reason})", file=sys.stderr, flush=True)
                continue
            self.controller.on_work(rank, int(counters["tuples_r"] + counters["tuples_s"]), counters["busy"])
            request, _ = self.busy.pop(rank)
            request.Wait()
        return got

    # -- the loop -------------------------------------------------------------------------------------
    def _request_stop(self, signum, frame) -> None:
        if self._stop_requested:  # second signal: give up at once
            raise KeyboardInterrupt
        self._stop_requested = True
        self.stats.stopped_by_signal = True
        print("stopping: no more input; joining what was accepted, flushing results ...", file=sys.stderr, flush=True)

    def run(self) -> dict:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._request_stop)
        out = Path(self.cfg["output"]["path"])
        if self.source.rejected is not None and self.source.rejected.num_rows:
            self.stats.rejected = self.source.rejected.num_rows
            write_table(out / "rejected", "rejected", self.source.rejected, self.cfg["output"]["format"])
        slot = self.cfg["epochs"]["distribution"] / len(self.subgroups)
        progress = self.cfg["output"]["progress"]
        self.t0 = self.stats.started = time.time()
        next_slot, next_progress, g = self.t0 + slot, self.t0 + progress, 0
        reorganization = self.cfg["epochs"]["reorganization"]
        next_reorganization = self.t0 + reorganization
        while True:
            now = time.time()
            if self._stop_requested:
                self.exhausted = True
            worked = self._ingest(now) + self._collect_reports()
            if now >= next_slot:
                self._distribute(self.subgroups[g])
                g = (g + 1) % len(self.subgroups)
                next_slot = max(next_slot + slot, now)
                worked += 1
            if now >= next_reorganization:
                if not self.exhausted:
                    self.controller.reorganize(now)
                next_reorganization = now + reorganization
            self._start_moves()
            if progress and now >= next_progress:
                print(self.stats.progress_line(len(self.buffers), len(self.controller.active),
                                               len(self.controller.moves_log)), file=sys.stderr, flush=True)
                next_progress = now + progress
            if self.exhausted and len(self.buffers) == 0 and not self.busy and not self.controller.busy:
                break
            if not worked:
                time.sleep(min(2e-3, max(0.0, next_slot - time.time())))
        self._stop_slaves()
        self._flush_late()
        summary = self.stats.summary(self.cfg)
        summary["balance"] = {"reorganizations": self.controller.reorganizations, "moves": self.controller.moves_log,
                              "active_changes": self.controller.active_log,
                              "active_at_end": sorted(self.controller.active),
                              "occupancy": self.controller.occupancy_log}
        write_summary(out / "summary.json", summary)
        print_summary(summary)
        return summary

    def _stop_slaves(self) -> None:
        """STOP to every slave, then wait for each final report (results flushed)."""
        empty = np.empty(0, dtype=self.dtype)
        for rank in self.slaves:
            buf = encode_batch(Kind.STOP, self.epoch[rank] + 1, np.inf, empty, empty)
            self.busy[rank] = (self.comm.Isend([buf, MPI.BYTE], dest=rank, tag=TAG_DATA), buf)
        while self.busy:
            if not self._collect_reports():
                time.sleep(1e-3)
