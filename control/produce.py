"""`python -m control.produce FILE --endpoint tcp://127.0.0.1:5555 [--rate R] [--batch N] [--name ID]
[--token-file F] [--ack-endpoint tcp://127.0.0.1:5554] [--stream]`

With `--stream` the file is one declared stream's (a CSV, Parquet or JSON-lines file of any columns) and
its rows go as they are, `batch` rows to a BATCH message (one Arrow record batch, protocol.wire), to the
`endpoint` of a live `[streams.NAME]` (master.sources.live checks them against the stream's schema); its
`--ack-endpoint` is the stream's `ack_endpoint`.

Reads a CSV/Parquet input file as it goes (the columns of the file source; invalid
rows are set aside the same way and counted) and PUSHes it to a master running with
`source.kind = "zmq"` in protocol.wire TUPLES messages of `batch` tuples, then
one END message carrying the seconds the sends were held back.  With a small
SNDHWM a send blocks when the cluster falls behind; that time is measured (a
send that would block waits in poll) and printed, apart from the wait for the
master to come up before the first message.

Every message names this producer (`--name`, else a random id), its position
and the token's digest (`--token-file`, the master's `source.token`).  With
`--ack-endpoint` (the master's `source.ack_endpoint`, checkpoints on) the
producer keeps every batch until a complete checkpoint holds it (at most
`--keep` batches: then it waits), and when the cluster comes back from a crash
(its ACKs name a new run) it resends what the new run's checkpoint does not
hold; at the end it waits until the master confirms its END, so nothing it sent
is lost.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from collections import deque

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import zmq

from protocol import eventtime, wire
from common.chunks import InputError, rows
from common.stream_file import SidedFile
from common.zmq_security import connect_client
from protocol.lifetime import invocation

#: messages a producer queues before its sends block, and its kernel send buffer (bytes)
SNDHWM = 2
SNDBUF = 128 * 1024
#: batches kept until a checkpoint holds them (with acknowledgements); then sends wait for one
KEEP = 256


class Blocked(Exception):
    """The master did not take a message (or acknowledge one) within the timeout."""


class Producer:
    """PUSH socket plus the blocked-time accounting; `send` takes columns, `close` sends END.  With an
    `ack_endpoint`, a SUB socket for the master's ACKs and the batches no checkpoint holds yet (bounded)."""

    def __init__(
        self,
        endpoint: str,
        sender: int = 0,
        server_key: str | None = None,
        key: str | None = None,
        timeout: float = 0.0,
        name: str | None = None,
        token: str = "",
        ack_endpoint: str | None = None,
        keep: int = KEEP,
    ):
        self.ctx = zmq.Context()  # its own, so that `close` can wait for delivery by terminating it
        self.sock = self.ctx.socket(zmq.PUSH)
        self.sock.sndhwm, self.sock.sndbuf = SNDHWM, SNDBUF
        self.sock.immediate = True  # queue only to a connected (and, with CURVE, authenticated) master
        self.sock.linger = int(timeout * 1000) if timeout > 0 else -1
        connect_client(self.sock, endpoint, server_key, key)
        self.name = name or uuid.uuid4().hex
        self.digest = wire.token_digest(token)
        wire.origin(self.name, self.digest)  # a name that does not fit fails here, not at the first send
        self.acks = None
        if ack_endpoint:
            self.acks = self.ctx.socket(zmq.SUB)
            self.acks.linger = 0
            self.acks.subscribe(b"")
            connect_client(self.acks, ack_endpoint, server_key, key)
        self.sender, self.timeout, self.keep = sender, timeout, keep
        self.seq = self.tuples = 0
        self.blocked = self.connect_wait = self.ack_wait = 0.0
        self.run = 0  #: the master run the messages address (0: no acknowledgements)
        #: (seq, position, tuples, body: TUPLES records or a BATCH's Arrow stream) not yet held
        self.kept: deque[tuple[int, int, int, np.ndarray | pa.Buffer]] = deque()
        self.acked = self.resent = 0  #: tuples a complete checkpoint holds; tuples sent again after a crash
        self.end_seq: int | None = None  #: the END, once sent
        self.confirmed: bool | None = None  #: the master's final ACK: did its run take everything?

    def _send(self, frames: list) -> None:
        try:
            self.sock.send_multipart(frames, zmq.NOBLOCK)
            return
        except zmq.Again:
            pass
        started = time.perf_counter()
        if not self.sock.poll(int(self.timeout * 1000) if self.timeout > 0 else None, zmq.POLLOUT):
            raise Blocked(f"the master took no message for {self.timeout:g}s")
        self.sock.send_multipart(frames)
        waited = time.perf_counter() - started
        if self.seq == 0:
            self.connect_wait += waited
        else:
            self.blocked += waited

    def _message(self, seq: int, position: int, n: int, body: np.ndarray | pa.Buffer) -> None:
        """A TUPLES message of `n` records, or a BATCH of `n` rows (an Arrow stream)."""
        origin = wire.origin(self.name, self.digest, self.run, position)
        if isinstance(body, np.ndarray):
            self._send([wire.header(wire.Frame.TUPLES, n, self.sender, seq), origin, body.data])
        else:
            self._send(wire.encode_batch(body, n, self.sender, seq, origin))

    def send_table(self, table: pa.Table) -> None:
        """One BATCH message: the rows of `table` as an Arrow record batch (a live declared stream)."""
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        self._next(table.num_rows, sink.getvalue())

    def _end(self) -> None:
        origin = wire.origin(self.name, self.digest, self.run, self.tuples)
        self._send(wire.encode_end(self.reported, self.sender, self.end_seq, origin))

    def send(self, stream, ids, ts, keys, values) -> None:
        records = wire.tuple_records(stream, ids, ts, keys, values)
        self._next(len(records), records)

    def _next(self, n: int, body: np.ndarray | pa.Buffer) -> None:
        """The next message (kept until a checkpoint holds it, with acknowledgements)."""
        if self.acks is not None:
            self._sync(lambda: self.run != 0 and len(self.kept) < self.keep)
            if self.confirmed is not None:
                raise Blocked(
                    f"the cluster's run ended after taking {self.acked:,} of this producer's tuples, "
                    "before it was done sending"
                )
            self.kept.append((self.seq, self.tuples, n, body))
        self._message(self.seq, self.tuples, n, body)
        self.seq += 1
        self.tuples += n

    def _sync(self, done) -> None:
        """Read the master's ACKs until `done()`: drop what a checkpoint holds; a new run (a restarted
        cluster) gets every kept batch again, in order, and the END if it was sent.  `timeout` bounds the time
        between two ACKs while waiting (the master repeats its last one while it ingests)."""
        started = last = time.perf_counter()
        while True:
            wait = not done()
            if not wait and not self.acks.poll(0):
                break
            left = self.timeout - (time.perf_counter() - last)
            if wait and self.timeout > 0 and left <= 0:
                raise Blocked(f"no acknowledgement from the master for {self.timeout:g}s")
            if not self.acks.poll(int(left * 1000) if wait and self.timeout > 0 else 100 if wait else 0):
                continue
            last = time.perf_counter()
            msg = wire.decode(self.acks.recv_multipart(), (wire.Frame.ACK,), 1 << 20)
            if isinstance(msg, wire.Rejection):
                raise Blocked(f"a malformed acknowledgement from the master ({msg.reason}: {msg.detail})")
            mine = msg.rows[msg.rows["producer"] == self.name.encode()]
            acked, ended = (int(mine["tuples"][0]), bool(mine["ended"][0])) if len(mine) else (0, False)
            while self.kept and self.kept[0][1] + self.kept[0][2] <= acked:
                self.kept.popleft()
            self.acked = acked
            if msg.final:  # the run is over
                self.confirmed = self.end_seq is not None and ended and acked == self.tuples
                break
            if msg.run != self.run:
                self._resend(msg.run)
            if ended and self.end_seq is not None:
                self.confirmed = True
        self.ack_wait += time.perf_counter() - started

    def _resend(self, run: int) -> None:
        """A new run of the master: everything it does not hold, addressed to it."""
        again = self.run != 0
        self.run = run
        for seq, position, n, body in self.kept:
            self._message(seq, position, n, body)
            self.resent += n * again
        if self.end_seq is not None:
            self._end()

    def __enter__(self) -> "Producer":
        return self

    def __exit__(self, kind, *_) -> None:
        if kind is not None:
            self.abort()

    def abort(self) -> None:
        """Give up without an END (after `Blocked`, say): drop what waits unsent and free the sockets now, so
        that nothing is left to the collector, whose finalizing a context before its socket never returns."""
        if self.ctx.closed:
            return
        for sock in (self.acks, self.sock):
            if sock is not None:
                sock.close(linger=0)
        self.ctx.term()

    def close(self) -> dict:
        """Send END with the blocked time so far (the END's own wait cannot be in it) and wait for delivery;
        with acknowledgements, until the master confirms it (or its run ends without it: `confirmed` False)."""
        self.reported = self.blocked
        if self.acks is not None:
            self._sync(lambda: self.run != 0)
        self.end_seq = self.seq
        self._end()
        if self.acks is not None:
            self._sync(lambda: self.confirmed is not None)
            self.acks.close()
        self.sock.close()
        self.ctx.term()  # returns once END is delivered (or the linger timeout passed): exiting earlier loses it
        out = {
            "producer": self.name,
            "tuples_sent": self.tuples,
            "messages": self.seq,
            "blocked_seconds": round(self.reported, 3),
            "connect_wait_seconds": round(self.connect_wait, 3),
        }
        if self.acks is not None:
            out.update(
                acknowledged=self.acked,
                confirmed=self.confirmed,
                tuples_resent=self.resent,
                ack_wait_seconds=round(self.ack_wait, 3),
            )
        return out


