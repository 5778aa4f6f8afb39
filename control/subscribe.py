"""`python -m control.subscribe --endpoint tcp://127.0.0.1:5556 [--dispatchers K] [--ordered] [--out results.parquet]`

Subscribes to a run's result stream (`output.zmq_endpoint`), prints a progress
line about once a second, checks the stream as it goes (punctuations strictly
increasing, no result after a punctuation that covers it, no gap in the
message numbers: the master drops messages for a subscriber that falls
`output.subscriber_buffer_bytes` behind; `gaps` counts the holes, `missed_messages`
the messages in them) and at END prints a JSON summary; `--out` saves the results with the punctuation each
one arrived after (`punctuation_before`).

A run with a `join.type` other than inner sends ROWS: pairs and rows without a partner, each with its `kind`
(counted in the summary's `kinds`) and its stream time `time`, which the checks and the order use; in the
saved results the side a row lacks is null, as in the run's `results/` files.

A run of declared streams (`[streams]`) sends TABLEs: its result rows with the streams' own columns, exactly as
in its `results/` files, and `time` (the stream time, seconds); `--out` saves those columns.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import zmq

from protocol import wire
from protocol.access import dispatcher_endpoint
from protocol.output import LEFT_MATCHED, LEFT_UNMATCHED, RIGHT_UNMATCHED
from common.zmq_security import connect_client
from protocol.lifetime import invocation


def held(record: np.dtype) -> np.dtype:
    """A held result: its record and the punctuation it arrived after."""
    return np.dtype(record.descr + [("punctuation_before", "<f8")])


def rows_table(rows: np.ndarray) -> pa.Table:
    """Result records as the columns of `results/` files; ROW_RECORDs with the side a row lacks null, `kind` by
    name, and `time`, the stream time."""
    if rows.dtype != wire.ROW_RECORD:
        return pa.table({name: rows[name] for name in wire.RESULT_RECORD.names})
    kind = rows["kind"]
    lacks = {
        "r": kind == wire.ROW_KINDS.index(RIGHT_UNMATCHED),
        "s": np.isin(kind, [wire.ROW_KINDS.index(LEFT_UNMATCHED), wire.ROW_KINDS.index(LEFT_MATCHED)]),
    }
    table = pa.table(
        {
            name: pa.array(rows[name], mask=lacks.get(name[0]) if name != "delay" else None)
            for name in wire.RESULT_RECORD.names
        }
    )
    return table.append_column(
        "kind", pa.array(np.array(wire.ROW_KINDS, dtype=object)[kind], pa.string())
    ).append_column("time", pa.array(rows["time"]))


def recast(rows: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """`rows` with the fields of `dtype` (those it lacks left unset)."""
    out = np.empty(len(rows), dtype)
    for name in set(dtype.names) & set(rows.dtype.names):
        out[name] = rows[name]
    return out


def subscribe(
    endpoint: str,
    server_key: str | None = None,
    key: str | None = None,
    timeout: float = 0.0,
    progress: float = 1.0,
    keep: bool = True,
    dispatchers: int = 1,
    ordered: bool = False,
) -> dict:
    """Read the stream until END (or `timeout` seconds without a message); returns the checks and the rows.

    With k dispatchers each publishes on its own socket (the endpoint's port + i) and punctuates for its own
    batches; the stream's punctuation is the min over theirs (master.result_stream), and the checks use it.
    `ordered` (the run has `output.ordered`): results are held and kept in order of stream time
    (protocol.wire.stream_time) up to that punctuation, merging the dispatchers' streams, each ordered only
    within itself."""
    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.rcvhwm = 0  # never drop on our side; the publisher's SNDHWM is the only limit
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    for index in range(dispatchers):
        connect_client(sock, dispatcher_endpoint(endpoint, index), server_key, key)
    parts, before = [], []
    tables: list[pa.Table] = []  #: TABLEs' rows (declared streams), each with its punctuation_before
    waiting: list = []  #: ordered: results not yet passed by the punctuation, with it as they came
    out = {
        "results": 0,
        "kinds": {},
        "punctuations": 0,
        "last_punctuation": None,
        "non_monotone": 0,
        "covered": 0,
        "gaps": 0,
        "missed_messages": 0,
        "rejected": 0,
        "ended": False,
    }
    record = wire.RESULT_RECORD  #: the results' record: ROW_RECORD once a ROWS message came
    marks = np.full(dispatchers, -np.inf)  #: each dispatcher's last punctuation
    expect_seq: dict[int, int] = {}
    ended: set[int] = set()
    last_p = -np.inf

    def release(p: float) -> None:
        due = wire.take_due(waiting, p)
        if isinstance(due, pa.Table):
            tables.append(due)
        elif len(due):
            parts.append(recast(due, record))
            before.append(due["punctuation_before"])

    next_line = time.monotonic() + progress
    while True:
        if not sock.poll(int(timeout * 1000) if timeout > 0 else None):
            break
        msg = wire.decode(sock.recv_multipart(), tuple(wire.Frame), sys.maxsize)
        if isinstance(msg, wire.Rejection) or not 0 <= msg.sender < dispatchers:
            out["rejected"] += 1
            continue
        if msg.sender in expect_seq and msg.seq != expect_seq[msg.sender]:
            out["gaps"] += 1
            out["missed_messages"] += msg.seq - expect_seq[msg.sender]
        expect_seq[msg.sender] = msg.seq + 1
        if msg.kind in (wire.Frame.RESULTS, wire.Frame.ROWS):
            record = msg.rows.dtype
            out["results"] += len(msg.rows)
            out["covered"] += int((wire.stream_time(msg.rows) < last_p).sum())
            if msg.kind == wire.Frame.ROWS:
                for code, n in zip(*np.unique(msg.rows["kind"], return_counts=True)):
                    out["kinds"][wire.ROW_KINDS[code]] = out["kinds"].get(wire.ROW_KINDS[code], 0) + int(n)
            if ordered:
                rows = recast(msg.rows, held(record))
                rows["punctuation_before"] = last_p
                waiting.append(rows)
            elif keep:
                parts.append(msg.rows.copy())
                before.append(np.full(len(msg.rows), last_p))
        elif msg.kind == wire.Frame.TABLE and (table := wire.read_table(msg.arrow)) is not None:
            out["results"] += table.num_rows
            out["covered"] += int((wire.stream_time(table) < last_p).sum())
            if "kind" in table.column_names:
                for kind in table["kind"].value_counts().to_pylist():
                    out["kinds"][kind["values"]] = out["kinds"].get(kind["values"], 0) + kind["counts"]
            table = table.append_column("punctuation_before", pa.array(np.full(table.num_rows, last_p)))
            if ordered:
                waiting.append(table)
            elif keep:
                tables.append(table)
        elif msg.kind == wire.Frame.PUNCT:
            out["non_monotone"] += int(msg.punctuation <= marks[msg.sender])
            marks[msg.sender] = msg.punctuation
            out["punctuations"] += 1
            if marks.min() > last_p:
                last_p = float(marks.min())
                out["last_punctuation"] = last_p
                if ordered:
                    release(last_p)
        elif msg.kind == wire.Frame.END:
            ended.add(msg.sender)
            if len(ended) == dispatchers:
                out["ended"] = True
                break
        if progress and time.monotonic() >= next_line:
            print(
                f"results {out['results']:,} | punctuation {last_p:.3f} | gaps {out['gaps']}",
                file=sys.stderr,
                flush=True,
            )
            next_line = time.monotonic() + progress
    sock.close()
    release(np.inf)
    if tables:
        return out | {"table": pa.concat_tables(tables)}
    rows = np.concatenate(parts) if parts else np.empty(0, record)
    return out | {
        "table": rows_table(rows).append_column(
            "punctuation_before", pa.array(np.concatenate(before) if before else np.empty(0))
        )
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=invocation("control.subscribe"), description=__doc__.split("\n")[0])
    p.add_argument("--endpoint", default="tcp://127.0.0.1:5556", help="the run's output.zmq_endpoint")
    p.add_argument(
        "--dispatchers",
        type=int,
        default=1,
        help="the run's cluster.dispatchers: dispatcher i publishes at the endpoint's port + i",
    )
    p.add_argument(
        "--ordered",
        action="store_true",
        help="the run has output.ordered: keep the results in order of stream time across dispatchers",
    )
    p.add_argument("--out", help="save the results as this Parquet file")
    p.add_argument("--server-key", help="CURVE: the cluster's public certificate (.key)")
    p.add_argument("--key", help="CURVE: this subscriber's secret certificate (.key_secret)")
    p.add_argument(
        "--timeout", type=float, default=0.0, help="stop after this many seconds without a message (0 = wait for END)"
    )
    p.add_argument("--progress", type=float, default=1.0, help="seconds between progress lines (0 = none)")
    a = p.parse_args(argv)
    try:
        out = subscribe(
            a.endpoint,
            a.server_key,
            a.key,
            a.timeout,
            a.progress,
            keep=bool(a.out),
            dispatchers=a.dispatchers,
            ordered=a.ordered,
        )
    except (ValueError, OSError, zmq.ZMQError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    table = out.pop("table")
    if a.out:
        pq.write_table(table, a.out)
    print(json.dumps(out))
    return 0 if out["ended"] and not (out["gaps"] or out["covered"] or out["non_monotone"]) else 1


if __name__ == "__main__":
    sys.exit(main())
