"""The slave's MPI loop: receive a batch, join it, write results, report (thin shell around JoinModule).

Besides batches it serves the two halves of a partition-group move (paper 003,
IV-C): as supplier, on the master's MOVE order it sends the group's state to the
consumer; as consumer, it installs a state that arrives and tells the master.
"""
from __future__ import annotations

import signal
import time

import numpy as np
import psutil
import pyarrow as pa
from mpi4py import MPI

from protocol import delays
from protocol.messages import TAG_DATA, TAG_REPORT, TAG_STATE, Ack, Kind, decode_batch, encode_report
from protocol.mpi import recv_bytes, wait_probe
from protocol.output import write_table
from protocol.tuples import tuple_dtype
from slave.join import JoinModule
from slave.results_out import ResultSender
from slave.state import decode_group, encode_group


class ResultWriter:
    """Buffers result columns and writes them as files of about `flush_rows` rows."""

    def __init__(self, directory: str, rank: int, fmt: str, flush_rows: int):
        self.directory, self.rank, self.fmt, self.flush_rows = directory, rank, fmt, flush_rows
        self._parts: list[pa.Table] = []
        self._rows = 0
        self.files = 0

    def add(self, r: np.ndarray, s: np.ndarray, delay: np.ndarray) -> int:
        if len(r):
            self._parts.append(pa.table({
                "r_id": r["id"], "s_id": s["id"], "r_key": r["key"], "s_key": s["key"],
                "r_ts": r["ts"], "s_ts": s["ts"], "r_value": r["value"], "s_value": s["value"],
                "delay": delay,
            }))
            self._rows += len(r)
        return self.flush() if self._rows >= self.flush_rows else 0

    def flush(self) -> int:
        """Write what is buffered; returns the number of files written (0 or 1)."""
        if not self._parts:
            return 0
        write_table(self.directory, f"slave-{self.rank:03d}-{self.files:06d}", pa.concat_tables(self._parts), self.fmt)
        self._parts, self._rows = [], 0
        self.files += 1
        return 1


class Slave:
    def __init__(self, comm: MPI.Comm, cfg: dict):
        self.comm = comm
        self.dtype = tuple_dtype(cfg["generator"]["tuple_bytes"])
        tuning = cfg["tuning"]
        self.module = JoinModule(self.dtype, cfg["partitioning"]["partitions"], cfg["join"]["window"],
                                 tuning["block_size"], tuning["theta_min"], tuning["theta_max"], tuning["max_depth"])
        out = cfg["output"]
        self.writer = ResultWriter(f"{out['path']}/results", comm.rank, out["format"], out["flush_rows"])
        self.results_out = ResultSender(comm, cfg)
        self.process = psutil.Process()
        self.splits = self.merges = 0
        self.outgoing: list[tuple[MPI.Request, np.ndarray]] = []  #: group states on their way to consumers

    def report(self, counters: dict, hist: np.ndarray | None = None) -> None:
        stored_r, stored_s = self.module.stored()
        cpu = self.process.cpu_times()
        counters.update(window_r=stored_r, window_s=stored_s, window_bytes=self.module.nbytes,
                        splits=self.module.splits - self.splits, merges=self.module.merges - self.merges,
                        rss=self.process.memory_info().rss, cpu=cpu.user + cpu.system)
        self.splits, self.merges = self.module.splits, self.module.merges
        if hist is None:
            hist = np.zeros(delays.BINS, dtype=np.int64)
        self.comm.Send(encode_report(counters, hist), dest=0, tag=TAG_REPORT)

    def on_batch(self, head, fresh_r: np.ndarray, fresh_s: np.ndarray) -> None:
        started = time.perf_counter()
        r, s = self.module.process(fresh_r, fresh_s, float(head["watermark"]))
        delay = time.time() - np.maximum(r["arrival"], s["arrival"])
        files = self.writer.add(r, s, delay)
        self.results_out.send(int(head["epoch"]), r, s, delay)
        self.report({"epoch": float(head["epoch"]), "tuples_r": len(fresh_r), "tuples_s": len(fresh_s),
                     "results": len(r), "delay_max": float(delay.max()) if len(delay) else 0.0, "files": files,
                     "busy": time.perf_counter() - started, "ack": Ack.BATCH}, delays.histogram(delay))

    def on_move(self, head) -> None:
        """Supplier side: extract the group, send its state to the consumer, tell the master."""
        partition, consumer = int(head["partition"]), int(head["peer"])
        pg = self.module.extract(partition)
        buf = encode_group(partition, pg)
        self.outgoing.append((self.comm.Isend([buf, MPI.BYTE], dest=consumer, tag=TAG_STATE), buf))
        self.report({"epoch": float(head["epoch"]), "ack": Ack.MOVED, "partition": partition,
                     "moved_tuples": len(pg)})

    def on_state(self, buf: np.ndarray) -> None:
        """Consumer side: install a group's state, then tell the master it may route the group here."""
        partition, pg = decode_group(buf, self.module.new_group)
        self.module.install(partition, pg)
        self.report({"ack": Ack.INSTALLED, "partition": partition, "moved_tuples": len(pg)})

    def serve(self) -> int:
        while True:
            self.outgoing = [(req, buf) for req, buf in self.outgoing if not req.Test()]
            status = wait_probe(self.comm, MPI.ANY_SOURCE, MPI.ANY_TAG)
            buf = recv_bytes(self.comm, status)
            if status.Get_tag() == TAG_STATE:
                self.on_state(buf)
                continue
            head, fresh_r, fresh_s = decode_batch(buf, self.dtype)
            if head["kind"] == Kind.BATCH:
                self.on_batch(head, fresh_r, fresh_s)
            elif head["kind"] == Kind.MOVE:
                self.on_move(head)
            else:  # STOP: every move has been acknowledged before the master stops
                MPI.Request.Waitall([req for req, _ in self.outgoing])
                self.results_out.wait()
                self.report({"epoch": float(head["epoch"]), "files": self.writer.flush(), "ack": Ack.BATCH})
                return 0


def run(comm: MPI.Comm) -> int:
    cfg = comm.bcast(None, root=0)
    if cfg is None:  # the master refused the configuration, said why and exits non-zero
        return 0
    # mpirun forwards stop signals to every rank; the master alone decides when to stop.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    return Slave(comm, cfg).serve()
