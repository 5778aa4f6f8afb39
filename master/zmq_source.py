"""Live ingest over ZeroMQ (`source.kind = "zmq"`): a PULL socket that producers PUSH tuple batches to.

Backpressure: the socket's receive high-water mark is `RCVHWM` messages and the
master asks for tuples only while its mini-buffers have room (it pauses at
`master.buffer_capacity`), so when the cluster falls behind the queues fill and
the producers' sends block at their own SNDHWM instead of memory growing here.
At most one message's tuples wait in this source (`held_peak_tuples` in the
summary).  Each producer reports in its END message how many seconds its sends
were blocked; the summary sums them (`producers_blocked_seconds`).

Messages are validated whole (protocol.wire.decode): a bad one is dropped,
counted by reason and listed in `rejected/zmq-rejected.*` at the end; the run
goes on.  A frame far above the largest valid one (twice it, plus 1 MiB) is
not read at all: ZeroMQ disconnects its sender (ZMQ_MAXMSGSIZE), which
reconnects; one a little too large is read and rejected whole like any bad
message, so its sender's later messages still count.  The input ends after `source.producers` END messages, after
`source.idle_timeout` seconds without any message, or on a stop signal.
"""
from __future__ import annotations

import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import zmq

from protocol import wire
from protocol.chunks import Chunk, InputError, concat, rows
from protocol.output import write_table
from protocol.zmq_security import bind_server, stop_authenticators

#: messages the PULL socket queues, and its kernel receive buffer (bytes; a fixed size stops TCP
#: autotuning from buffering megabytes before the producer feels the backpressure)
RCVHWM = 4
RCVBUF = 128 * 1024
#: rejected messages listed in the rejected/ file (all are counted)
MAX_LISTED = 10000


class ZmqSource:
    def __init__(self, cfg: dict):
        src = cfg["source"]
        self.endpoint, self.producers = src["endpoint"], src["producers"]
        self.idle_timeout, self.max_tuples = src["idle_timeout"], src["max_message_tuples"]
        self.out, self.fmt = Path(cfg["output"]["path"]), cfg["output"]["format"]
        self.rejected_stem = "zmq-rejected"  #: several dispatchers: each its own file (master.source.open_shard)
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.PULL)
        self.sock.rcvhwm, self.sock.rcvbuf = RCVHWM, RCVBUF
        # a frame far larger than the largest valid one (max_message_tuples rows) is refused as it arrives:
        # ZeroMQ drops its sender's connection instead of reading it whole into memory (a 1 GiB frame cost 1 GiB
        # here); the connection and the messages queued on it are lost, so a merely oversized message is not
        self.sock.maxmsgsize = 2 * self.max_tuples * wire.TUPLE_RECORD.itemsize + (1 << 20)
        self.sock.linger = 0
        try:
            bind_server(self.sock, self.endpoint, cfg["security"])
        except zmq.ZMQError as e:
            self.sock.close()
            raise InputError(f"cannot bind source.endpoint {self.endpoint!r}: {e}") from None
        self.endpoint = self.sock.last_endpoint.decode()  # the real port when bound to port *
        self._pending: Chunk | None = None  #: the rest of a message larger than the master's room
        self.ended = 0
        self.messages = self.tuples = self.held_peak = 0
        self.blocked_seconds = 0.0
        self.reasons: Counter[str] = Counter()
        self._rejections: list[dict] = []
        self._last_message = time.monotonic()
        self._finished: dict | None = None
        print(f"ingest: waiting for {self.producers} producer(s) on {self.endpoint}", file=sys.stderr, flush=True)

    def next_chunk(self, limit: int) -> Chunk | None:
        """Up to `limit` tuples of what has arrived (an empty Chunk if none yet); None once the input ended."""
        if limit < 1:
            raise ValueError(f"limit must be positive, got {limit}")
        parts, room = [], limit
        while room > 0:
            if self._pending is None and not self._receive():
                break
            chunk = self._pending
            n = len(chunk.id)
            parts.append(rows(chunk, 0, room))
            self._pending = rows(chunk, room) if n > room else None
            room -= min(n, room)
        if not parts and self._at_end():
            return None
        return concat(parts)

    def _at_end(self) -> bool:
        if self.ended >= self.producers:
            return True
        return self.idle_timeout > 0 and time.monotonic() - self._last_message > self.idle_timeout

    def _receive(self) -> bool:
        """Take messages until one with tuples is pending; False when none is waiting."""
        while self.ended < self.producers:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return False
            self._last_message = time.monotonic()
            self.messages += 1
            msg = wire.decode([f.buffer for f in frames], (wire.Kind.TUPLES, wire.Kind.END), self.max_tuples)
            if isinstance(msg, wire.Rejection):
                self._reject(msg, sum(len(f) for f in frames))
            elif msg.kind == wire.Kind.END:
                self.ended += 1
                self.blocked_seconds += max(msg.mark, 0.0) if np.isfinite(msg.mark) else 0.0
                print(f"ingest: producer {msg.sender} done ({self.ended}/{self.producers}), "
                      f"held back {msg.mark:.2f}s", file=sys.stderr, flush=True)
            elif len(msg.rows):
                r = msg.rows
                self._pending = Chunk(r["stream"].copy(), r["id"].copy(), r["ts"].copy(), r["key"].copy(),
                                      r["value"].copy())
                self.tuples += len(r)
                self.held_peak = max(self.held_peak, len(r))
                return True
        return False

    def _reject(self, rej: wire.Rejection, nbytes: int) -> None:
        if not self.reasons[rej.reason]:
            print(f"ingest: rejected message {self.messages} ({rej.reason}: {rej.detail}); "
                  "further rejections are counted in the summary", file=sys.stderr, flush=True)
        self.reasons[rej.reason] += 1
        if len(self._rejections) < MAX_LISTED:
            self._rejections.append({"endpoint": self.endpoint, "message": self.messages, "bytes": nbytes,
                                     "reason": rej.reason, "detail": f"{wire.REASONS[rej.reason]}: {rej.detail}"})

    @staticmethod
    def merge(finished: list[dict]) -> dict:
        """Several dispatchers' `finish()` entries as one: counts added, peaks the largest, endpoints listed."""
        z = [f["zmq_ingest"] for f in finished]
        reasons: dict[str, int] = {}
        for x in z:
            for reason, n in x["rejected_by_reason"].items():
                reasons[reason] = reasons.get(reason, 0) + n
        return {"rejected": sum(f["rejected"] for f in finished), "zmq_ingest": {
            "endpoints": [e for x in z for e in x["endpoints"]],
            **{key: sum(x[key] for x in z) for key in ("messages", "tuples", "producers_ended")},
            "rejected_by_reason": reasons,
            "producers_blocked_seconds": round(sum(x["producers_blocked_seconds"] for x in z), 3),
            "held_peak_tuples": max(x["held_peak_tuples"] for x in z)}}

    def finish(self) -> dict:
        """Close the socket, write rejected/zmq-rejected.*, and return the summary entries (once)."""
        if self._finished is None:
            self.sock.close()
            stop_authenticators()
            if self._rejections:
                write_table(self.out / "rejected", self.rejected_stem, pa.Table.from_pylist(self._rejections),
                            self.fmt)
            self._finished = {"rejected": sum(self.reasons.values()), "zmq_ingest": {
                "endpoints": [self.endpoint], "messages": self.messages, "tuples": self.tuples,
                "producers_ended": self.ended, "rejected_by_reason": dict(self.reasons),
                "producers_blocked_seconds": round(self.blocked_seconds, 3), "held_peak_tuples": self.held_peak}}
        return self._finished
