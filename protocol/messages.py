"""Messages between master and slaves: tags, kinds, encode and decode.

One distribution epoch is one message per slave (paper 003, IV-B): a fixed
header followed by the slave's R tuples and then its S tuples, all in a single
contiguous byte buffer sent with uppercase mpi4py calls (no pickling of tuple
data).  The header carries the punctuation the slave needs: the watermark below
which no on-time tuple can still arrive (BiStream, Theorem 1).

A slave answers every batch with one small report: fixed float64 counters, the
delay histogram of that epoch and the histograms of the delay's parts.
"""

from __future__ import annotations

import enum
import operator
import time

import numpy as np

from protocol import delays, eventtime
from protocol.arrays import message_buffer

TAG_DATA = 1  #: master -> slave: a batch (or the stop order)
TAG_REPORT = 2  #: slave -> master: a report
TAG_STATE = 3  #: supplier slave -> consumer slave: a partition-group's state
TAG_RESULTS = 4  #: slave -> master, with output.zmq_endpoint: a batch's results (protocol.wire RESULTS)
TAG_SUMMARY = 5  #: dispatcher k > 0 -> rank 0 at the end: its counters (a small dict, pickled)
TAG_ORDER = 6  #: rank 0 <-> dispatcher k > 0: coordination of moves and of the end (master.coordination)
TAG_METRICS = 7  #: dispatcher k > 0 -> rank 0, at the metrics cadence: its counters (master.metrics)
TAG_JOINING = 8  #: slave -> dispatcher: still joining its batch (`joining_message`), the stall watch's sign of life


class Kind(enum.IntEnum):
    BATCH = 1  #: tuples of one distribution epoch, then the group table (`batch_groups`)
    STOP = 2  #: no more input: flush and send the final report
    MOVE = 3  #: hand partition-group `partition` over to slave `peer` (paper 003, IV-C)
    CHECKPOINT = 4  #: write every partition-group's state into checkpoint `checkpoint` (protocol.checkpoint)
    SPLIT = 5  #: split hot key `hot_key` out of group `partition` into its grid (its first sub-group, its size)
    MERGE = 6  #: a hot key cooled: gather its grid (all here) back into group `partition`; the same `hot_key`


class Ack(enum.IntEnum):
    """What a report answers."""

    BATCH = 0  #: a batch or the stop order was processed
    MOVED = 1  #: supplier: the group's state left for the consumer
    INSTALLED = 2  #: consumer: the group's state is installed
    CHECKPOINTED = 3  #: the slave's part of a checkpoint is written and its results are flushed
    SPLIT = 4  #: a hot key's tuples are in its grid of sub-groups
    MERGED = 5  #: a cooled key's grid is gathered back into its partition-group


