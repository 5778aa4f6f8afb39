"""A slave's half of the result stream (`output.zmq_endpoint`): each batch's results to the master.

One MPI message per batch, even an empty one, so the master knows the batch is
done and its punctuation can pass the batch's tuples (protocol.punctuation).
Sent with Isend before the batch's report, so the master never waits on it.
"""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

from protocol import wire
from protocol.messages import TAG_RESULTS
from slave.join import Pairs


class ResultSender:
    def __init__(self, comm: MPI.Comm, cfg: dict):
        self.comm, self.enabled = comm, bool(cfg["output"]["zmq_endpoint"])
        self.pending: list[tuple[MPI.Request, np.ndarray]] = []

    def send(self, dispatcher: int, seq: int, pairs: Pairs, delay: np.ndarray) -> None:
        """The results of `dispatcher`'s batch `seq` as RESULT_RECORD rows, to that dispatcher: it publishes
        them and punctuates for its own batches."""
        if not self.enabled:
            return
        self.pending = [(req, buf) for req, buf in self.pending if not req.Test()]
        rows = np.empty(len(pairs), dtype=wire.RESULT_RECORD)
        for name in wire.RESULT_RECORD.names:
            rows[name] = delay if name == "delay" else pairs.output(name)
        buf = wire.pack(wire.encode_results(rows, sender=self.comm.rank, seq=seq))
        self.pending.append((self.comm.Isend([buf, MPI.BYTE], dest=dispatcher, tag=TAG_RESULTS), buf))

    def wait(self) -> None:
        MPI.Request.Waitall([req for req, _ in self.pending])
        self.pending = []
