"""`python -m control.produce FILE --endpoint tcp://127.0.0.1:5555 [--rate R] [--batch N]`

Reads a CSV/Parquet input file as it goes (the columns of the file source; invalid
rows are set aside the same way and counted) and PUSHes it to a master running with
`source.kind = "zmq"` in protocol.wire TUPLES messages of `batch` tuples, then
one END message carrying the seconds the sends were held back.  With a small
SNDHWM a send blocks when the cluster falls behind; that time is measured (a
send that would block waits in poll) and printed, apart from the wait for the
master to come up before the first message.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import zmq

from protocol import eventtime, wire
from protocol.chunks import InputError, rows
from protocol.input_file import InputFile
from protocol.zmq_security import connect_client

#: messages a producer queues before its sends block, and its kernel send buffer (bytes)
SNDHWM = 2
SNDBUF = 128 * 1024


class Blocked(Exception):
    """The master did not take a message within the timeout."""


class Producer:
    """PUSH socket plus the blocked-time accounting; `send` takes columns, `close` sends END."""

    def __init__(self, endpoint: str, sender: int = 0, server_key: str | None = None, key: str | None = None,
                 timeout: float = 0.0):
        self.ctx = zmq.Context()  # its own, so that `close` can wait for delivery by terminating it
        self.sock = self.ctx.socket(zmq.PUSH)
        self.sock.sndhwm, self.sock.sndbuf = SNDHWM, SNDBUF
        self.sock.immediate = True  # queue only to a connected (and, with CURVE, authenticated) master
        self.sock.linger = int(timeout * 1000) if timeout > 0 else -1
        connect_client(self.sock, endpoint, server_key, key)
        self.sender, self.timeout = sender, timeout
        self.seq = self.tuples = 0
        self.blocked = self.connect_wait = 0.0

    def _send(self, frames: list[bytes]) -> None:
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

    def send(self, stream, ids, ts, keys, values) -> None:
        self._send(wire.encode_tuples(stream, ids, ts, keys, values, self.sender, self.seq))
        self.seq += 1
        self.tuples += len(ids)

    def close(self) -> dict:
        """Send END with the blocked time so far (the END's own wait cannot be in it) and wait for delivery."""
        reported = self.blocked
        self._send(wire.encode_mark(wire.Kind.END, reported, self.sender, self.seq))
        self.sock.close()
        self.ctx.term()  # returns once END is delivered (or the linger timeout passed): exiting earlier loses it
        return {"tuples_sent": self.tuples, "messages": self.seq, "blocked_seconds": round(reported, 3),
                "connect_wait_seconds": round(self.connect_wait, 3)}


def produce(path: str, endpoint: str, rate: float = 0.0, batch: int = 10000, jitter: float = 0.0, seed: int = 0,
            sender: int = 0, server_key: str | None = None, key: str | None = None, timeout: float = 0.0,
            ts_unit: str = "s") -> dict:
    """Push the valid rows of `path` in arrival order; `rate` paces (tuples/s), `jitter` adds random pauses."""
    infile = InputFile(path, ts_unit=ts_unit)  # the file source's reading and checks
    rng = np.random.default_rng(seed)
    prod = Producer(endpoint, sender, server_key, key, timeout)
    started = time.perf_counter()
    set_aside = 0
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m control.produce", description=__doc__.split("\n")[0])
    p.add_argument("file", help="CSV or Parquet file: stream (R/S), id, ts, key, [value]")
    p.add_argument("--endpoint", default="tcp://127.0.0.1:5555", help="the master's source.endpoint")
    p.add_argument("--rate", type=float, default=0.0, help="tuples/s (0 = as fast as the master takes them)")
    p.add_argument("--batch", type=int, default=10000, help="tuples per message (<= the master's source.max_message_tuples)")
    p.add_argument("--jitter", type=float, default=0.0, help="random pause of up to this many seconds before each message")
    p.add_argument("--seed", type=int, default=0, help="seed of the jitter")
    p.add_argument("--sender", type=int, default=0, help="producer number in the messages (for the master's log)")
    p.add_argument("--server-key", help="CURVE: the cluster's public certificate (.key)")
    p.add_argument("--key", help="CURVE: this producer's secret certificate (.key_secret)")
    p.add_argument("--ts-unit", choices=list(eventtime.UNITS), default="s",
                   help="the unit of numbers in the ts column (source.ts_unit)")
    p.add_argument("--timeout", type=float, default=0.0, help="give up when a send blocks this long (0 = never)")
    a = p.parse_args(argv)
    if a.batch < 1:
        p.error("--batch must be at least 1")
    try:
        out = produce(a.file, a.endpoint, a.rate, a.batch, a.jitter, a.seed, a.sender, a.server_key, a.key, a.timeout,
                      a.ts_unit)
    except (InputError, ValueError, OSError, Blocked, zmq.ZMQError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: the master gets no END from this producer", file=sys.stderr)
        return 130
    print(f"sent {out['tuples_sent']:,} tuples in {out['messages']:,} messages in {out['seconds']:.1f}s; "
          f"held back {out['blocked_seconds']:.2f}s by backpressure (plus {out['connect_wait_seconds']:.2f}s "
          f"waiting for the master); {out['rows_set_aside']:,} invalid rows set aside", file=sys.stderr)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