#: `seq`: the message's number on the FIFO channel from its dispatcher to the slave (1, 2, ... per BATCH; an
#: order carries the last batch's), so a slave notices a lost batch -- not the distribution epoch;
#: `watermark`: the dispatcher's punctuation, event time in microseconds (protocol.eventtime): every later tuple
#: from it has ts >= this; NEG_INF / POS_INF for none yet / no more input, NONE in orders;
#: `partition`: the partition-group of MOVE, SPLIT and MERGE; `checkpoint`: the checkpoint id of CHECKPOINT;
#: `floor`: MOVE's lowest watermark cap of the dispatchers holding the group (master.coordination), which the
#: consumer's punctuations must not pass until the held tuples come (microseconds; NONE in the other kinds);
#: `peer`: the consumer slave of MOVE; `table_rows`: rows of the int64 table that ends the message,
#: each GROUP_ROW wide -- a BATCH's group table (`batch_groups`), the one hot-key row of SPLIT / MERGE
#: (`hot_key`), none in the other kinds; `sent`: the master's wall clock when it encoded the message (the delay
#: decomposition, protocol.delays).  Unused fields hold -1.
HEADER = np.dtype(
    [
        ("kind", "<i8"),
        ("seq", "<i8"),
        ("watermark", "<i8"),
        ("n_r", "<i8"),
        ("n_s", "<i8"),
        ("partition", "<i8"),
        ("checkpoint", "<i8"),
        ("floor", "<i8"),
        ("peer", "<i8"),
        ("table_rows", "<i8"),
        ("sent", "<f8"),
    ]
)
#: width of the table's rows: a batch ends with one row per partition-group it holds, (partition, R rows, S
#: rows, R's first key, R's last key, S's first key, S's last key), in the order of the rows; the keys are per
#: stream the span whose home the group is (key ranges: master.state.ranges.KeyRanges.spans, both streams; hash
#: partitions: ALL_KEYS; a full join's hot-key grids: NO_KEYS for the stream copied as guests,
#: master.state.hot_key_router.HotKeyRouter.spans): a row of the group whose key is outside its stream's span is a guest
#: copy (slave.join).  SPLIT / MERGE end with the row (hot key, its first sub-group, its sub-group count, -1, ...)
GROUP_ROW = 7
#: the span of a group that is every key's home (no guests of the stream): hash partitions, hot-key sub-groups
ALL_KEYS = (np.iinfo(np.int64).min, np.iinfo(np.int64).max)
#: the span of a group that is no key's home: every tuple of the stream there is a guest
NO_KEYS = ALL_KEYS[::-1]


def encode_batch(
    seq: int, watermark: int, r: np.ndarray, s: np.ndarray, groups: np.ndarray | None = None
) -> np.ndarray:
    """A BATCH: header + R rows + S rows [+ group table] as one uint8 buffer (one copy of the tuples)."""
    buf, body_r, body_s = batch_message(seq, watermark, len(r), len(s), r.dtype, groups)
    body_r[:] = r
    body_s[:] = s
    return buf


