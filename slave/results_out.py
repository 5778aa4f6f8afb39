"""A slave's half of the result stream (`output.zmq_endpoint`): each batch's results to the master.

One MPI message per chunk of a batch's results (slave.join.Chunk), at least one
per batch, even an empty one: the last says the batch is done, so the master's
punctuation can pass the batch's tuples (master.punctuation); the others are
marked `wire.MORE`.  The last carries the watermark the slave decided rows alone
by (its `floor`).  With a join type other than inner the records are
ROW_RECORDs, and the rows without a partner the batch decided (semi: R rows with
one) follow its pairs in the last message, each with its kind, its stream time
(slave.join.JoinModule.stream_times) and the other side's fields as the
wire's null (id and key 0, ts and value NaN).  With declared streams (`[streams]`) a
message is a TABLE instead: the rows as the result files have them, with the
streams' own columns (gathered once, for both: slave.result_files), and their
stream time.  Each STOP is answered in the
same way.  Sent with Issend before the batch's report, so the master never
waits on it; a synchronous send is done only once the master has taken the
message, and at most `IN_FLIGHT` are on their way: a master that falls behind,
or holds results back for a subscriber behind (master.result_stream), slows the
slave instead of filling its memory or MPI's queues.  With an ordered stream a
message holds at most 1/8 of the stream's bound of records
(protocol.wire.chunk_rows), so what the master takes past its bound is small.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import time

import numpy as np
import pyarrow as pa
from mpi4py import MPI

from protocol import eventtime, wire
from protocol.messages import TAG_RESULTS
from protocol.output import LEFT_MATCHED, LEFT_UNMATCHED, MATCHED, RIGHT_UNMATCHED
from slave.join import Pairs

if TYPE_CHECKING:
    from protocol.plan import Plan

#: result messages a slave may have on their way to the master (each at most output.result_chunk_rows rows)
IN_FLIGHT = 2
#: the largest send buffer kept for reuse (ResultSender.spare): a larger one is given back when its send is done
SPARE_BYTES = 1 << 27


class ResultSender:
    def __init__(self, comm: MPI.Comm, plan: Plan):
        self.comm, self.enabled = comm, bool(plan.output.zmq_endpoint)
        self.join_type = plan.join.type
        self.tables = bool(plan.streams)  #: declared streams: TABLE messages
        self.record = wire.RESULT_RECORD if self.join_type == "inner" else wire.ROW_RECORD
        self.pending: list[tuple[MPI.Request, np.ndarray]] = []
        #: buffers of completed sends (at most SPARE_BYTES each), the largest IN_FLIGHT, refilled by TABLEs:
        #: writing a message into fresh pages cost a slave more than encoding it (page faults), so they are kept
        self.spare: list[np.ndarray] = []

    def send(
        self,
        dispatcher: int,
        seq: int,
        pairs: Pairs,
        delay: np.ndarray,
        last: bool,
        watermark: int = eventtime.NEG_INF,
        table: pa.Table | None = None,
    ) -> None:
        """A chunk of the results of `dispatcher`'s batch `seq`, to that dispatcher: it publishes them and
        punctuates for its own batches once the `last` has come (with the `watermark` rows alone were decided
        by); `table`: the pairs as written, with declared streams."""
        if not self.enabled:
            return
        if self.tables:  # a pair's stream time: its later ts
            times = eventtime.to_seconds(np.maximum(pairs["r_ts"], pairs["s_ts"]))
            return self._send_table(dispatcher, seq, table, times, last, watermark)
        buf, rows = self._buffer(len(pairs), seq, last, watermark)
        for name in wire.RESULT_RECORD.names:
            rows[name] = delay if name == "delay" else pairs.output(name)
        if self.record == wire.ROW_RECORD:
            rows["time"] = wire.stream_time(rows[["r_ts", "s_ts"]])  # a pair's: its later ts
            rows["kind"] = wire.ROW_KINDS.index(MATCHED)
        self._send(dispatcher, buf)

    def send_lone(
        self,
        dispatcher: int,
        seq: int,
        lone_r: np.ndarray,
        lone_s: np.ndarray,
        times: tuple[np.ndarray, np.ndarray],
        watermark: int,
        table: pa.Table | None = None,
    ) -> None:
        """The last message of `dispatcher`'s batch (or STOP) `seq`: the rows it decided alone (semi: R rows with
        a partner) with their stream `times` (microseconds), decided by `watermark`; `table`: those rows as
        written, with declared streams."""
        if not self.enabled:
            return
        if self.tables:
            return self._send_table(
                dispatcher, seq, table, eventtime.to_seconds(np.concatenate(times)), True, watermark
            )
        buf, rows = self._buffer(len(lone_r) + len(lone_s), seq, True, watermark)
        now = time.time()
        kind_r = LEFT_MATCHED if self.join_type == "semi" else LEFT_UNMATCHED
        for part, side, kind, at in (
            (lone_r, "r", kind_r, slice(0, len(lone_r))),
            (lone_s, "s", RIGHT_UNMATCHED, slice(len(lone_r), len(rows))),
        ):
            other = "s" if side == "r" else "r"
            out = rows[at]
            for field in ("id", "ts", "key", "value"):  # this side's, the other side's null
                out[f"{side}_{field}"] = eventtime.to_seconds(part["ts"]) if field == "ts" else part[field]
                out[f"{other}_{field}"] = np.nan if field in ("ts", "value") else 0
            out["delay"] = now - part["arrival"]
            out["kind"] = wire.ROW_KINDS.index(kind)
        rows["time"] = eventtime.to_seconds(np.concatenate(times))
        self._send(dispatcher, buf)

    def answer(self, dispatcher: int, seq: int) -> None:
        """The last message, without rows, of `dispatcher`'s STOP `seq` that decides nothing here (it is not the
        last STOP, or the join is inner): the watermark sent is NEG_INF, which bounds anything."""
        if self.enabled and self.tables:
            self._send_table(dispatcher, seq, None, np.empty(0), True, eventtime.NEG_INF)
        elif self.enabled:
            self._send(dispatcher, self._buffer(0, seq, True, eventtime.NEG_INF)[0])

    def _send_table(
        self, dispatcher: int, seq: int, table: pa.Table | None, times: np.ndarray, last: bool, watermark: int
    ) -> None:
        """A TABLE message: `table` (None: no rows) with its rows' stream `times` (seconds) as `time`."""
        table = pa.table({}) if table is None else table.append_column("time", pa.array(times, pa.float64()))
        self._room()
        self._send(
            dispatcher, wire.table_buffer(table, self.comm.rank, seq, watermark if last else wire.MORE, self._alloc)
        )

    def _alloc(self, size: int) -> np.ndarray:
        """A send buffer of `size` bytes: the smallest spare one that is large enough, else a new one."""
        for i, spare in enumerate(self.spare):
            if len(spare) >= size:
                return self.spare.pop(i)[:size]
        return wire.new_bytes(size)

    def _buffer(self, count: int, seq: int, last: bool, watermark: int) -> tuple[np.ndarray, np.ndarray]:
        """A message of `count` records to fill, once at most IN_FLIGHT - 1 others are on their way."""
        self._room()
        return wire.results_buffer(count, self.comm.rank, seq, watermark if last else wire.MORE, self.record)

    def _room(self) -> None:
        """Wait until at most IN_FLIGHT - 1 messages are on their way; the buffers of those sent are spare."""
        done = [req.Test() for req, _ in self.pending]
        sent = [buf for (_, buf), d in zip(self.pending, done) if d]
        self.pending = [p for p, d in zip(self.pending, done) if not d]
        while len(self.pending) >= IN_FLIGHT:
            req, buf = self.pending.pop(0)
            req.Wait()
            sent.append(buf)
        whole = [buf if buf.base is None else buf.base for buf in sent]
        self.spare = sorted([*self.spare, *(b for b in whole if len(b) <= SPARE_BYTES)], key=len)[-IN_FLIGHT:]

    def _send(self, dispatcher: int, buf: np.ndarray) -> None:
        self.pending.append((self.comm.Issend([buf, MPI.BYTE], dest=dispatcher, tag=TAG_RESULTS), buf))

    def wait(self) -> None:
        MPI.Request.Waitall([req for req, _ in self.pending])
        self.pending = []
