"""A slave's half of the result stream (`output.zmq_endpoint`): each batch's results to the master.

One MPI message per chunk of a batch's results (slave.join.Chunk), at least one
per batch, even an empty one: the last says the batch is done, so the master's
punctuation can pass the batch's tuples (protocol.punctuation); the others are
marked `wire.MORE`.  Sent with Isend before the batch's report, so the master
never waits on it; at most `IN_FLIGHT` are on their way, so a master that
falls behind slows the slave instead of filling its memory.
"""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

from protocol import wire
from protocol.messages import TAG_RESULTS
from slave.join import Pairs

#: result messages a slave may have on their way to the master (each at most output.result_chunk_rows rows)
IN_FLIGHT = 2


class ResultSender:
    def __init__(self, comm: MPI.Comm, cfg: dict):
        self.comm, self.enabled = comm, bool(cfg["output"]["zmq_endpoint"])
        self.pending: list[tuple[MPI.Request, np.ndarray]] = []

    def send(self, dispatcher: int, seq: int, pairs: Pairs, delay: np.ndarray, last: bool) -> None:
        """A chunk of the results of `dispatcher`'s batch `seq` as RESULT_RECORD rows, to that dispatcher: it
        publishes them and punctuates for its own batches once the `last` has come."""
        if not self.enabled:
            return
        self.pending = [(req, buf) for req, buf in self.pending if not req.Test()]
        while len(self.pending) >= IN_FLIGHT:
            self.pending.pop(0)[0].Wait()
        buf, rows = wire.results_buffer(len(pairs), self.comm.rank, seq, 0.0 if last else wire.MORE)
        for name in wire.RESULT_RECORD.names:
            rows[name] = delay if name == "delay" else pairs.output(name)
        self.pending.append((self.comm.Isend([buf, MPI.BYTE], dest=dispatcher, tag=TAG_RESULTS), buf))

    def wait(self) -> None:
        MPI.Request.Waitall([req for req, _ in self.pending])
        self.pending = []