def produce(
    path: str,
    endpoint: str,
    rate: float = 0.0,
    batch: int = 10000,
    jitter: float = 0.0,
    seed: int = 0,
    sender: int = 0,
    server_key: str | None = None,
    key: str | None = None,
    timeout: float = 0.0,
    ts_unit: str = "s",
    name: str | None = None,
    token: str = "",
    ack_endpoint: str | None = None,
    keep: int = KEEP,
) -> dict:
    """Push the valid rows of `path` in arrival order; `rate` paces (tuples/s), `jitter` adds random pauses."""
    infile = SidedFile(path, ts_unit=ts_unit)  # the file source's reading and checks
    rng = np.random.default_rng(seed)
    started = time.perf_counter()
    set_aside = 0
    with Producer(endpoint, sender, server_key, key, timeout, name, token, ack_endpoint, keep) as prod:
        for read in infile:
            set_aside += 0 if read.rejected is None else read.rejected.num_rows
            for at in range(0, len(read.rows), batch):
                c = rows(read.chunk, at, at + batch)
                if rate > 0:
                    time.sleep(max(0.0, started + prod.tuples / rate - time.perf_counter()))
                if jitter > 0:
                    time.sleep(rng.random() * jitter)
                prod.send(c.stream, c.id, c.ts, c.key, c.value)
        out = prod.close()
    out["rows_set_aside"] = set_aside
    out["seconds"] = round(time.perf_counter() - started, 3)
    return out


