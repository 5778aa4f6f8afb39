"""The ZeroMQ wire format: tuple batches in, result batches and punctuations out.

Every message is a ZeroMQ multipart message whose first frame is a fixed
64-byte little-endian header (`HEADER`, each field one meaning); a message that carries rows has exactly
one more frame, the rows as packed little-endian records (`TUPLE_RECORD` for
ingest, `RESULT_RECORD` for results), so a receiver checks one size
(``count * itemsize``) and reads the rows as one numpy view, without a Python
loop per tuple.  One record frame rather than one frame per column: a fixed
frame count, one size check, one copy to pack on the producer side.

Kinds: TUPLES (producer -> master), BATCH (producer -> master, a live declared stream: one Arrow
record batch of the stream's own columns in Arrow's IPC stream format, checked by master.sources.live), END (a producer
is done; `blocked` carries the seconds it was held back by backpressure, or an emitter is done), RESULTS,
ROWS, TABLE and PUNCT (master -> subscribers; a punctuation P in `punctuation` says every
result whose stream time is < P has been sent: BiStream 3.2.3, SplitJoin's
punctuated result stream), ACK (master -> producers: per producer, the tuples a
complete checkpoint holds; `run` the master's run, `final` once it is over).  `seq` numbers a sender's messages so
a subscriber sees gaps.  RESULTS carry pairs (the inner join); ROWS carry the rows of the
other join types (`ROW_RECORD`): pairs and rows without a partner, each with
its `kind` and its stream time `time` (`stream_time`).  With declared streams
(`[streams]`) results carry the streams' own columns instead: a TABLE
is an Arrow IPC stream (record batches of one schema) with the columns of the run's
`results/` files and `time` (float64 seconds) last; a TABLE of no rows has an
empty frame.  Between a slave and the
master (over MPI), RESULTS / ROWS / TABLE carry one chunk of a batch's results, `seq` is
the batch's and `floor` is `MORE` on all chunks but the last, whose `floor` is the
watermark the slave decided rows alone by (integer microseconds).

A producer's TUPLES and END may carry an ORIGIN frame right after the header:
who sends (its own id), the SHA-256 of the shared token (source.token), the
master run it addresses and its position (tuples sent before this message), so
the master lets in only holders of the token, drops what a resend repeats and
counts what never came (master/sources/producers.py).  Without it a message is
anonymous: accepted only when no token is configured, never deduplicated.

Event time: a TUPLES record carries `ts` as int64 microseconds since the epoch
(protocol.eventtime; version 2, version 1 carried float64 seconds); results and
punctuations carry the user's time again, float64 seconds.
"""

from __future__ import annotations

import enum
import hashlib
from typing import TYPE_CHECKING, Callable, NamedTuple

import numpy as np

from protocol import eventtime
from protocol.predicates import LEFT_MATCHED, LEFT_UNMATCHED, MATCHED, RIGHT_UNMATCHED

if TYPE_CHECKING:  # pyarrow is imported where TABLEs are made or read: Spark's workers load this module without it
    import pyarrow as pa

    from protocol.plan import Output

MAGIC = b"SJNB"
#: 3: the header's `mark` (blocked seconds, a punctuation or a floor by kind) became fields of their own, and an
#: ACK's run left `seq`
VERSION = 3
#: `floor` of a slave's results message to the master: more results of the same batch follow
MORE = eventtime.NONE