def batch_message(
    seq: int,
    watermark: int,
    n_r: int,
    n_s: int,
    dtype: np.dtype,
    groups: np.ndarray | None = None,
    spare: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A BATCH with its header and group table written and room for the rows: (buffer, its R rows, its S
    rows), the rows to be filled in place, so the master drains its mini-buffers straight into the message,
    in `spare` (an earlier message's buffer no longer in flight) if it is large enough
    (`protocol.arrays.message_buffer`)."""
    table = _table(groups)
    rows_end = HEADER.itemsize + (n_r + n_s) * dtype.itemsize
    buf = message_buffer(spare, rows_end + table.nbytes)
    _write_head(buf, Kind.BATCH, seq, watermark, n_r, n_s, len(table))
    buf[rows_end:] = table.reshape(-1).view(np.uint8)
    body = buf[HEADER.itemsize : rows_end].view(dtype)
    return buf, body[:n_r], body[n_r:]


def encode_order(
    kind: Kind,
    seq: int,
    watermark: int = eventtime.NONE,
    *,
    partition: int = -1,
    peer: int = -1,
    checkpoint: int = -1,
    floor: int = eventtime.NONE,
    hot_key: tuple[int, int, int] | None = None,
) -> np.ndarray:
    """An order without tuples: STOP (`watermark` +inf), MOVE (`partition`, `peer`, `floor`), CHECKPOINT
    (`checkpoint`), SPLIT / MERGE (`partition`, `hot_key` = (key, first sub-group, sub-groups))."""
    if kind == Kind.BATCH:
        raise ValueError("a BATCH is built by encode_batch / batch_message")
    table = _table(None if hot_key is None else [(*hot_key, *[-1] * (GROUP_ROW - 3))])
    buf = np.empty(HEADER.itemsize + table.nbytes, dtype=np.uint8)
    _write_head(buf, kind, seq, watermark, 0, 0, len(table), partition, peer, checkpoint, floor)
    buf[HEADER.itemsize :] = table.reshape(-1).view(np.uint8)
    return buf


def _table(rows) -> np.ndarray:
    table = np.empty((0, GROUP_ROW), np.int64) if rows is None else np.ascontiguousarray(rows, np.int64)
    if table.ndim != 2 or table.shape[1] != GROUP_ROW:
        raise ValueError(f"a message's table has rows of {GROUP_ROW} int64, not of shape {table.shape[1:]}")
    return table


def _write_head(
    buf: np.ndarray,
    kind: Kind,
    seq: int,
    watermark: int,
    n_r: int,
    n_s: int,
    table_rows: int,
    partition: int = -1,
    peer: int = -1,
    checkpoint: int = -1,
    floor: int = eventtime.NONE,
) -> None:
    head = buf[: HEADER.itemsize].view(HEADER)[0]
    # microseconds: a float (seconds?) would be truncated unseen
    watermark, floor = operator.index(watermark), operator.index(floor)
    head["kind"], head["seq"], head["watermark"], head["n_r"], head["n_s"] = int(kind), seq, watermark, n_r, n_s
    head["partition"], head["checkpoint"], head["floor"], head["peer"] = partition, checkpoint, floor, peer
    head["table_rows"], head["sent"] = table_rows, time.time()


def decode_head(buf: np.ndarray, dtype: np.dtype) -> np.void:
    """The header of a message, after checking that the buffer's length is the one it announces."""
    if len(buf) < HEADER.itemsize:
        raise ValueError(f"batch message of {len(buf)} bytes is shorter than its header")
    head = buf[: HEADER.itemsize].view(HEADER)[0]
    n_r, n_s, n_t = int(head["n_r"]), int(head["n_s"]), int(head["table_rows"])
    rows_end = HEADER.itemsize + (n_r + n_s) * dtype.itemsize
    if min(n_r, n_s, n_t) < 0 or len(buf) != rows_end + n_t * GROUP_ROW * 8:
        raise ValueError(
            f"batch message body has {len(buf) - HEADER.itemsize} bytes, header says {n_r}+{n_s} "
            f"tuples of {dtype.itemsize} bytes and {n_t} table rows"
        )
    return head


def batch_rows(buf: np.ndarray, head: np.void, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """A BATCH's R and S tuples: views into `buf`."""
    n_r, n_s = int(head["n_r"]), int(head["n_s"])
    rows = buf[HEADER.itemsize : HEADER.itemsize + (n_r + n_s) * dtype.itemsize].view(dtype)
    return rows[:n_r], rows[n_r:]


def decode_batch(buf: np.ndarray, dtype: np.dtype) -> tuple[np.void, np.ndarray, np.ndarray]:
    """Inverse of `encode_batch`: (header, R rows, S rows), the rows views into `buf`."""
    head = decode_head(buf, dtype)
    return (head, *batch_rows(buf, head, dtype))


def batch_groups(buf: np.ndarray, head: np.void) -> np.ndarray:
    """The (partition, R rows, S rows, R's first and last key, S's first and last key) table that ends a BATCH:
    which rows belong to which partition-group, and per stream the span of keys whose home it is (`GROUP_ROW`)."""
    n_t = int(head["table_rows"])
    return buf[len(buf) - n_t * GROUP_ROW * 8 :].view(np.int64).reshape(n_t, GROUP_ROW)


def hot_key(buf: np.ndarray, head: np.void) -> tuple[int, int, int]:
    """SPLIT / MERGE: (hot key, its first sub-group, its sub-group count)."""
    if Kind(int(head["kind"])) not in (Kind.SPLIT, Kind.MERGE) or int(head["table_rows"]) != 1:
        raise ValueError(
            f"a {Kind(int(head['kind'])).name} message with {int(head['table_rows'])} table rows carries no hot key"
        )
    key, first, size = buf[-GROUP_ROW * 8 :].view(np.int64).tolist()[:3]
    return key, first, size


#: A report's fields: counts as int64, seconds as float64; per batch unless marked as a level.
REPORT = np.dtype(
    [
        ("seq", "<i8"),  # the sequence number of the message answered (HEADER `seq`)
        ("ack", "<i8"),  # what this report answers (Ack)
        ("tuples_r", "<i8"),
        ("tuples_s", "<i8"),  # tuples joined
        ("results", "<i8"),  # results produced
        ("chunks", "<i8"),  # chunks the results were produced in (output.result_chunk_rows)
        ("window_r", "<i8"),
        ("window_s", "<i8"),  # level: tuples stored now
        ("window_bytes", "<i8"),  # level: bytes of window state now
        ("splits", "<i8"),
        ("merges", "<i8"),  # extendible-hash splits / merges since the last report
        ("busy", "<f8"),  # seconds spent joining
        ("delay_max", "<f8"),  # largest production delay, seconds
        ("files", "<i8"),  # result files written
        ("rss", "<i8"),  # level: peak resident memory of the slave process so far, bytes
        ("cpu", "<f8"),  # level: CPU seconds the slave process used so far
        ("comm", "<f8"),  # level: seconds the slave spent receiving messages and sending reports so far
        ("pss_start", "<i8"),  # level: the slave's PSS before any data, bytes (protocol.startup)
        ("partition", "<i8"),  # with Ack.MOVED / INSTALLED / SPLIT / MERGED: the partition-group
        ("moved_tuples", "<i8"),  # with Ack.MOVED / INSTALLED / SPLIT / MERGED: its stored tuples moved
        ("result_files", "<i8"),  # with Ack.CHECKPOINTED: level: result files written so far (the commit)
        ("part_bytes", "<i8"),  # with Ack.CHECKPOINTED: size of the slave's checkpoint part
        ("aggregate_files", "<i8"),  # with Ack.CHECKPOINTED: level: partial-aggregate files written so far
    ]
)


def joining_message(seq: int, results: int, milliseconds: int) -> np.ndarray:
    """A slave's word, at most once per distribution epoch, that it has been joining batch `seq` for
    `milliseconds` and has produced `results` of its results so far: a hot key's batch may take longer than
    the stall watch's bound (master.state.stall), and its report comes only at the end."""
    return np.array([seq, results, milliseconds], dtype=np.int64)


#: the delay histogram, then one per part of the delay (delays.PARTS)
HISTOGRAMS = 1 + len(delays.PARTS)
#: the REPORT record, then uint32 bin counts: 3,408 bytes, under Open MPI's shared-memory eager limit (4 KiB),
#: so a report is delivered without a handshake that would make the master wait for a busy slave
REPORT_BYTES = REPORT.itemsize + HISTOGRAMS * delays.BINS * 4
_BIN_MAX = np.iinfo(np.uint32).max


def encode_report(counters: dict, hists: np.ndarray) -> np.ndarray:
    """A report of `counters` (REPORT's fields; those not given are 0) and `hists`: HISTOGRAMS x delays.BINS
    counts (the delays, then their parts) of one batch."""
    if hists.max(initial=0) > _BIN_MAX:  # a batch of over 4 billion results: far beyond any slave's memory
        raise OverflowError(f"a delay bin of one batch holds {int(hists.max()):,} results, more than a report carries")
    unknown = set(counters) - set(REPORT.names)
    if unknown:
        raise ValueError(f"a report has no fields {sorted(unknown)}")
    out = np.zeros(REPORT_BYTES, dtype=np.uint8)
    record = out[: REPORT.itemsize].view(REPORT)
    for name, value in counters.items():
        record[name] = value
    out[REPORT.itemsize :].view(np.uint32)[:] = np.ravel(hists)
    return out


def decode_report(buf: np.ndarray) -> tuple[dict, np.ndarray]:
    """(counters: ints and floats by REPORT's types, HISTOGRAMS x delays.BINS int64 counts)."""
    counters = dict(zip(REPORT.names, buf[: REPORT.itemsize].view(REPORT)[0].tolist()))
    return counters, buf[REPORT.itemsize :].view(np.uint32).astype(np.int64).reshape(HISTOGRAMS, delays.BINS)
