"""The slave's MPI loop: receive a batch, join it, write results, report (thin shell around JoinModule)."""
from __future__ import annotations

import signal
import time

import numpy as np
import psutil
import pyarrow as pa
from mpi4py import MPI

from protocol import delays
from protocol.messages import TAG_DATA, TAG_REPORT, Kind, decode_batch, encode_report
from protocol.mpi import recv_bytes, wait_probe
from protocol.output import write_table
from protocol.tuples import tuple_dtype
from slave.join import JoinModule


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


def run(comm: MPI.Comm) -> int:
    cfg = comm.bcast(None, root=0)
    if cfg is None:  # the master refused the configuration, said why and exits non-zero
        return 0
    # mpirun forwards stop signals to every rank; the master alone decides when to stop.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    dtype = tuple_dtype(cfg["generator"]["tuple_bytes"])
    tuning = cfg["tuning"]
    module = JoinModule(dtype, cfg["partitioning"]["partitions"], cfg["join"]["window"], tuning["block_size"],
                        tuning["theta_min"], tuning["theta_max"], tuning["max_depth"])
    out = cfg["output"]
    writer = ResultWriter(f"{out['path']}/results", comm.rank, out["format"], out["flush_rows"])
    splits = merges = 0
    process = psutil.Process()
    while True:
        status = wait_probe(comm, 0, TAG_DATA)
        head, fresh_r, fresh_s = decode_batch(recv_bytes(comm, status), dtype)
        started = time.perf_counter()
        counters = {"epoch": float(head["epoch"])}
        hist = np.zeros(delays.BINS, dtype=np.int64)
        if head["kind"] == Kind.BATCH:
            r, s = module.process(fresh_r, fresh_s, float(head["watermark"]))
            delay = time.time() - np.maximum(r["arrival"], s["arrival"])
            hist = delays.histogram(delay)
            counters.update(tuples_r=len(fresh_r), tuples_s=len(fresh_s), results=len(r),
                            delay_max=float(delay.max()) if len(delay) else 0.0,
                            files=writer.add(r, s, delay))
        else:
            counters["files"] = writer.flush()
        stored_r, stored_s = module.stored()
        counters.update(window_r=stored_r, window_s=stored_s, window_bytes=module.nbytes,
                        splits=module.splits - splits, merges=module.merges - merges,
                        busy=time.perf_counter() - started, rss=process.memory_info().rss)
        splits, merges = module.splits, module.merges
        comm.Send(encode_report(counters, hist), dest=0, tag=TAG_REPORT)
        if head["kind"] == Kind.STOP:
            return 0