#: `punctuation`: PUNCT's, seconds; `blocked`: a producer's END, the seconds it was held back; `floor`: a slave's
#: results chunk, the watermark it decided rows alone by (microseconds; MORE: not the batch's last chunk);
#: `run`, `final`: an ACK's master run and whether it is over.  A field a kind does not carry is 0 (floor MORE).
HEADER = np.dtype(
    [
        ("magic", "S4"),
        ("version", "<u2"),
        ("kind", "<u2"),
        ("count", "<u4"),
        ("sender", "<u4"),
        ("seq", "<u8"),
        ("punctuation", "<f8"),
        ("blocked", "<f8"),
        ("floor", "<i8"),
        ("run", "<u8"),
        ("final", "u1"),
        ("pad", "u1", (7,)),
    ]
)
#: One input tuple: stream code (0 = R, 1 = S), then the contract's columns, ts in microseconds; packed, 33 bytes.
TUPLE_RECORD = np.dtype([("stream", "i1"), ("id", "<i8"), ("ts", "<i8"), ("key", "<i8"), ("value", "<f8")])
#: One result pair, the columns of results/ files (protocol.output.RESULT_COLUMNS); 72 bytes.
RESULT_RECORD = np.dtype(
    [
        ("r_id", "<i8"),
        ("s_id", "<i8"),
        ("r_key", "<i8"),
        ("s_key", "<i8"),
        ("r_ts", "<f8"),
        ("s_ts", "<f8"),
        ("r_value", "<f8"),
        ("s_value", "<f8"),
        ("delay", "<f8"),
    ]
)
#: One row of a join other than inner (ROWS): the result columns, the row's stream time in seconds (`stream_time`)
#: and its kind (a code of ROW_KINDS).  The side a row lacks has id and key 0, ts and value NaN; 81 bytes.
ROW_RECORD = np.dtype(RESULT_RECORD.descr + [("time", "<f8"), ("kind", "u1")])
#: ROW_RECORD `kind` codes -> protocol.output's names: a pair, an R row without a partner (left, full, anti), an S
#: row without one (right, full), an R row with one (semi)
ROW_KINDS = (MATCHED, LEFT_UNMATCHED, RIGHT_UNMATCHED, LEFT_MATCHED)
#: The optional frame of a producer's message: its id, SHA-256 of the token (zeros: none), the master run it
#: addresses (0: any), the tuples it sent before this message; 112 bytes.
ORIGIN = np.dtype([("producer", "S64"), ("token", "u1", (32,)), ("run", "<u8"), ("offset", "<u8")])
#: One producer's acknowledgement: the tuples of it a complete checkpoint holds, and whether its END is in it.
ACK_RECORD = np.dtype([("producer", "S64"), ("tuples", "<u8"), ("ended", "u1")])


def stream_time(results) -> np.ndarray:
    """Each result's stream time, what the result stream's punctuation and order refer to: a pair's is the ts of
    its later tuple; a ROW_RECORD or a TABLE (a pa.Table) carries its own (`time`: the same for a pair, the final
    time of a row without a partner, the first pair's for a semi row; master.punctuation)."""
    if not isinstance(results, np.ndarray):
        return results["time"].to_numpy()
    if "time" in results.dtype.names:
        return results["time"]
    return np.maximum(results["r_ts"], results["s_ts"])


def take_due(held: list, p: float):
    """Remove from `held` (result rows, held for ordered output: records, or TABLEs' pa.Tables) those a
    punctuation `p` passes, and return them in order of their stream time."""
    if not held:
        return np.empty(0, RESULT_RECORD)
    if isinstance(held[0], np.ndarray):
        rows = np.concatenate(held)
    else:
        import pyarrow as pa

        rows = pa.concat_tables(held)
    ts = stream_time(rows)
    due = ts < p
    held[:] = [rows.take(np.flatnonzero(~due))] if not due.all() else []
    return rows.take(np.flatnonzero(due)[np.argsort(ts[due], kind="stable")])


class Frame(enum.IntEnum):
    TUPLES = 1
    END = 2
    RESULTS = 3
    PUNCT = 4
    ACK = 5
    ROWS = 6
    BATCH = 7
    TABLE = 8


#: reason code -> what it means (the rejected/ file and the summary count by code)
REASONS = {
    "frames": "wrong number of frames for the message kind",
    "header": "header frame is not 32 bytes",
    "magic": "header does not start with b'SJNB'",
    "version": "unsupported version",
    "kind": "message kind not accepted here",
    "too_large": "more tuples than source.max_message_tuples",
    "size": "record frame size is not count x record size",
    "origin": "origin frame is not 112 bytes",
    "stream": "stream code is not 0 (R) or 1 (S)",
    "ts": "ts (microseconds) is out of range",
    "duplicate_id": "the same (stream, id) twice in one message",
    "arrow": "BATCH frame is not one Arrow record batch in IPC stream format, or its row count is not the header's",
    "columns": "a column the stream declares is missing or does not become its declared type",
}
#: the reasons found once a BATCH's record batch is decoded (master.sources.live), not by `decode`
BATCH_REASONS = {"arrow", "columns"}


