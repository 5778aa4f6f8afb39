"""Producers pushing to a live ZeroMQ input: the PULL socket they PUSH to, who they are, what of theirs was taken,
and the acknowledgements.  Shared by the live streams (master.sources.live): the single file's tuples
(`source.kind = "zmq"`, TUPLES messages) and a declared stream's Arrow batches (`[streams.NAME] endpoint`, BATCH).

Backpressure: the socket's receive high-water mark is `RCVHWM` messages and the
master takes a message only when it needs more rows (it pauses at
`master.buffer_capacity`), so when the cluster falls behind the queues fill and
the producers' sends block at their own SNDHWM instead of memory growing here.
At most one message's rows wait in the master (`held_peak_tuples` in the
summary).  Each producer reports in its END message how many seconds its sends
were blocked; the summary sums them (`producers_blocked_seconds`).

Messages are validated whole (protocol.wire.decode): a bad one is dropped,
counted by reason and listed in `rejected/zmq-rejected*.*` at the end; the run
goes on.  A frame far above the largest valid one (twice it, plus 1 MiB) is
not read at all: ZeroMQ disconnects its sender (ZMQ_MAXMSGSIZE), which
reconnects; one a little too large is read and rejected whole like any bad
message, so its sender's later messages still count.  The input ends after `producers` END messages
(one per producer), after `idle_timeout` seconds without any message, or on a stop signal.

Producers (docs/live-input-and-result-stream.md): a message with an ORIGIN frame (protocol.wire) names its
producer and its position (rows it sent before).  With `source.token` set only messages carrying its digest
are taken; the others, an END included, are refused and counted (`zmq_ingest.refused_*`).  Per producer the
master keeps the rows taken: a message repeating some (a resend) is trimmed or dropped, one past them counts
the difference as lost.  That position is part of every checkpoint; once a checkpoint is complete the master
publishes it on the `ack_endpoint` (ACK messages, also every ACK_INTERVAL and, marked final, at the end),
so a producer keeps only what no checkpoint holds and, after a crash, resends it to the new run (messages still
addressed to the crashed run are dropped as stale: the resend repeats them in order).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import hmac
import os
import sys
import time
from collections import Counter

import numpy as np
import pyarrow as pa
import zmq

from protocol import wire
from common.chunks import InputError
from protocol.access import source_token
from protocol.output import write_table
from common.zmq_security import bind_server, stop_authenticators

if TYPE_CHECKING:
    from protocol.plan import Plan, Security

#: messages the PULL socket queues, and its kernel receive buffer (bytes; a fixed size stops TCP
#: autotuning from buffering megabytes before the producer feels the backpressure)
RCVHWM = 4
RCVBUF = 128 * 1024
#: rejected messages listed in the rejected/ file (all are counted)
MAX_LISTED = 10000
#: seconds between two ACK messages repeating the last one (how soon a producer learns of a new run)
ACK_INTERVAL = 0.2
#: milliseconds the final ACK may take to reach the producers when the run ends
ACK_LINGER = 2000


class Producers:
    """The producers of `plan.source`'s `endpoint` (`producers`, `idle_timeout`, `ack_endpoint`, `token`), their
    rejected messages listed in `rejected/<rejected_stem>.*`; `where`: the config table the endpoints are set in,
    as errors name them."""

    #: bytes per row the largest valid message may have (a TUPLES record; Arrow rows are wider)
    record_bytes = wire.TUPLE_RECORD.itemsize

    def __init__(self, plan: Plan, rejected_stem: str, where: str = "source"):
        src = plan.source
        self.endpoint, self.producers = src.endpoint, src.producers
        self.idle_timeout, self.max_tuples = src.idle_timeout, src.max_message_tuples
        self.out, self.fmt = plan.output.path, plan.output.format
        self.rejected_stem = rejected_stem
        token = source_token(src)
        self.digest = wire.token_digest(token) if token else None  #: None: no check (the token is not kept)
        self.run = int.from_bytes(os.urandom(8), "little") | 1  #: this master's run, which producers address
        self.ctx = zmq.Context.instance()
        self.sock = self._bind(zmq.PULL, self.endpoint, plan.security, f"{where}.endpoint")
        self.endpoint = self.sock.last_endpoint.decode()  # the real port when bound to port *
        self.acks = None  #: PUB of the acknowledgements, in a context of its own (terminated to deliver the last)
        if src.ack_endpoint:
            try:
                self.acks = self._bind(zmq.PUB, src.ack_endpoint, plan.security, f"{where}.ack_endpoint", zmq.Context())
            except InputError:
                self.sock.close()
                raise
        self.taken: dict[bytes, int] = {}  #: per producer: its tuples taken so far (its position)
        self.ended_by: set[bytes] = set()
        self.anonymous_ended = self.ended = 0
        self.lost = self.duplicates = self.stale = 0  #: tuples never received; tuples and messages dropped
        self.messages = self.tuples = self.held_peak = 0
        self.blocked_seconds = 0.0
        self.reasons: Counter[str] = Counter()
        self.refused: Counter[str] = Counter()  #: messages of producers without the token, by kind
        self.refused_tuples = 0
        self._rejections: list[dict] = []
        self.acked: dict = self.producers_position()  #: what the last complete checkpoint holds
        self.acknowledged = 0  #: complete checkpoints this dispatcher was told of (and published, with acks)
        self._next_ack = 0.0
        self.last_message = time.monotonic()  #: when a message last came (idleness)
        self._finished: dict | None = None
        who = (
            "producers must present source.token"
            if token
            else "CURVE keys let producers in"
            if plan.security.server_key
            else "no source.token and no CURVE: any local process can feed the input and end it"
        )
        acks = f"; acknowledgements on {self.acks.last_endpoint.decode()}" if self.acks else ""
        print(
            f"ingest: waiting for {self.producers} producer(s) on {self.endpoint} ({who}){acks}",
            file=sys.stderr,
            flush=True,
        )

    def _bind(
        self, kind: int, endpoint: str, security: Security, key: str, ctx: zmq.Context | None = None
    ) -> zmq.Socket:
        sock = (ctx or self.ctx).socket(kind)
        if kind == zmq.PULL:
            # a frame far larger than the largest valid one (max_message_tuples rows) is refused as it arrives:
            # ZeroMQ drops its sender's connection instead of reading it whole into memory (a 1 GiB frame cost
            # 1 GiB here); the connection and the messages queued on it are lost, so a merely oversized message
            # is not
            sock.maxmsgsize = 2 * self.max_tuples * self.record_bytes + (1 << 20)
            sock.rcvhwm, sock.rcvbuf = RCVHWM, RCVBUF
        sock.linger = 0 if kind == zmq.PULL else ACK_LINGER
        try:
            bind_server(sock, endpoint, security)
        except zmq.ZMQError as e:
            sock.close()
            raise InputError(f"cannot bind {key} {endpoint!r}: {e}") from None
        return sock

    @property
    def done(self) -> bool:
        """Every producer sent its END, or (`idle_timeout` > 0) no message came for that long."""
        if self.ended >= self.producers:
            return True
        return self.idle_timeout > 0 and time.monotonic() - self.last_message > self.idle_timeout

    def _messages(self, kind: wire.Frame):
        """The waiting messages of `kind` let in (token, run), each with its frames, until none is waiting or
        every producer ended; ENDs and malformed messages are dealt with on the way."""
        while self.ended < self.producers:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self.last_message = time.monotonic()
            self.messages += 1
            msg = wire.decode([f.buffer for f in frames], (kind, wire.Frame.END), self.max_tuples)
            if not self._let_in(msg):
                continue
            if isinstance(msg, wire.Rejection):
                self._reject(msg, sum(len(f) for f in frames))
            elif msg.kind == wire.Frame.END:
                self._end(msg)
            else:
                yield msg, frames

    def _let_in(self, msg) -> bool:
        """Token check (a malformed anonymous message is left to the rejection count) and stale runs."""
        o = msg.origin
        if self.digest is not None and not (isinstance(msg, wire.Rejection) and o is None):
            if o is None or not hmac.compare_digest(o["token"].tobytes(), self.digest):
                kind = "end" if getattr(msg, "kind", None) == wire.Frame.END else "tuples"
                if not sum(self.refused.values()):
                    who = "an anonymous producer" if o is None else f"producer {_name(o)!r}"
                    print(
                        f"ingest: refused {'an END' if kind == 'end' else 'a TUPLES'} message from {who}: no or "
                        "wrong source.token; further refusals are counted in the summary",
                        file=sys.stderr,
                        flush=True,
                    )
                self.refused[kind] += 1
                self.refused_tuples += msg.count  # a Rejection's too: what the header announced
                return False
        if o is not None and int(o["run"]) not in (0, self.run):
            self.stale += 1  # addressed to a crashed run: its producer resends it to this one
            return False
        return True

    def _skip(self, o, n: int) -> int:
        """Rows at the start of a producer's message that were taken before (a resend); a gap before the
        message counts as lost.  The producer's position then stands at the message's first new row."""
        if o is None:
            return 0
        producer, offset = bytes(o["producer"]), int(o["offset"])
        have = self.taken.setdefault(producer, 0)
        if offset > have:
            if not self.lost:
                print(
                    f"ingest: producer {_name(o)!r} sent {offset - have:,} tuples that never came (sent to a "
                    "crashed run and not resent, or refused unread for their size); counted as lost_tuples",
                    file=sys.stderr,
                    flush=True,
                )
            self.lost += offset - have
            self.taken[producer] = have = offset
        skip = min(have - offset, n)
        self.duplicates += skip
        return skip

    def _end(self, msg) -> None:
        o = msg.origin
        if o is not None:
            producer = bytes(o["producer"])
            if producer in self.ended_by:
                return  # a resent END
            self._skip(o, 0)
            self.ended_by.add(producer)
        else:
            self.anonymous_ended += 1
        self.ended += 1
        self.blocked_seconds += max(msg.blocked, 0.0) if np.isfinite(msg.blocked) else 0.0
        name = msg.sender if o is None else f"{_name(o)!r}"
        print(
            f"ingest: producer {name} done ({self.ended}/{self.producers}), held back {msg.blocked:.2f}s",
            file=sys.stderr,
            flush=True,
        )

    def _reject(self, rej: wire.Rejection, nbytes: int) -> None:
        if rej.origin is not None and rej.reason not in ("frames", "kind"):  # its tuples are dealt with
            skip = self._skip(rej.origin, rej.count)
            if rej.count and skip == rej.count:
                return  # a resend of a message rejected before (the checkpoint counts and lists it)
            self.taken[bytes(rej.origin["producer"])] += rej.count - skip
        if not self.reasons[rej.reason]:
            print(
                f"ingest: rejected message {self.messages} ({rej.reason}: {rej.detail}); "
                "further rejections are counted in the summary",
                file=sys.stderr,
                flush=True,
            )
        self.reasons[rej.reason] += 1
        if len(self._rejections) < MAX_LISTED:
            self._rejections.append(
                {
                    "endpoint": self.endpoint,
                    "message": self.messages,
                    "bytes": nbytes,
                    "reason": rej.reason,
                    "detail": f"{wire.REASONS[rej.reason]}: {rej.detail}",
                }
            )

    # -- checkpoints and acknowledgements ---------------------------------------------------------------
    def producers_position(self) -> dict:
        """What the master has taken, per producer (hex id -> tuples), who ended, and the messages rejected so
        far (counted and listed once): a checkpoint's part."""
        return {
            "taken": {p.hex(): n for p, n in self.taken.items()},
            "ended": sorted(p.hex() for p in self.ended_by),
            "anonymous_ended": self.anonymous_ended,
            "lost": self.lost,
            "rejected_by_reason": dict(self.reasons),
            "rejections": list(self._rejections),
        }

    def seek(self, where: dict) -> None:
        """A recovery: the checkpoint's positions (what a producer resends before them is dropped)."""
        self.taken = {bytes.fromhex(p): n for p, n in where["taken"].items()}
        self.ended_by = {bytes.fromhex(p) for p in where["ended"]}
        self.anonymous_ended, self.lost = where["anonymous_ended"], where["lost"]
        self.ended = len(self.ended_by) + self.anonymous_ended
        # a checkpoint of the version before holds no rejected messages
        self.reasons = Counter(where.get("rejected_by_reason", {}))
        self._rejections = list(where.get("rejections", []))
        self.acked = where

    def acknowledge(self, where: dict) -> None:
        """A checkpoint holding `where` (a `position`) is complete: tell the producers."""
        self.acked = where
        self.acknowledged += 1
        if self.acks is not None:
            self._publish(where, final=False)

    def _repeat_ack(self) -> None:
        """The last ACK again every ACK_INTERVAL: a producer of a new run learns the run from it."""
        if self.acks is not None and time.monotonic() >= self._next_ack:
            self._publish(self.acked, final=False)

    def _publish(self, where: dict, final: bool) -> None:
        ended = set(where["ended"])
        acked = np.array([(bytes.fromhex(p), n, p in ended) for p, n in where["taken"].items()], wire.ACK_RECORD)
        self.acks.send_multipart(wire.encode_ack(self.run, acked, final), zmq.NOBLOCK)
        self._next_ack = time.monotonic() + ACK_INTERVAL

    @staticmethod
    def merged(z: list[dict]) -> dict:
        """Several dispatchers' `finish()` entries (their own producers) as one: counts added, peaks the largest,
        endpoints listed."""
        merged = {}
        for key in z[0]:
            values = [x[key] for x in z]
            if key == "endpoints":
                merged[key] = [e for v in values for e in v]
            elif key == "held_peak_tuples":
                merged[key] = max(values)
            elif isinstance(values[0], dict):
                merged[key] = {}
                for v in values:
                    for k, n in v.items():
                        merged[key][k] = merged[key].get(k, 0) + n
            else:
                merged[key] = round(sum(values), 3)
        return merged

    def finish(self) -> dict:
        """Close the sockets (the last ACK, final, delivered first), write rejected/zmq-rejected.*, and return
        the producers' counts (once): the summary's `zmq_ingest`, or a live stream's entry in `live_streams`."""
        if self._finished is None:
            self.sock.close()
            if self.acks is not None:  # the run is complete: everything taken is in its output
                self._publish(self.producers_position(), final=True)
                self.acks.close()
            stop_authenticators()
            if self.acks is not None:
                self.acks.context.term()  # returns once the last ACK is sent (or after ACK_LINGER)
            if self._rejections:
                write_table(self.out / "rejected", self.rejected_stem, pa.Table.from_pylist(self._rejections), self.fmt)
            self._finished = {
                "endpoints": [self.endpoint],
                "messages": self.messages,
                "tuples": self.tuples,
                "producers_ended": self.ended,
                "rejected_by_reason": dict(self.reasons),
                "refused_messages": dict(self.refused),
                "refused_tuples": self.refused_tuples,
                "duplicate_tuples": self.duplicates,
                "stale_messages": self.stale,
                "lost_tuples": self.lost,
                "producers": {_text(p): n for p, n in self.taken.items()},
                "producers_blocked_seconds": round(self.blocked_seconds, 3),
                "held_peak_tuples": self.held_peak,
                "checkpoints_acknowledged": self.acknowledged,
            }
        return self._finished


def _text(producer: bytes) -> str:
    return producer.decode(errors="replace")


def _name(o) -> str:
    return _text(bytes(o["producer"]))