def produce_stream(
    path: str,
    endpoint: str,
    rate: float = 0.0,
    batch: int = 10000,
    jitter: float = 0.0,
    seed: int = 0,
    sender: int = 0,
    server_key: str | None = None,
    key: str | None = None,
    timeout: float = 0.0,
    name: str | None = None,
    token: str = "",
    hold: float = 0.0,
    ack_endpoint: str | None = None,
    keep: int = KEEP,
) -> dict:
    """Push the rows of a declared stream's file as they are, in BATCH messages of `batch` rows; `rate` paces
    (rows/s), `jitter` adds random pauses, `hold` waits that long before the END (a producer gone quiet)."""
    fmt = {".csv": "csv", ".parquet": "parquet", ".pq": "parquet"}.get(Path(path).suffix.lower(), "json")
    rng = np.random.default_rng(seed)
    started = time.perf_counter()
    with Producer(endpoint, sender, server_key, key, timeout, name, token, ack_endpoint, keep) as prod:
        for b in ds.dataset(path, format=fmt).to_batches(batch_size=batch):
            if rate > 0:
                time.sleep(max(0.0, started + prod.tuples / rate - time.perf_counter()))
            if jitter > 0:
                time.sleep(rng.random() * jitter)
            if b.num_rows:
                prod.send_table(pa.Table.from_batches([b]))
        time.sleep(hold)
        out = prod.close()
    out["rows_set_aside"] = 0  # the master checks a stream's rows
    out["seconds"] = round(time.perf_counter() - started, 3)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=invocation("control.produce"), description=__doc__.split("\n")[0])
    p.add_argument("file", help="CSV or Parquet file: stream (R/S), id, ts, key, [value]")
    p.add_argument("--endpoint", default="tcp://127.0.0.1:5555", help="the master's source.endpoint")
    p.add_argument("--rate", type=float, default=0.0, help="tuples/s (0 = as fast as the master takes them)")
    p.add_argument(
        "--batch", type=int, default=10000, help="tuples per message (<= the master's source.max_message_tuples)"
    )
    p.add_argument(
        "--jitter", type=float, default=0.0, help="random pause of up to this many seconds before each message"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the jitter")
    p.add_argument("--sender", type=int, default=0, help="producer number in the messages (for the master's log)")
    p.add_argument("--server-key", help="CURVE: the cluster's public certificate (.key)")
    p.add_argument("--key", help="CURVE: this producer's secret certificate (.key_secret)")
    p.add_argument(
        "--ts-unit",
        choices=list(eventtime.UNITS),
        default="s",
        help="the unit of numbers in the ts column (source.ts_unit)",
    )
    p.add_argument("--timeout", type=float, default=0.0, help="give up when a send blocks this long (0 = never)")
    p.add_argument("--name", help="this producer's id in every message (default: a random one)")
    p.add_argument("--token-file", help="a file holding the master's source.token")
    p.add_argument(
        "--ack-endpoint",
        help="the master's source.ack_endpoint (with --stream: the stream's ack_endpoint): keep batches until a "
        "checkpoint holds them, resend them after a crash",
    )
    p.add_argument("--keep", type=int, default=KEEP, help="batches kept unacknowledged before sends wait")
    p.add_argument(
        "--stream",
        action="store_true",
        help="FILE is a declared stream's (any columns): send its rows "
        "as Arrow record batches to a live [streams.NAME] endpoint",
    )
    p.add_argument("--hold", type=float, default=0.0, help="with --stream: seconds to wait before the END")
    a = p.parse_args(argv)
    if a.batch < 1 or a.keep < 1:
        p.error("--batch and --keep must be at least 1")
    try:
        token = open(a.token_file).read().strip() if a.token_file else ""
        if a.stream:
            out = produce_stream(
                a.file,
                a.endpoint,
                a.rate,
                a.batch,
                a.jitter,
                a.seed,
                a.sender,
                a.server_key,
                a.key,
                a.timeout,
                a.name,
                token,
                a.hold,
                a.ack_endpoint,
                a.keep,
            )
        else:
            out = produce(
                a.file,
                a.endpoint,
                a.rate,
                a.batch,
                a.jitter,
                a.seed,
                a.sender,
                a.server_key,
                a.key,
                a.timeout,
                a.ts_unit,
                a.name,
                token,
                a.ack_endpoint,
                a.keep,
            )
    except (InputError, ValueError, OSError, Blocked, zmq.ZMQError, pa.ArrowException) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: the master gets no END from this producer", file=sys.stderr)
        return 130
    print(
        f"sent {out['tuples_sent']:,} tuples in {out['messages']:,} messages in {out['seconds']:.1f}s; "
        f"held back {out['blocked_seconds']:.2f}s by backpressure (plus {out['connect_wait_seconds']:.2f}s "
        f"waiting for the master); {out['rows_set_aside']:,} invalid rows set aside",
        file=sys.stderr,
    )
    if "confirmed" in out:
        print(
            f"acknowledged: {out['acknowledged']:,} tuples held by the cluster; {out['tuples_resent']:,} resent "
            f"after a restart; waited {out['ack_wait_seconds']:.2f}s for acknowledgements",
            file=sys.stderr,
        )
    print(json.dumps(out))
    if out.get("confirmed") is False:
        print("error: the cluster's run ended without taking everything this producer sent", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