class Message(NamedTuple):
    kind: Frame
    sender: int
    seq: int
    punctuation: float
    blocked: float
    floor: int
    run: int
    final: bool
    rows: np.ndarray | None  # a read-only view into the record frame (None for END / PUNCT / BATCH / TABLE)
    origin: np.void | None = None  # a producer's ORIGIN record (None: anonymous)
    arrow: memoryview | None = None  # BATCH, TABLE: the record batch's IPC stream bytes (TABLE of no rows: empty)
    count: int = 0  # the rows the header announced (a BATCH's are known only once decoded)


class Rejection(NamedTuple):
    reason: str  # a key of REASONS
    detail: str
    origin: np.void | None = None  # the sender, when its ORIGIN frame was read
    count: int = 0  # the rows the header announced (with `origin`: the sender's position moves past them)


def header(
    kind: Frame,
    count: int = 0,
    sender: int = 0,
    seq: int = 0,
    *,
    punctuation: float = 0.0,
    blocked: float = 0.0,
    floor: int = MORE,
    run: int = 0,
    final: bool = False,
) -> bytes:
    h = np.zeros(1, HEADER)
    h["magic"], h["version"], h["kind"], h["count"], h["sender"], h["seq"] = (
        MAGIC,
        VERSION,
        int(kind),
        count,
        sender,
        seq,
    )
    h["punctuation"], h["blocked"], h["floor"], h["run"], h["final"] = punctuation, blocked, floor, run, final
    return h.tobytes()


def token_digest(token: str) -> bytes:
    """What a message carries of the shared token: its SHA-256 (zeros for no token)."""
    return hashlib.sha256(token.encode()).digest() if token else bytes(32)


def origin(producer: str, digest: bytes, run: int = 0, offset: int = 0) -> bytes:
    """An ORIGIN frame; `producer` is at most 64 bytes of UTF-8."""
    name = producer.encode()
    if not 0 < len(name) <= 64:
        raise ValueError(f"a producer id is 1 to 64 bytes of UTF-8, got {producer!r}")
    o = np.zeros(1, ORIGIN)
    o["producer"], o["token"][0], o["run"], o["offset"] = name, np.frombuffer(digest, np.uint8), run, offset
    return o.tobytes()


def tuple_records(stream, ids, ts, keys, values) -> np.ndarray:
    """Columns (stream codes 0/1, ts in integer microseconds) packed as TUPLE_RECORDs; one vectorized pack."""
    if np.asarray(ts).dtype.kind not in "iu":  # seconds as floats would be truncated unseen
        raise TypeError(f"ts must be integer microseconds (protocol.eventtime), got {np.asarray(ts).dtype}")
    rows = np.empty(len(ids), dtype=TUPLE_RECORD)
    rows["stream"], rows["id"], rows["ts"], rows["key"], rows["value"] = stream, ids, ts, keys, values
    return rows


def encode_tuples(
    stream, ids, ts, keys, values, sender: int = 0, seq: int = 0, origin_frame: bytes | None = None
) -> list[bytes]:
    """A TUPLES message from columns, with an ORIGIN frame if given."""
    rows = tuple_records(stream, ids, ts, keys, values)
    return [header(Frame.TUPLES, len(rows), sender, seq), *([origin_frame] if origin_frame else []), rows.tobytes()]


def encode_ack(run: int, acked: np.ndarray, final: bool, sender: int = 0) -> list:
    """An ACK message: ACK_RECORDs, the master's `run`, `final` once the run is over (nothing more comes)."""
    return [
        header(Frame.ACK, len(acked), sender, run=run, final=final),
        np.ascontiguousarray(acked, ACK_RECORD).tobytes(),
    ]


def encode_results(rows: np.ndarray, sender: int = 0, seq: int = 0) -> list:
    """A RESULTS message (ROWS for ROW_RECORDs); the record frame is a view of `rows` when they are contiguous
    (no copy)."""
    kind, record = (Frame.ROWS, ROW_RECORD) if rows.dtype == ROW_RECORD else (Frame.RESULTS, RESULT_RECORD)
    body = np.ascontiguousarray(rows, record).view(np.uint8).data
    return [header(kind, len(rows), sender, seq), body]


def new_bytes(size: int) -> np.ndarray:
    return np.empty(size, np.uint8)


