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


class ResultSender:
    def __init__(self, comm: MPI.Comm, cfg: dict):
        self.comm, self.enabled = comm, bool(cfg["output"]["zmq_endpoint"])
        self.pending: list[tuple[MPI.Request, np.ndarray]] = []

    def send(self, dispatcher: int, epoch: int, r: np.ndarray, s: np.ndarray, delay: np.ndarray) -> None:
        """The results of `dispatcher`'s batch `epoch` (matching R rows `r` and S rows `s`) as RESULT_RECORD
        rows, to that dispatcher: it publishes them and punctuates for its own batches."""
        if not self.enabled:
            return
        self.pending = [(req, buf) for req, buf in self.pending if not req.Test()]
        rows = np.empty(len(r), dtype=wire.RESULT_RECORD)
        rows["r_id"], rows["s_id"], rows["r_key"], rows["s_key"] = r["id"], s["id"], r["key"], s["key"]
        rows["r_ts"], rows["s_ts"], rows["r_value"], rows["s_value"] = r["ts"], s["ts"], r["value"], s["value"]
        rows["delay"] = delay
        buf = wire.pack(wire.encode_results(rows, sender=self.comm.rank, seq=epoch))
        self.pending.append((self.comm.Isend([buf, MPI.BYTE], dest=dispatcher, tag=TAG_RESULTS), buf))

    def wait(self) -> None:
        MPI.Request.Waitall([req for req, _ in self.pending])
        self.pending = []