def table_ipc(table: pa.Table, head: bytes = b"", alloc: Callable[[int], np.ndarray] = new_bytes) -> np.ndarray:
    """`head`, then `table` in Arrow's IPC stream format (a TABLE's frame; no rows: nothing), as uint8: its
    chunks as they are, a record batch each, written once into a buffer of the exact size from `alloc(size)`
    (sized by a dry run that copies nothing)."""
    import pyarrow as pa

    def write(sink) -> None:
        sink.write(head)
        if table.num_rows:
            with pa.ipc.new_stream(sink, table.schema) as writer:
                writer.write_table(table)

    size = pa.MockOutputStream()
    write(size)
    out = alloc(size.size())
    write(pa.FixedSizeBufferWriter(pa.py_buffer(out)))
    return out


def read_table(ipc: memoryview) -> pa.Table | None:
    """A TABLE's rows (None for a TABLE of no rows)."""
    import pyarrow.ipc

    return pyarrow.ipc.open_stream(ipc).read_all() if ipc.nbytes else None


def encode_table(table: pa.Table, sender: int = 0, seq: int = 0) -> list:
    """A TABLE message: result rows of declared streams with their `time` column."""
    return [header(Frame.TABLE, table.num_rows, sender, seq), table_ipc(table)]


def table_buffer(
    table: pa.Table, sender: int, seq: int, floor: int, alloc: Callable[[int], np.ndarray] = new_bytes
) -> np.ndarray:
    """A slave's TABLE message to the master as one uint8 buffer from `alloc` (header, then the IPC stream,
    written in place; MPI carries one buffer per message)."""
    return table_ipc(table, header(Frame.TABLE, table.num_rows, sender, seq, floor=floor), alloc)


def encode_batch(ipc: bytes, count: int, sender: int = 0, seq: int = 0, origin_frame: bytes | None = None) -> list:
    """A BATCH message: `count` rows as one Arrow record batch in IPC stream format (`ipc`)."""
    return [header(Frame.BATCH, count, sender, seq), *([origin_frame] if origin_frame else []), ipc]


def encode_end(blocked: float = 0.0, sender: int = 0, seq: int = 0, origin_frame: bytes | None = None) -> list[bytes]:
    """An END: a producer is done (the seconds it was held back; its ORIGIN frame), or an emitter is."""
    return [header(Frame.END, 0, sender, seq, blocked=blocked), *([origin_frame] if origin_frame else [])]


def encode_punct(punctuation: float, sender: int = 0, seq: int = 0) -> list[bytes]:
    """A PUNCT: every result whose stream time is below `punctuation` has been sent."""
    return [header(Frame.PUNCT, 0, sender, seq, punctuation=punctuation)]


def decode(frames: list, accept: tuple[Frame, ...], max_rows: int) -> Message | Rejection:
    """Validate a whole message; rows are returned only if every row is valid (never half a message)."""
    if not frames:
        return Rejection("frames", "empty message")
    head_buf = memoryview(frames[0])
    if head_buf.nbytes != HEADER.itemsize:
        return Rejection("header", f"header frame has {head_buf.nbytes} bytes")
    h = np.frombuffer(head_buf, dtype=HEADER)[0]
    if bytes(h["magic"]) != MAGIC:
        return Rejection("magic", f"magic {bytes(h['magic'])!r}")
    if int(h["version"]) != VERSION:
        return Rejection("version", f"version {int(h['version'])}, this engine speaks {VERSION}")
    kind, count = int(h["kind"]), int(h["count"])
    if kind not in {int(k) for k in accept}:
        return Rejection("kind", f"kind {kind}")
    kind = Frame(kind)
    fields = (
        int(h["sender"]),
        int(h["seq"]),
        float(h["punctuation"]),
        float(h["blocked"]),
        int(h["floor"]),
        int(h["run"]),
        bool(h["final"]),
    )
    source = None
    if len(frames) == {Frame.TUPLES: 3, Frame.BATCH: 3, Frame.END: 2}.get(kind):
        if memoryview(frames[1]).nbytes != ORIGIN.itemsize:
            return Rejection("origin", f"origin frame has {memoryview(frames[1]).nbytes} bytes")
        source = np.frombuffer(frames[1], dtype=ORIGIN)[0]
        frames = [frames[0], *frames[2:]]
    got = _body(frames, kind, count, max_rows, Message(kind, *fields, None, source, count=count))
    return got._replace(origin=source, count=count) if isinstance(got, Rejection) and source is not None else got


def _body(frames: list, kind: Frame, count: int, max_rows: int, msg: Message) -> Message | Rejection:
    if kind in (Frame.END, Frame.PUNCT):
        if len(frames) != 1 or count != 0:
            return Rejection("frames", f"{kind.name} with {len(frames)} frames and count {count}")
        return msg
    if len(frames) != 2:
        return Rejection("frames", f"{kind.name} with {len(frames)} frames (expected 2)")
    if count > max_rows:
        return Rejection("too_large", f"{count} rows > {max_rows}")
    if kind in (Frame.BATCH, Frame.TABLE):  # a BATCH's rows are checked once decoded (master.sources.live)
        return msg._replace(arrow=memoryview(frames[1]))
    record = {Frame.TUPLES: TUPLE_RECORD, Frame.ACK: ACK_RECORD, Frame.ROWS: ROW_RECORD}.get(kind, RESULT_RECORD)
    body = memoryview(frames[1])
    if body.nbytes != count * record.itemsize:
        return Rejection("size", f"{body.nbytes} bytes for {count} records of {record.itemsize}")
    rows = np.frombuffer(body, dtype=record)
    if kind == Frame.TUPLES:
        bad = _check_tuples(rows)
        if bad is not None:
            return bad
    return msg._replace(rows=rows)


def _check_tuples(rows: np.ndarray) -> Rejection | None:
    stream = rows["stream"]
    wrong = np.flatnonzero((stream != 0) & (stream != 1))
    if len(wrong):
        return Rejection("stream", f"{len(wrong)} rows, first at row {wrong[0]}: {int(stream[wrong[0]])}")
    ts = rows["ts"]
    wrong = np.flatnonzero(~eventtime.valid(ts))
    if len(wrong):
        return Rejection("ts", f"{len(wrong)} rows, first at row {wrong[0]}: {int(ts[wrong[0]])}")
    ids = rows["id"]
    order = np.lexsort((ids, stream))
    same = (ids[order][1:] == ids[order][:-1]) & (stream[order][1:] == stream[order][:-1])
    if same.any():
        i = int(order[1:][same][0])
        return Rejection(
            "duplicate_id",
            f"id {int(ids[i])} of stream {'RS'[int(stream[i])]} at rows {int(order[:-1][same][0])} and {i}",
        )
    return None


#: an ordered stream's result message holds at most this share of output.subscriber_buffer_bytes of records
CHUNK_SHARE = 8


def chunk_rows(out: Output) -> int:
    """The rows of a chunk of a batch's results (slave.join), each a result message of its own: the setting
    output.result_chunk_rows, with an ordered result stream at most 1/CHUNK_SHARE of its byte bound of records,
    so the master, which takes a message while its held results are below the bound, holds little more
    (master.result_stream)."""
    rows = out.result_chunk_rows
    if out.zmq_endpoint and out.ordered:
        rows = min(rows, max(1, out.subscriber_buffer_bytes // CHUNK_SHARE // ROW_RECORD.itemsize))
    return rows


def results_buffer(
    count: int, sender: int, seq: int, floor: int, record: np.dtype = RESULT_RECORD
) -> tuple[np.ndarray, np.ndarray]:
    """A RESULTS message (ROWS with `record` ROW_RECORD) as one uint8 buffer (for MPI, which carries one buffer
    per message) and its `count` records, a view into it for the caller to fill: the message is built in place,
    never copied."""
    head = header(Frame.ROWS if record == ROW_RECORD else Frame.RESULTS, count, sender, seq, floor=floor)
    buf = np.empty(len(head) + count * record.itemsize, dtype=np.uint8)
    buf[: len(head)] = np.frombuffer(head, dtype=np.uint8)
    return buf, buf[len(head) :].view(record)


def unpack(buf: np.ndarray) -> list[memoryview]:
    """Inverse of `results_buffer` (header and record frame, as views)."""
    view = memoryview(buf).cast("B")
    return [view[: HEADER.itemsize], view[HEADER.itemsize :]]
