"""The randomized differential matrix: one draw is a configuration from the product of the join's features and
a random workload for it; the real cluster runs it under mpirun and its result set (and late set) is compared
with the independent reference join over the whole input (tests/reference.py).

`python -m tests.matrix --seed N` reruns one draw; `python -m tests.matrix --minutes M` (`make soak`) runs random
draws for M minutes and prints a table of draws, the feature pairs covered and the failures.
tests/cluster/test_matrix.py runs a fixed set of seeds that covers every pair of feature values at small scale.

Event time in the workload is an integer count of milliseconds or microseconds, written as exact decimal seconds;
the reference compares those integers, so a pair exactly at a bound (one window apart, or exactly join.lower or
join.upper) joins.  `bounds` draws the time condition: the symmetric join.window, or join.lower / join.upper
asymmetric, one-sided (lower = 0) or both negative.

`hosts` draws one host, or three made as network namespaces (deploy.testbed): the dispatchers on the first, the
slaves one by one from the second, launched by deploy.launch with a hostfile; the subscriber of the result stream
joins rank 0's host.  A `crash` on three hosts with two or more slaves cuts the third host's link at the first
complete checkpoint and leaves it down: the supervisor finishes the run on the hosts that answer, with fewer
slaves than the checkpoint was taken on (a rescaled recovery); with one slave it kills a rank as on one host.

`output` draws the punctuated result stream: "files" only, or also `output.zmq_endpoint` ("stream"),
or with `output.ordered` ("ordered").  A draw with the stream runs a real subscriber (`Subscriber`: a ZeroMQ SUB
socket in a thread, connected before the cluster starts, `output.wait_subscribers = 1`, reading each dispatcher's
socket until its END) and checks what it received beside the files (`stream_faults`): the pairs and rows alone
on the stream are exactly the reference's, each once; each record's stream time is the contract's (a pair's the
ts of its later tuple, an R row alone ts + upper, an S row alone ts - lower, a semi row its first pair's) and
not below any punctuation its dispatcher sent before it (each dispatcher punctuates for its own batches, which
implies the min over them that a subscriber of all k sockets uses); punctuations strictly increase to +inf,
then END; with `ordered` each dispatcher's records come in non-decreasing stream time; `seq` runs 0, 1, 2, ...
on each socket, no gap.  `output.subscriber_buffer_bytes` (64 MiB) is far above a draw's whole stream (a few MB
at most), so a subscriber that keeps reading is never dropped: any gap is a fault.

The stream is not drawn with `crash` (`refusal`): nothing is promised to a subscriber across a recovery
(docs/live-input-and-result-stream.md states none), and the restarted master starts its stream over (`seq` from
0, its own punctuations from its own start, the results after the checkpoint again, while those the killed
master held for ordering or had queued are gone), so neither exactly once nor no gap holds; a weaker check (no
extra record, each run's punctuations within that run) would need to tell the two runs' messages apart, which
the result frames do not carry (no run number; only ACKs have one).  With `[streams]` input (`input =
"streams"`) the stream carries TABLEs, the rows with the streams' own columns and their stream time: the same
checks read them through `table_records`.

`input = "kafka"` writes the declared streams' rows as JSON values into two topics of PARTITIONS partitions (a
key's records in one partition, in arrival order) on a broker of the dispatchers' host (deploy.broker: on one
host the process's own, on three hosts one started in the first host's namespace, reached there), read bounded;
the reference judges lateness within each partition of each stream, as the per-partition watermarks do.

Live input is pushed over ZeroMQ by `python -m control.produce` processes started beside the cluster, on the
dispatchers' host, before it (`Producers`): `input = "zmq"` the single file's tuples to `source.endpoint`
(`source.kind = "zmq"`), `input = "live-streams"` each declared stream's rows as Arrow batches to
`streams.NAME.endpoint` (its `schema` declared: integer times in the draw's unit, text keys for an equi-join).
Dispatcher i binds each endpoint's port + i, and its own producer (one per stream) pushes its share: rows i,
i + k, ... of the single file, or of each stream (`shares`), as fast as the master takes them (it paces).  With a
crash the checkpoints publish acknowledgements (`ack_endpoint`, port + i) and each producer keeps what no complete
checkpoint holds and resends it to the restarted cluster; the crash (`crash_fault`) comes after a complete
checkpoint, so that there is something to resend (a cut host is cut at the first complete checkpoint as with any
input).  The reference judges lateness as live
input defines it (docs/input.md): in the order each dispatcher received its share, over both streams for the
single file (as the file's every k-th tuple), within each stream for live streams (idle_timeout 0: a quiet stream
keeps holding the other back, so which tuples are late does not depend on timing).  Replay is not drawn with
live input (control.replay reads files).
"""

from __future__ import annotations

import argparse
import atexit
import itertools
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import zmq

from protocol import wire
from protocol.config import ConfigError, load_config, validate
from protocol.output import LEFT_MATCHED, LEFT_UNMATCHED, MATCHED, RIGHT_UNMATCHED, read_tables
from protocol.predicates import JOIN_TYPES
from deploy.broker import local_broker
from deploy.testbed import TestBed
from deploy.launch import mpi_env
from tests.runs import ENDED_IDLE, BedJob, Run, free_port, run_cluster, toml_value
from tests.reference import encode_pairs, late_flags, micros, reference_outer, reference_pairs, reference_theta_pairs

#: feature -> the values a draw takes
FEATURES: dict[str, tuple] = {
    "predicate": ("equal", "band", "less"),
    "dispatchers": (1, 2, 3),
    "slaves": (1, 2, 3, 4),
    "moves": (False, True),
    "hotkeys": (False, True),
    "crash": (False, True),
    "disorder": (False, True),
    "unit": ("ms", "us"),
    "wide_window": (False, True),
    "bounds": ("window", "asymmetric", "one_sided", "negative"),
    "format": ("csv", "parquet"),
    "join_type": JOIN_TYPES,
    "input": ("file", "streams", "kafka", "zmq", "live-streams"),
    "output": ("files", "stream", "ordered"),
    "hosts": (1, 3),
    "aggregate": (False, True),
    "replay": (False, True),
    "query": (False, True),
}
#: features drawn in a minority of draws (True with this chance), so CI's covering seeds gain only a few of them:
#: `aggregate` (a drawn `[aggregate]` whose merged view must equal DuckDB's over the reference rows) and `replay`
#: (a drawn second of the run replayed by control.replay must give the reference join of that second); neither
#: is in PAIRED, both cost a Spark job; and `query`: the join said as a Spark SQL query (`query_sql`) with a
#: condition on the pair and filters per stream, for declared streams
SOMETIMES = {"aggregate": 0.2, "replay": 0.2, "query": 0.3}
#: the features whose value pairs CI's covering seeds cover; join.type is drawn in every draw (so CI runs some
#: outer joins) and covered pairwise by `make soak` and `--where join_type=...`: its pairs would double CI's draws
PAIRED = tuple(f for f in FEATURES if f != "join_type" and f not in SOMETIMES)
UNITS = {"ms": 1_000, "us": 1_000_000}
PRODUCER_BATCH = 200  #: rows per message of live input's producers
EPOCH = 0.1  #: epochs.distribution of every draw (seconds); a wide window is larger than it, a narrow one smaller
SUPERVISE = [sys.executable, "-m", "control.supervise", "--backoff", "0.1", "--restarts", "4", "--"]


@dataclass(frozen=True)
class Draw:
    seed: int
    predicate: str
    dispatchers: int
    slaves: int
    moves: bool
    hotkeys: bool
    crash: bool
    disorder: bool
    unit: str
    wide_window: bool
    bounds: str
    format: str
    join_type: str
    input: str
    output: str
    hosts: int
    aggregate: bool
    replay: bool
    query: bool

    @property
    def ranks(self) -> int:
        return self.dispatchers + self.slaves

    def features(self) -> dict:
        d = asdict(self)
        del d["seed"]
        return d


def draw(seed: int) -> Draw:
    """The draw of `seed`: every feature uniformly at random, those of SOMETIMES true with their chance (refused
    combinations are drawn too: `refusal`)."""
    rng = np.random.default_rng([seed, 19])
    uniform = {f: values[int(rng.integers(len(values)))] for f, values in FEATURES.items() if f not in SOMETIMES}
    sometimes = {f: bool(rng.random() < chance) for f, chance in SOMETIMES.items()}
    # not drawn where not built: control.replay reads files, not topics or producers, and launches on this host
    sometimes["replay"] &= uniform["input"] in ("file", "streams") and uniform["hosts"] == 1
    # a query names declared streams
    sometimes["query"] &= uniform["input"] in ("streams", "kafka", "live-streams")
    return Draw(seed=seed, **uniform, **sometimes)


def live(d: Draw) -> bool:
    """The input is pushed by producers beside the cluster (ZeroMQ): the single file's tuples or declared streams."""
    return d.input in ("zmq", "live-streams")


def single_file(d: Draw) -> bool:
    """The input is the single file's columns (stream, id, ts, key, value): read from the file or pushed live."""
    return d.input in ("file", "zmq")


def window_units(d: Draw) -> int:
    return UNITS[d.unit] * (3 if d.wide_window else 1) // 20  # 0.15 s or 0.05 s, in the draw's unit


#: `bounds` -> (lower, upper) in fifths of the window: s.ts - r.ts in [lower, upper]
BOUNDS = {"window": (-5, 5), "asymmetric": (-1, 5), "one_sided": (0, 5), "negative": (-5, -1)}


def bounds_units(d: Draw) -> tuple[int, int]:
    """(lower, upper) in the draw's unit (the window's fifths are whole: it is 50 or 150 ms)."""
    return tuple(window_units(d) * f // 5 for f in BOUNDS[d.bounds])


def max_delay_units(d: Draw) -> int:
    return UNITS[d.unit] // 10  # 0.1 s


def workload(d: Draw) -> dict[str, np.ndarray]:
    """Two interleaved streams in arrival order: stream (0 R, 1 S), id, ts (integer, the draw's unit), key.

    About 3 s of event time; keys from a small domain (equal), or near each other (band, less: few keys per
    window so `less` stays small); with hot keys two keys take turns at 30% of the input and then cool; some S
    tuples are exactly lower or upper after an R tuple of the same key (the boundary), or one unit outside;
    with disorder tuples arrive up to 0.25 s late in event time, past max_delay for some (the late set)."""
    rng = np.random.default_rng([d.seed, 7])
    unit = UNITS[d.unit]
    n = {"equal": 9000, "band": 6000, "less": 2400}[d.predicate]
    ts = np.sort(rng.integers(0, 3 * unit, n))
    keys = rng.integers(0, 400 if d.predicate == "equal" else 3000, n)
    if d.hotkeys:
        phase = ts * 3 // (3 * unit)  # first second: key 7 hot; second: key 11; last: none
        for p, key in ((0, 7), (1, 11)):
            keys[(phase == p) & (rng.random(n) < 0.3)] = key
    stream = rng.integers(0, 2, n)
    # the boundary: for one R tuple in twenty an S tuple of the same key exactly at lower or upper after it, or
    # one unit outside
    r = np.flatnonzero(stream == 0)
    twins = r[rng.random(len(r)) < 0.05]
    lower, upper = bounds_units(d)
    twin_ts = ts[twins] + rng.choice([lower, upper, lower, upper, lower - 1, upper + 1], len(twins))
    ok = twin_ts >= 0
    ts = np.concatenate([ts, twin_ts[ok]])
    keys = np.concatenate([keys, keys[twins][ok]])
    stream = np.concatenate([stream, np.ones(ok.sum(), np.int64)])
    arrival = ts.astype(np.float64)
    if d.disorder:
        shifted = rng.random(len(ts)) < 0.1
        arrival[shifted] += rng.random(shifted.sum()) * 0.25 * unit
    order = np.argsort(arrival, kind="stable")
    stream, ts, keys = stream[order], ts[order], keys[order]
    ids = np.zeros(len(ts), np.int64)
    for s in (0, 1):  # per stream, numbered in arrival order
        mine = stream == s
        ids[mine] = np.arange(mine.sum())
    return {"stream": stream, "id": ids, "ts": ts, "key": keys}


def seconds_text(ts: np.ndarray, unit: str) -> np.ndarray:
    """Integer times as exact decimal seconds ("12.345" for 12345 ms)."""
    digits = {"ms": 3, "us": 6}[unit]
    whole, frac = np.divmod(ts, UNITS[unit])
    return np.char.add(np.char.add(whole.astype(str), "."), np.char.zfill(frac.astype(str), digits))


#: declared streams (input = "streams" or "kafka"): their names, so results and late rows name their columns
#: trades_*, quotes_*
STREAMS = ("trades", "quotes")
PART_ROWS = 500  #: rows per file of a declared stream
PARTITIONS = 3  #: input = "kafka": partitions per topic, a key's records in partition key % 3


def declared_columns(d: Draw, data: dict[str, np.ndarray], side: int) -> pa.Table:
    """Stream `side`'s rows with the user's own column names: text keys for an equi-join (codes have no order),
    times as decimal text (CSV) or integers in the draw's unit, and a text payload column."""
    mine = data["stream"] == side
    ids = data["id"][mine]
    key = np.char.add("k", data["key"][mine].astype(str)) if d.predicate == "equal" else data["key"][mine]
    when = seconds_text(data["ts"][mine], d.unit) if d.format == "csv" and d.input == "streams" else data["ts"][mine]
    return pa.table({"event_id": ids, "sym": key, "at": when, "note": np.char.add("n", ids.astype(str))})


def fill_topics(d: Draw, data: dict[str, np.ndarray], bootstrap: str, tag: str) -> dict[str, str]:
    """input = "kafka": each stream's rows as JSON values into a topic of its own (named after `tag`), in
    arrival order, each key's in partition key % PARTITIONS; the topics by stream name."""
    from confluent_kafka import Producer
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap})
    producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True, "linger.ms": 5})
    topics = {name: f"{tag}-{name}" for name in STREAMS}
    for side, name in enumerate(STREAMS):
        admin.create_topics([NewTopic(topics[name], PARTITIONS, 1)])[topics[name]].result(30)
        table = declared_columns(d, data, side)
        part = data["key"][data["stream"] == side] % PARTITIONS
        for row, p in zip(table.to_pylist(), part.tolist()):
            producer.produce(topics[name], json.dumps(row).encode(), partition=p)
            producer.poll(0)
    if producer.flush(60):
        raise RuntimeError("the draw's records were not all delivered to the broker")
    return topics


def write_table(table: pa.Table, path: Path) -> None:
    """`table` as CSV or Parquet, by the path's suffix (text times as the text the user wrote)."""
    if path.suffix == ".csv":
        pacsv.write_csv(table, path)
    else:
        pq.write_table(table, path, row_group_size=2000)


def shares(table: pa.Table, k: int) -> list[pa.Table]:
    """Rows i, i + k, i + 2k, ... of `table` for each i < k: what dispatcher i's producer pushes."""
    return [table.take(np.arange(i, table.num_rows, k)) for i in range(k)]


def write_input(d: Draw, data: dict[str, np.ndarray], directory: Path) -> Path:
    """The draw's input: one file of both streams, or (input = "streams") a folder of files per stream with the user's
    own column names, text keys for an equi-join, times as decimal text (CSV) or integers in the draw's unit,
    and a text payload column; returns the file, or the folder holding the two.  Live input writes what its
    producers push, one file per dispatcher i (its share: `shares`) into the folder: `input-<i>` the single
    file's rows (input = "zmq"), `<stream>-<i>` a stream's (input = "live-streams")."""
    if d.input in ("streams", "live-streams"):
        for side, name in enumerate(STREAMS):
            table = declared_columns(d, data, side)
            if d.input == "live-streams":
                for i, share in enumerate(shares(table, d.dispatchers)):
                    write_table(share, directory / f"{name}-{i}.{d.format}")
                continue
            (directory / name).mkdir()
            for i in range(0, len(table), PART_ROWS):  # each file is a segment of the payload log, removed as it goes
                write_table(table.slice(i, PART_ROWS), directory / name / f"part-{i // PART_ROWS:04d}.{d.format}")
        return directory
    text = seconds_text(data["ts"], d.unit)
    table = pa.table(
        {
            "stream": np.where(data["stream"] == 0, "R", "S"),
            "id": data["id"],
            "ts": text if d.format == "csv" else text.astype(np.float64),
            "key": data["key"],
            "value": data["key"].astype(np.float64),
        }
    )
    if d.input == "zmq":
        for i, share in enumerate(shares(table, d.dispatchers)):
            write_table(share, directory / f"input-{i}.{d.format}")
        return directory
    path = directory / f"input.{d.format}"
    write_table(table, path)
    return path


def live_inputs(d: Draw) -> tuple[str, ...]:
    """The input sockets live input binds: "source" (the single file's tuples), or each stream's; none else."""
    return {"zmq": ("source",), "live-streams": STREAMS}.get(d.input, ())


def endpoints(d: Draw, base: int) -> dict[str, int]:
    """The draw's ZeroMQ ports from `base`, each with room for the dispatchers (dispatcher i binds port + i): the
    result stream's ("results"), and with live input each input socket's ("source" or the streams') and, with
    checkpoints (crash), its acknowledgements' ("<input>-ack")."""
    names = ("results", *live_inputs(d), *(f"{name}-ack" for name in live_inputs(d) if d.crash))
    return {name: base + j * d.dispatchers for j, name in enumerate(names)}


def declared(d: Draw, name: str, path: Path, at: dict[str, str], topics: dict[str, str] | None, broker: str) -> dict:
    """The keys of declared stream `name` (settings): its files in `path`, its topic, or its live endpoint (and
    acknowledgements' with checkpoints; a stream quiet for a while never stops holding the other back:
    idle_timeout 0)."""
    schema = {
        "event_id": "int64",
        "sym": "string" if d.predicate == "equal" else "int64",
        "at": "int64",
        "note": "string",
    }
    if d.input == "streams":
        own = {"path": str(path / name), "time_unit": "s" if d.format == "csv" else d.unit}
    elif d.input == "kafka":
        topic = (topics or {}).get(name, name)
        own = {"kafka": {"bootstrap": broker or "127.0.0.1:1", "topic": topic, "bounded": True}, "schema": schema}
    else:
        own = {"endpoint": at[name], "schema": schema} | ({"ack_endpoint": at[f"{name}-ack"]} if d.crash else {})
    return {"key": "sym", "time": "at", "id": "event_id", "time_unit": d.unit, **own}


#: every slave a supplier or a consumer at every reorganization: groups keep moving
MOVING = {
    "balance.buffer_capacity": 50,
    "balance.supplier_threshold": 1e-9,
    "balance.consumer_threshold": 1e-9,
    "balance.choice": "random",
    "balance.declustering": True,
}


def settings(
    d: Draw,
    path: Path,
    n: int = 9000,
    ports: dict[str, int] | None = None,
    topics: dict[str, str] | None = None,
    broker="",
) -> dict:
    """The draw's configuration ('section.key': value) for `n` tuples in `path` (input = "kafka": in `topics` on
    `broker`), paced over 3 s; `ports` the draw's `endpoints` (None: from 5600, for the config's checks)."""
    unit = UNITS[d.unit]
    ports = ports or endpoints(d, 5600)
    at = {name: f"tcp://127.0.0.1:{port}" for name, port in ports.items()}
    if d.input == "file":
        source = {"source.kind": "file", "source.path": str(path)}
    elif d.input == "zmq":  # ends with the producers' ENDs; the idle timeout only ends a run whose producer died
        source = {"source.kind": "zmq", "source.endpoint": at["source"], "source.idle_timeout": 60.0}
        if d.crash:
            source["source.ack_endpoint"] = at["source-ack"]
    else:
        source = {
            f"streams.{name}.{k}": v for name in STREAMS for k, v in declared(d, name, path, at, topics, broker).items()
        }
    lower, upper = bounds_units(d)
    time_bounds = (
        {"join.window": upper / unit}
        if d.bounds == "window"
        else {"join.lower": lower / unit, "join.upper": upper / unit}
    )
    join = (
        {"query.sql": query_sql(d)}
        if d.query
        else {**time_bounds, "join.predicate": d.predicate, "join.type": d.join_type}
        | ({"join.band": 2} if d.predicate == "band" else {})
    )
    s = {
        **source,
        "source.rate": n / 3.0,
        **join,
        "join.max_delay": max_delay_units(d) / unit,
        "cluster.dispatchers": d.dispatchers,
        "epochs.distribution": EPOCH,
        "epochs.reorganization": 0.3,
        "partitioning.partitions": 16,
        "tuning.block_size": 8,
        "tuning.theta_min": 2,
        "tuning.theta_max": 8,
        "output.result_chunk_rows": 64,
    }  # small bounds, so that every draw splits and chunks
    if d.moves:
        s.update({**MOVING, "balance.seed": d.seed})
    else:
        s["balance.enabled"] = False
    if d.aggregate:
        s.update(aggregate_settings(d))
    if d.hotkeys:
        s.update({"hotkeys.enabled": True, "hotkeys.threshold": 0.15})
    if d.crash:
        s["checkpoint.interval"] = 3
    if d.hosts > 1:  # a host cut off is found within 2 s
        s["cluster.heartbeat_timeout"] = 2.0
    if d.output != "files":  # a bound far above the whole stream: a subscriber that reads is never dropped
        s.update(
            {
                "output.zmq_endpoint": at["results"],
                "output.ordered": d.output == "ordered",
                "output.wait_subscribers": 1,
                "output.subscriber_buffer_bytes": 64 << 20,
            }
        )
    return s


#: a query's filters and condition (`query_sql`), on the streams' ids: what each keeps of rows and pairs
QUERY_FILTER_S = "ABS(q.event_id - 1000) > 100"  #: in ON: at ingest where quotes are null-supplying, else on pairs
QUERY_FILTER_R = "ABS(t.event_id - 2000) > 150"  #: in WHERE, where trades are kept (not with right or full)
QUERY_PAIRS = "t.event_id <= q.event_id + 3"
SQL_JOINS = {
    "inner": "JOIN",
    "left": "LEFT JOIN",
    "right": "RIGHT OUTER JOIN",
    "full": "FULL OUTER JOIN",
    "semi": "LEFT SEMI JOIN",
    "anti": "LEFT ANTI JOIN",
}


def query_sql(d: Draw) -> str:
    """The draw's join as a Spark SQL query: its key (equality, band or less), its bounds, a condition on the pair
    and two filters; the reference applies them by SQL's rules (`reference`)."""
    us = 1_000_000 // UNITS[d.unit]
    lower, upper = (b * us for b in bounds_units(d))
    at = lambda v: f"t.at {'+' if v >= 0 else '-'} INTERVAL {abs(v)} MICROSECONDS"  # noqa: E731
    key = {"equal": "t.sym = q.sym", "band": "ABS(q.sym - t.sym) <= 2", "less": "t.sym < q.sym"}[d.predicate]
    where = f" WHERE {QUERY_FILTER_R}" if d.join_type not in ("right", "full") else ""
    return (
        f"SELECT * FROM {STREAMS[0]} t {SQL_JOINS[d.join_type]} {STREAMS[1]} q ON {key} "
        f"AND q.at BETWEEN {at(lower)} AND {at(upper)} AND {QUERY_PAIRS} AND {QUERY_FILTER_S}{where}"
    )


def query_rows(d: Draw, data: dict[str, np.ndarray]) -> np.ndarray:
    """The rows a draw's query drops where they are read (SQL: ON on a null-supplying side, WHERE on a kept one):
    the mask of those it keeps."""
    keep = np.ones(len(data["id"]), bool)
    if d.query and d.join_type not in ("right", "full"):
        r, s = data["stream"] == 0, data["stream"] == 1
        keep &= ~(s & (np.abs(data["id"] - 1000) <= 100)) & ~(r & (np.abs(data["id"] - 2000) <= 150))
    return keep


def query_pairs(d: Draw, pairs: np.ndarray) -> np.ndarray:
    """The encoded pairs (tests.reference.encode_pairs) the draw's query keeps on the pairs."""
    if not d.query:
        return pairs
    r, s = pairs // 2**32, pairs % 2**32
    held = r <= s + 3
    if d.join_type in ("right", "full"):  # ON on quotes, which these joins keep: it decides pairs
        held &= np.abs(s - 1000) > 100
    return pairs[held]


def result_names(d: Draw) -> tuple[tuple[str, str, str, str], ...]:
    """R's and S's id, key, time and measured columns as results name them: the declared streams' own (the id
    measured), or the single file's r_id ... s_value."""
    if single_file(d):
        return tuple((f"{p}_id", f"{p}_key", f"{p}_ts", f"{p}_value") for p in "rs")
    return tuple((f"{n}_event_id", f"{n}_sym", f"{n}_at", f"{n}_event_id") for n in STREAMS)


def aggregate_settings(d: Draw) -> dict:
    """The draw's `[aggregate]` over its results' columns: grouped by nothing, the R key or both keys, windows of
    0.5 s tumbling, hopping every 0.25 s or none (the single file's: on the pair's time or S's), count, sums,
    extremes, averages and distinct keys (of R's columns only with semi and anti: results carry no S row)."""
    rng = np.random.default_rng([d.seed, 11])
    (_, r_key, _, r_measured), (_, s_key, s_time, s_measured) = result_names(d)
    group_by = [[], [r_key], [r_key, s_key]][int(rng.integers(3))]
    window, slide = [("0.5s", 0), ("0.5s", "0.25s"), (0, 0)][int(rng.integers(3))]
    other = r_measured if d.join_type in ("semi", "anti") else s_measured
    measures = ["count", f"sum({r_measured})", f"max({other})", f"avg({other})", f"count_distinct({r_key})"]
    out = {
        "aggregate.enabled": True,
        "aggregate.group_by": group_by,
        "aggregate.window": window,
        "aggregate.slide": slide,
        "aggregate.measures": measures,
        "aggregate.flush_interval": 0.2,
    }
    if single_file(d) and window and d.join_type not in ("semi", "anti"):
        out["aggregate.time"] = ["", s_time][int(rng.integers(2))]
    return out


def refusal(d: Draw) -> str | None:
    """The configuration's refusal (protocol.config), or None when the engine takes the draw; the result stream
    with a crash is not drawn (the module's docstring says why)."""
    if d.crash and d.output != "files":
        return "not drawn: the result stream promises nothing across a recovery (it starts over)"
    try:
        validate(
            load_config(None, [f"{k}={toml_value(v)}" for k, v in settings(d, Path("input")).items()]),
            slaves=d.ranks - 1,
        )
    except ConfigError as e:
        return str(e)
    return None


def reference(d: Draw, data: dict[str, np.ndarray]) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray], np.ndarray]:
    """((encoded pairs, ids of R rows alone, ids of S rows alone) as the draw's join type emits them
    (tests.reference.reference_outer), encoded late ids) of the whole input, in integer microseconds
    (tests/reference.py).  With k dispatchers dispatcher i takes every k-th tuple from the i-th on
    (master.sources.ShardedSource; live input: its producers push it those) and judges lateness on its own share:
    the single file's over both streams, live streams' within each stream of the share."""
    unit, k = UNITS[d.unit], d.dispatchers
    data = {c: v[query_rows(d, data)] for c, v in data.items()}  # a query's filters: as if never read
    ts = data["ts"] * (1_000_000 // unit)  # microseconds, exactly
    w, md = tuple(b / unit for b in bounds_units(d)), max_delay_units(d) / unit  # seconds, as the config gives them
    late = np.zeros(len(ts), bool)
    if d.input == "kafka":  # within each partition of each stream, in the order produced
        part = data["key"] % PARTITIONS
        for side, p in itertools.product((0, 1), range(PARTITIONS)):
            mine = np.flatnonzero((data["stream"] == side) & (part == p))
            late[mine] = late_flags(ts[mine], md)
    elif d.input == "streams":  # the streams merged by their running max ts (R first), lateness within each stream
        running = np.zeros(len(ts), np.int64)
        for side in (0, 1):
            mine = np.flatnonzero(data["stream"] == side)
            running[mine] = np.maximum.accumulate(ts[mine])
        merged = np.lexsort((np.arange(len(ts)), data["stream"], running))
        for i in range(k):
            share = merged[i::k]
            for side in (0, 1):
                mine = share[data["stream"][share] == side]
                late[mine] = late_flags(ts[mine], md)
    elif d.input == "live-streams":  # dispatcher i's producers push rows i, i + k, ... of each stream (shares)
        for side in (0, 1):
            mine = np.flatnonzero(data["stream"] == side)
            for i in range(k):
                late[mine[i::k]] = late_flags(ts[mine[i::k]], md)
    else:
        for i in range(k):
            late[i::k] = late_flags(ts[i::k], md)
    on = {c: v[~late] for c, v in {**data, "ts": ts}.items()}
    never = 1e9  # seconds: lateness is decided above
    if d.predicate == "equal":
        pairs, _ = reference_pairs(on["stream"], on["id"], on["ts"], on["key"], w, never)
    else:
        pairs = reference_theta_pairs(on["stream"], on["id"], on["ts"], on["key"], w, never, d.predicate, 2)
    pairs = query_pairs(d, pairs)
    kept = reference_outer(pairs, on["id"][on["stream"] == 0], on["id"][on["stream"] == 1], d.join_type)
    return kept, np.sort(data["stream"][late] * 2**40 + data["id"][late])


@dataclass
class Outcome:
    draw: Draw
    refused: str | None = None
    expected: int = 0
    missing: int = 0
    extra: int = 0
    twice: int = 0
    late_wrong: int = 0
    error: str = ""
    killed: str = ""
    seconds: float = 0.0
    streamed: int | None = None  #: records the subscriber received (a draw with the result stream)
    resent: int | None = None  #: tuples live input's producers sent again to a restarted cluster (with checkpoints)

    @property
    def ok(self) -> bool:
        return not (self.missing or self.extra or self.twice or self.late_wrong or self.error)

    def line(self) -> str:
        f = self.draw.features()
        head = f"seed {self.draw.seed:5d} " + " ".join(f"{k}={v}" for k, v in f.items())
        if self.refused:
            return f"{head} | refused: {self.refused}"
        verdict = (
            "ok"
            if self.ok
            else (
                f"FAIL missing {self.missing} extra {self.extra} twice {self.twice} "
                f"late-wrong {self.late_wrong} {self.error}"
            )
        )
        streamed = "" if self.streamed is None else f", {self.streamed} streamed"
        resent = "" if self.resent is None else f", {self.resent} resent"
        return (
            f"{head} | {self.expected} rows{streamed}, killed {self.killed or '-'}{resent}, {self.seconds:.1f}s: "
            f"{verdict}"
        )


class Subscriber(threading.Thread):
    """A real subscriber of the draw's result stream: one ZeroMQ SUB socket connected to every dispatcher's
    endpoint (dispatcher i publishes on the port + i), keeping each message as it arrives (protocol.wire.decode:
    a Message, or a Rejection) until every dispatcher's END, or until `finish` stops it."""

    def __init__(self, port: int, dispatchers: int, netns: str | None = None):
        """`netns`: the network namespace of the host rank 0 runs on (a draw on several hosts)."""
        super().__init__(daemon=True)
        self.port, self.dispatchers, self.netns = port, dispatchers, netns
        self.messages: list = []
        self.ended = False
        self._stop_reading = threading.Event()
        self.start()

    def run(self) -> None:
        if self.netns:  # this thread, and the context's I/O thread it starts, on rank 0's host
            enter_netns(self.netns)
        context = zmq.Context()
        sock = context.socket(zmq.SUB)
        sock.rcvhwm = 0  # never drop on our side: only the publisher's bound could
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        for i in range(self.dispatchers):
            sock.connect(f"tcp://127.0.0.1:{self.port + i}")
        ends = set()
        while len(ends) < self.dispatchers and not self._stop_reading.is_set():
            if sock.poll(100):
                msg = wire.decode(sock.recv_multipart(), tuple(wire.Frame), sys.maxsize)
                self.messages.append(msg)
                if getattr(msg, "kind", None) == wire.Frame.END:
                    ends.add(msg.sender)
        self.ended = len(ends) == self.dispatchers
        sock.close(linger=0)
        context.term()

    def finish(self, wait: float) -> list:
        """The messages received, after waiting up to `wait` seconds for the END of every dispatcher."""
        self.join(wait)
        self._stop_reading.set()
        self.join()
        return self.messages


_brokers = ExitStack()  #: the broker of draws on one host (root_broker), stopped when the process ends
atexit.register(_brokers.close)


def root_broker() -> tuple[str, Callable]:
    """The process's broker on this machine's 127.0.0.1 (started at the first draw that reads Kafka), and the
    `within` that reaches it: here."""
    global _root_broker
    if _root_broker is None:
        folder = Path(tempfile.mkdtemp(prefix="matrix-broker-"))
        _brokers.callback(shutil.rmtree, folder, True)
        _root_broker = _brokers.enter_context(local_broker(folder))
    return _root_broker, lambda f: f()


_root_broker: str | None = None


def within_netns(name: str) -> Callable:
    """`within(f)`: f() run in a thread in network namespace `name` (its threads, such as a Kafka client's, too)."""

    def within(f):
        box = {}

        def run():
            try:
                enter_netns(name)
                box["value"] = f()
            except BaseException as e:  # handed to the caller
                box["error"] = e

        t = threading.Thread(target=run)
        t.start()
        t.join()
        if "error" in box:
            raise box["error"]
        return box["value"]

    return within


def enter_netns(name: str) -> None:
    """Move the calling thread into network namespace `name` (`ip netns`; Linux setns, root)."""
    import ctypes

    with open(f"/var/run/netns/{name}") as f:
        if ctypes.CDLL(None, use_errno=True).setns(f.fileno(), 0x40000000) != 0:  # CLONE_NEWNET
            raise OSError(ctypes.get_errno(), f"setns {name}")


def table_records(table: pa.Table | None) -> np.ndarray:
    """A TABLE's rows (declared streams: STREAMS' own columns) as the ROW_RECORDs the checks read: each side's
    event_id and its time `at` in seconds (a missing side's id 0 and ts NaN, as ROWS have them), the kind's code
    and the stream time."""
    rows = np.zeros(0 if table is None else table.num_rows, wire.ROW_RECORD)
    if table is None:
        return rows
    for side, name in zip("rs", STREAMS):
        at = table[f"{name}_at"]
        rows[f"{side}_id"] = table[f"{name}_event_id"].fill_null(0).to_numpy()
        micros_or_null = at.cast(pa.timestamp("us", at.type.tz)).cast(pa.int64()).to_numpy(zero_copy_only=False)
        rows[f"{side}_ts"] = micros_or_null / 1e6  # null: NaN
    if "kind" in table.column_names:  # inner: pairs only
        names, which = np.unique(table["kind"].to_numpy(zero_copy_only=False), return_inverse=True)
        rows["kind"] = np.array([wire.ROW_KINDS.index(k) for k in names], np.uint8)[which]
    rows["time"] = table["time"].to_numpy()
    return rows


def message_rows(m) -> np.ndarray | None:
    """The result records of a message of the stream (None: it carries none)."""
    if getattr(m, "kind", None) == wire.Frame.TABLE:
        return table_records(wire.read_table(m.arrow))
    return getattr(m, "rows", None)


def stream_faults(
    d: Draw, sub: Subscriber, expected: tuple[np.ndarray, np.ndarray, np.ndarray], data: dict[str, np.ndarray]
) -> str:
    """What the result stream `sub` received breaks of its contract (the module's docstring), "" when nothing:
    `expected` the reference's (pairs, R rows alone, S rows alone), `data` the workload."""
    faults = []
    if not sub.ended:
        faults.append("no END from every dispatcher")
    bad = [m for m in sub.messages if isinstance(m, wire.Rejection) or not 0 <= m.sender < d.dispatchers]
    if bad:
        faults.append(f"{len(bad)} messages not of the stream, e.g. {bad[0]}")
    kind = wire.Frame.TABLE if not single_file(d) else wire.Frame.RESULTS if d.join_type == "inner" else wire.Frame.ROWS
    received = []
    for sender in range(d.dispatchers):
        mine = [m for m in sub.messages if not isinstance(m, wire.Rejection) and m.sender == sender]
        if [m.seq for m in mine] != list(range(len(mine))):
            faults.append(f"dispatcher {sender}: seq is not 0, 1, 2, ... (a gap or a repeat)")
        kinds = [m.kind for m in mine]
        if kinds.count(wire.Frame.END) != 1 or kinds[-1] != wire.Frame.END:
            faults.append(f"dispatcher {sender}: not one END, last")
        marks = [m.punctuation for m in mine if m.kind == wire.Frame.PUNCT]
        if not marks or marks[-1] != np.inf or any(b <= a for a, b in zip(marks, marks[1:])):
            faults.append(f"dispatcher {sender}: punctuations do not rise strictly to +inf")
        p, latest, covered, disordered = -np.inf, -np.inf, 0, 0
        for m in mine:
            if m.kind == wire.Frame.PUNCT:
                p = m.punctuation
            elif m.kind in (wire.Frame.RESULTS, wire.Frame.ROWS, wire.Frame.TABLE):
                if m.kind != kind:
                    faults.append(f"dispatcher {sender}: {m.kind.name} messages, {kind.name} expected")
                rows = message_rows(m)
                t = wire.stream_time(rows)
                covered += int((t < p).sum())
                disordered += int((np.diff(t, prepend=latest) < 0).sum())
                latest = t[-1] if len(t) else latest
                received.append(rows)
        if covered:
            faults.append(f"dispatcher {sender}: {covered} records below a punctuation sent before them")
        if disordered and d.output == "ordered":
            faults.append(f"dispatcher {sender}: {disordered} records below one before them (ordered)")
    rows = np.concatenate(received) if received else np.empty(0, wire.ROW_RECORD)
    code = rows["kind"] if "kind" in rows.dtype.names else np.zeros(len(rows), np.uint8)
    pair, lone_r, lone_s = (
        code == wire.ROW_KINDS.index(k)
        for k in (MATCHED, LEFT_MATCHED if d.join_type == "semi" else LEFT_UNMATCHED, RIGHT_UNMATCHED)
    )
    if (~(pair | lone_r | lone_s)).any():
        faults.append(f"{int((~(pair | lone_r | lone_s)).sum())} records of a kind {d.join_type} does not emit")
    got = (encode_pairs(rows["r_id"][pair], rows["s_id"][pair]), rows["r_id"][lone_r], rows["s_id"][lone_s])
    for name, g, want in zip(("pairs", "R rows alone", "S rows alone"), got, expected):
        counts = (len(np.setdiff1d(want, g)), len(np.setdiff1d(g, want)), len(g) - len(np.unique(g)))
        if any(counts):
            faults.append(f"{name}: missing {counts[0]} extra {counts[1]} twice {counts[2]}")
    faults += stream_time_faults(d, rows, pair, lone_r, lone_s, data)
    return f"stream: {'; '.join(faults)}" if faults else ""


def stream_time_faults(
    d: Draw, rows: np.ndarray, pair: np.ndarray, lone_r: np.ndarray, lone_s: np.ndarray, data: dict[str, np.ndarray]
) -> list[str]:
    """Records whose ts is not their input tuple's, or whose stream time is not the contract's (microseconds)."""
    scale = 1_000_000 // UNITS[d.unit]
    ts = [np.full(int(data["id"].max()) + 1, np.iinfo(np.int64).min) for _ in (0, 1)]  #: per stream, by id
    for side in (0, 1):
        mine = data["stream"] == side
        ts[side][data["id"][mine]] = data["ts"][mine] * scale
    lower, upper = (b * scale for b in bounds_units(d))
    r, s = (np.clip(rows[c], 0, len(ts[0]) - 1) for c in ("r_id", "s_id"))  # an unknown id is an extra already
    r_ts, s_ts = ts[0][r], ts[1][s]
    has_r, has_s = pair | lone_r, pair | lone_s
    wrong = {
        "ts is not their tuple's": int(
            (micros(rows["r_ts"][has_r]) != r_ts[has_r]).sum() + (micros(rows["s_ts"][has_s]) != s_ts[has_s]).sum()
        )
    }
    if "time" in rows.dtype.names:  # ROWS; in RESULTS a pair's stream time is its later ts, checked above
        t = micros(rows["time"])
        if d.join_type == "semi":  # its first pair's: the later of r and a partner within the bounds
            right = (t >= r_ts + max(0, lower)) & (t <= r_ts + max(0, upper))
        else:
            right = np.where(pair, t == np.maximum(r_ts, s_ts), np.where(lone_r, t == r_ts + upper, t == s_ts - lower))
        wrong["stream time is not the contract's"] = int((~right & (pair | lone_r | lone_s)).sum())
    return [f"{n} records whose {what}" for what, n in wrong.items() if n]


def crash_fault(d: Draw, rng: np.random.Generator, marker: Path) -> str:
    """A draw's crash, on an event of the run (STREAMJOIN_FAULT, protocol.faults), never at a moment: a random
    rank (the master too); a dispatcher as it begins its 2nd to 4th checkpoint, a slave at its 1st to 3rd batch
    once it has written its part of a second, or (input read from files or topics) at its 1st to 5th batch,
    before any checkpoint may be complete: a restart from the beginning.  Live input's crash always comes after a
    complete checkpoint, so that its producers have something to resend."""
    victim, n = int(rng.integers(d.ranks)), int(rng.integers(1, 4))
    if victim < d.dispatchers:
        return f"{victim}:checkpoint:{n + 1}:{marker}"
    if not live(d) and rng.random() < 0.3:
        return f"{victim}:batch:{int(rng.integers(1, 6))}:{marker}"
    return f"{victim}:batch-after-checkpoint:{n}:{marker}"


def host_slots(d: Draw) -> list[int]:
    """Ranks per host of a draw on three hosts: the dispatchers on the first, the slaves one by one from the
    second (so with two or more slaves, a slave's host can be cut off and slaves remain)."""
    per = [d.dispatchers, 0, 0]
    for i in range(d.slaves):
        per[(i + 1) % 3] += 1
    return per


class Producers:
    """Live input's producers (python -m control.produce), one per dispatcher (of each stream), started beside the
    cluster on the dispatchers' host before it: dispatcher i's pushes its share (write_input) to the input's port
    + i, in messages of PRODUCER_BATCH rows, as fast as the master takes them (it paces); with checkpoints (a
    crash) each keeps what no complete checkpoint holds (--ack-endpoint, port + i) and resends it to the
    restarted cluster.  A producer the master neither takes from nor acknowledges for 120 s gives up."""

    def __init__(self, d: Draw, tmp: Path, ports: dict[str, int], bed: TestBed | None):
        self.procs: list[subprocess.Popen] = []
        self.resent = 0
        streams = d.input == "live-streams"
        for name, i in itertools.product(live_inputs(d), range(d.dispatchers)):
            argv = [sys.executable, "-m", "control.produce", *(["--stream"] if streams else [])]
            argv += [str(tmp / f"{name if streams else 'input'}-{i}.{d.format}"), "--name", f"{name}-{i}"]
            argv += ["--endpoint", f"tcp://127.0.0.1:{ports[name] + i}", "--batch", str(PRODUCER_BATCH)]
            argv += [
                "--timeout",
                "120",
                *(["--ack-endpoint", f"tcp://127.0.0.1:{ports[f'{name}-ack'] + i}"] if d.crash else []),
            ]
            self.procs.append(
                subprocess.Popen(
                    bed.on(0, *argv) if bed else argv,
                    env=mpi_env(),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )

    def finish(self, wait: float) -> str:
        """What went wrong with the producers ("" when nothing) once each has ended within `wait` s (0: the run
        failed: they are stopped, unheard); their tuples resent after a restart add up in `resent`."""
        faults = []
        for p in self.procs:
            name = p.args[p.args.index("--name") + 1]
            try:
                stdout, stderr = p.communicate(timeout=wait)
            except subprocess.TimeoutExpired:
                p.kill()
                p.communicate()
                faults += [f" producer {name} still running {wait:g}s after the run"] if wait else []
                continue
            if p.returncode == 0:
                self.resent += json.loads(stdout.strip().splitlines()[-1]).get("tuples_resent", 0)
            elif wait:
                faults.append(f" producer {name}: exit {p.returncode}: {stderr.strip()[-300:]}")
        return "".join(faults)


def run_on_hosts(
    bed: TestBed, d: Draw, tmp: Path, cfg: dict, env, cut: bool, victims: list[str], timeout: float
) -> Run:
    """Run the draw on the bed's hosts by deploy.launch; with `cut`, the third host's link goes down at the
    first complete checkpoint and stays down: the supervisor finishes on the others (a rescaled recovery)."""
    per = host_slots(d)
    hosts = [i for i, n in enumerate(per) if n]
    job = BedJob(bed, tmp, d.ranks, [per[i] for i in hosts], cfg, SUPERVISE if d.crash else (), env, hosts)
    if cut:
        try:
            job.wait_for("checkpoint 1 complete", timeout)
            bed.cut(2)
            victims.append(f"host {bed.name(2)} cut off")
        except AssertionError:  # the run ended first
            pass
    return job.finish(timeout)


def run_draw(d: Draw, tmp: Path, timeout: float = 240, spark=None) -> Outcome:
    """Run draw `d` in folder `tmp` and compare with the reference (`spark`: the session of the aggregation's
    and the replay's checks; None: one of this process's own)."""
    out = Outcome(d, refused=refusal(d))
    if out.refused:
        return out
    started = time.time()
    tmp.mkdir(parents=True, exist_ok=True)
    data = workload(d)
    path = write_input(d, data, tmp)
    expected, expected_late = reference(d, data)
    out.expected = sum(map(len, expected))
    env = {"STREAMJOIN_STRAGGLER": f"{d.dispatchers}:0.05"} if d.moves else {}  # the first slave lags
    victims: list[str] = []
    cut = cuts_a_host(d)
    rng = np.random.default_rng([d.seed, 3])
    fault = crash_fault(d, rng, tmp / "fault-fired") if d.crash and not cut else ""
    if fault:
        env["STREAMJOIN_FAULT"] = fault
    ports = endpoints(d, free_port(d.dispatchers * len(endpoints(d, 0))))
    run = feeds = None
    bed = TestBed(3).__enter__() if d.hosts > 1 else None
    sub = (
        Subscriber(ports["results"], d.dispatchers, bed and bed.ns(0)) if d.output != "files" else None
    )  # before the cluster
    topics = ExitStack()
    try:
        kafka = {}
        if d.input == "kafka":  # on the dispatchers' host: a broker of the draw's own there
            broker, within = root_broker() if bed is None else (None, within_netns(bed.ns(0)))
            if bed is not None:
                broker = topics.enter_context(local_broker(tmp / "broker", bed.on(0), within))
            kafka = {"broker": broker, "topics": within(lambda: fill_topics(d, data, broker, f"m{d.seed}-{tmp.name}"))}
        cfg = settings(d, path, len(data["ts"]), ports, **kafka)
        feeds = Producers(d, tmp, ports, bed)
        if bed is None:
            run = run_cluster(tmp, d.ranks, cfg, timeout=timeout, env=env, wrapper=SUPERVISE if d.crash else ())
        else:
            run = run_on_hosts(bed, d, tmp, cfg, env, cut, victims, timeout)
    except Exception as e:  # a hang (timeout) is a failure of the draw, with its seed
        out.error, out.seconds = f"{type(e).__name__}: {e}", time.time() - started
        return out
    finally:
        if sub is not None:  # the master sent END before it exited, unless it failed
            sub.finish(wait=10.0 if run is not None and run.returncode == 0 else 0.0)
        if feeds is not None:  # each ends once the run confirmed its END, unless the run failed: then stopped
            out.error += feeds.finish(wait=60.0 if run is not None and run.returncode == 0 else 0.0)
            out.resent = feeds.resent if d.crash and live(d) else None
        topics.close()
        if bed is not None:
            bed.__exit__()
    (tmp / "stderr.log").write_text(run.stderr)  # the evidence of a failed draw, kept with its folder
    if fault and (tmp / "fault-fired").exists():
        victims.append(f"rank {fault.split(':')[0]} at {' '.join(fault.split(':')[1:3])}")
    out.killed = ", ".join(victims)
    out.seconds = time.time() - started
    if run.returncode != 0:
        out.error = f"exit {run.returncode}: {run.stderr[-2000:]}"
        return out
    compare(d, run, expected, expected_late, out)
    if not single_file(d):
        out.error += payload_mismatch(run.out)
    if sub is not None:
        out.error += stream_faults(d, sub, expected, data)
        out.streamed = sum(len(rows) for m in sub.messages if (rows := message_rows(m)) is not None)
    if d.aggregate:
        out.error += view_faults(d, run, tmp, expected, data, spark or spark_session())
    if d.replay:
        out.error += replay_faults(d, data, path, tmp, spark or spark_session())
    out.seconds = time.time() - started  # with the view's and the replay's checks
    return out


def compare(d: Draw, run: Run, expected: tuple, expected_late: np.ndarray, out: "Outcome") -> None:
    """Add to `out` the pairs and rows alone of `run` missing, extra and twice against `expected`, and the late
    tuples it got wrong."""
    ids = ("r_id", "s_id") if single_file(d) else tuple(f"{name}_event_id" for name in STREAMS)
    for got, want in zip((run.pairs(ids), run.alone("r", ids), run.alone("s", ids)), expected):  # pairs, rows alone
        out.twice += len(got) - len(np.unique(got))
        out.missing += len(np.setdiff1d(want, got))
        out.extra += len(np.setdiff1d(got, want))
    late = run.late_ids() if single_file(d) else run.late_ids(ids, STREAMS)
    out.late_wrong += len(np.setxor1d(late, expected_late))


_spark = None  #: the Spark session of `python -m tests.matrix` (started at the first draw that needs one)


def spark_session():
    global _spark
    if _spark is None:
        from control.spark import session

        _spark = session(app="matrix")
        atexit.register(_spark.stop)
    return _spark


def reference_rows(d: Draw, expected: tuple, data: dict[str, np.ndarray]) -> pa.Table:
    """The reference's result rows with the columns as results name them (trades_event_id, trades_sym,
    trades_at, ...; the single file's r_id, r_key, r_ts, r_value, ...; and kind outside inner joins): pairs, then
    R rows alone, then S rows alone."""
    pairs, lone_r, lone_s = expected
    scale = 1_000_000 // UNITS[d.unit]
    kinds = (MATCHED, LEFT_MATCHED if d.join_type == "semi" else LEFT_UNMATCHED, RIGHT_UNMATCHED)
    r_ids = np.concatenate([pairs // 2**32, lone_r, np.full(len(lone_s), -1)])
    s_ids = np.concatenate([pairs % 2**32, np.full(len(lone_r), -1), lone_s])
    columns = {}
    for side, ((id_, key_, time_, value_), wanted) in enumerate(zip(result_names(d), (r_ids, s_ids))):
        mine = data["stream"] == side
        at = np.zeros(int(data["id"][mine].max()) + 1, np.int64)
        key = np.zeros(len(at), np.int64)
        at[data["id"][mine]], key[data["id"][mine]] = data["ts"][mine] * scale, data["key"][mine]
        there = wanted >= 0
        ids = np.where(there, wanted, 0)
        sym = np.char.add("k", key[ids].astype(str)) if d.predicate == "equal" and not single_file(d) else key[ids]
        columns[id_] = pa.array(ids, mask=~there)
        columns[key_] = pa.array(sym, mask=~there)
        columns[time_] = pa.array(at[ids], mask=~there).cast(pa.timestamp("us", "UTC"))
        if value_ != id_:  # the single file's value: its key as a float (write_input)
            columns[value_] = pa.array(key[ids].astype(np.float64), mask=~there)
    if d.join_type != "inner":
        columns["kind"] = np.repeat(kinds, [len(pairs), len(lone_r), len(lone_s)])
    return pa.table(columns)


def view_faults(d: Draw, run: Run, tmp: Path, expected: tuple, data: dict[str, np.ndarray], spark) -> str:
    """The merger's view of the run's partials (control.aggregate, streaming, until idle) against DuckDB's
    aggregation of the reference rows; a message, or ""."""
    import duckdb

    from control import aggregate
    from protocol.aggregation import aggregation
    from tests.cluster.test_aggregate_streams import aggregated, assert_view_equals

    cfg = load_config(tmp / "run.toml")
    spec = aggregation(cfg)
    view, ckpt = tmp / "view", tmp / "view-checkpoint"
    aggregate.run_stream(spark, run.out / "aggregates", view, ckpt, ENDED_IDLE, trigger=0.2, quiet=True, spec=spec)
    duckdb.register("matrix_rows", reference_rows(d, expected, data))
    try:
        want = aggregated("SELECT * FROM matrix_rows", cfg)
        assert_view_equals(aggregate.read_view(tmp / "view"), want, cfg, least=0)  # a draw may have few rows
    except AssertionError as e:
        return f" view: {str(e)[:500]}"
    finally:
        duckdb.unregister("matrix_rows")
    return ""


def replay_faults(d: Draw, data: dict[str, np.ndarray], path: Path, tmp: Path, spark) -> str:
    """A drawn second of the input replayed by control.replay (unpaced, the run's config, no checkpoints, no
    result stream) against the reference join of the tuples in it, in the order the replay hands them on (the
    single file's: by ts, stream, id; declared streams: their files' order); a message, or ""."""
    from control import replay

    unit = UNITS[d.unit]
    start = int(np.random.default_rng([d.seed, 13]).integers(0, 2 * unit))
    inside = (data["ts"] >= start) & (data["ts"] < start + unit)
    part = {c: v[inside] for c, v in data.items()}
    if d.input == "file":
        order = np.lexsort((part["id"], part["stream"], part["ts"]))
        part = {c: v[order] for c, v in part.items()}
    expected, expected_late = reference(d, part)
    out = tmp / "replayed"
    sets = [f"output.path={out}", 'output.zmq_endpoint=""', "output.wait_subscribers=0", "checkpoint.interval=0"]
    argv = [*([str(path)] if d.input == "file" else []), "--config", str(tmp / "run.toml"), "-n", str(d.ranks)]
    argv += [
        "--from",
        seconds_text(np.array([start]), d.unit)[0],
        "--to",
        seconds_text(np.array([start + unit]), d.unit)[0],
    ]
    code = replay.main([*argv, "--speed", "max", *(x for kv in sets for x in ("--set", kv))], spark)
    if code != 0:
        return f" replay: exit {code}"
    got = Outcome(d)
    compare(d, Run(out, subprocess.CompletedProcess([], 0, "", "")), expected, expected_late, got)
    wrong = (got.missing, got.extra, got.twice, got.late_wrong)
    return (
        f" replay of [{start}, {start + unit}) {d.unit}: missing, extra, twice, late-wrong {wrong}"
        if any(wrong)
        else ""
    )


def payload_mismatch(out: Path) -> str:
    """With declared streams, every result row's payload is its own row's ("n<id>" beside id <id>); else a
    message."""
    t = read_tables(out / "results")
    if t is None:
        return ""
    for name in STREAMS:
        present = pc.is_valid(t[f"{name}_event_id"])
        want = pc.binary_join_element_wise("n", pc.cast(t[f"{name}_event_id"], pa.string()), "")
        wrong = pc.sum(pc.and_(present, pc.invert(pc.fill_null(pc.equal(t[f"{name}_note"], want), False)))).as_py()
        if wrong:
            return f"payload of {wrong} {name} rows is not their own"
    return ""


def cuts_a_host(d: Draw) -> bool:
    """A crash on three hosts with two slaves or more cuts the third host off (run_on_hosts): the third host
    holds a slave, another host one more."""
    return d.crash and d.hosts > 1 and d.slaves >= 2


def cost(d: Draw) -> float:
    """About the seconds a draw takes on a 2-core machine: a run, more on namespace hosts, much more when a host
    is cut off (the heartbeat timeout, the end of the job, the supervisor's probe and a restart)."""
    return (
        6.0
        + 0.3 * d.slaves
        + 2.0 * (d.hosts > 1)
        + (8.0 if cuts_a_host(d) else 1.5 if d.crash else 0.0)
        + 1.0 * live(d)  # the producers' start beside the cluster
    )


def covering_seeds(count_limit: int = 40, search: int = 2000) -> list[int]:
    """A cheap set of seeds whose accepted draws cover every pair of feature values the engine accepts, one of
    them cutting a host off (greedy: the cheapest cut draw first, then the seed that covers most uncovered
    pairs per second of its cost), and at least one with each feature of SOMETIMES."""

    def pairs_of(d: Draw) -> set:
        f = d.features()
        return {((a, f[a]), (b, f[b])) for a, b in itertools.combinations(PAIRED, 2)}

    draws = {s: draw(s) for s in range(search) if refusal(draw(s)) is None}
    accepted = {s: pairs_of(d) for s, d in draws.items()}
    wanted = set().union(*accepted.values())
    chosen = [min((s for s, d in draws.items() if cuts_a_host(d)), key=lambda s: cost(draws[s]) / len(accepted[s]))]
    wanted -= accepted.pop(chosen[0])
    while wanted and len(chosen) < count_limit:
        best = max(accepted, key=lambda s: len(accepted[s] & wanted) / cost(draws[s]))
        chosen.append(best)
        wanted -= accepted.pop(best)
    for feature in SOMETIMES:  # each at least once: the cheapest draw with it, if the pairs' draws have none
        if not any(getattr(draws[s], feature) for s in chosen):
            chosen.append(min((s for s in accepted if getattr(draws[s], feature)), key=lambda s: cost(draws[s])))
    return chosen


def coverage(outcomes: list[Outcome]) -> tuple[int, int]:
    """(feature-value pairs the accepted draws covered, pairs in the product)."""
    seen = set()
    for o in outcomes:
        if not o.refused:
            f = o.draw.features()
            seen |= {((a, f[a]), (b, f[b])) for a, b in itertools.combinations(FEATURES, 2)}
    total = sum(len(FEATURES[a]) * len(FEATURES[b]) for a, b in itertools.combinations(FEATURES, 2))
    return len(seen), total


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.matrix", description=__doc__.split("\n")[0])
    p.add_argument("--seed", type=int, action="append", help="run this draw (repeatable)")
    p.add_argument("--minutes", type=float, default=0.0, help="run random draws for this long (make soak)")
    p.add_argument("--covering", action="store_true", help="run the covering seeds CI runs")
    p.add_argument("--keep", action="store_true", help="keep each draw's folder (input, config, output)")
    p.add_argument(
        "--where",
        action="append",
        default=[],
        metavar="FEATURE=VALUE",
        help="random draws only with this feature value, e.g. --where hotkeys=True or --where "
        "join.type=left (repeatable; VALUE,VALUE: either, e.g. --where output=stream,ordered)",
    )
    p.add_argument("--draws", type=int, default=0, help="stop after this many draws were run (0: by time)")
    a = p.parse_args(argv)
    wanted = {k.replace(".", "_"): v for k, v in (w.split("=", 1) for w in a.where)}  # join.type = join_type
    unknown = set(wanted) - set(FEATURES)
    if unknown:
        p.error(f"unknown feature(s) {sorted(unknown)}; known: {', '.join(FEATURES)}")
    seeds = iter(a.seed or (covering_seeds() if a.covering else []))
    rng = np.random.default_rng()
    deadline = time.time() + a.minutes * 60
    outcomes: list[Outcome] = []
    root = Path(tempfile.mkdtemp(prefix="matrix-"))
    while True:
        seed = next(seeds, None)
        if seed is None:
            ran = sum(not o.refused for o in outcomes)
            if a.seed or a.covering or (ran >= a.draws if a.draws else time.time() >= deadline):
                break
            seed = int(rng.integers(1_000_000))
            f = draw(seed).features()
            if any(str(f[k]) not in v.split(",") for k, v in wanted.items()) or refusal(draw(seed)):
                continue
        try:
            o = run_draw(draw(seed), root / f"seed-{seed}")
        except Exception as e:  # noqa: BLE001 - a check that breaks is that draw's failure, not the soak's end
            o = Outcome(draw(seed), error=f"{type(e).__name__} in the draw's checks: {e}"[:500])
        outcomes.append(o)
        print(o.line(), flush=True)
        if not o.ok:
            print(
                f"  reproduce: python -m tests.matrix --seed {seed} --keep   (folder {root / f'seed-{seed}'})",
                flush=True,
            )
    ran = [o for o in outcomes if not o.refused]
    failed = [o for o in ran if not o.ok]
    covered, total = coverage(outcomes)
    print(
        f"\n{len(outcomes)} draws: {len(ran)} run, {len(outcomes) - len(ran)} refused (by the config, or not "
        f"drawn), {len(failed)} failed; feature-value pairs covered {covered} of {total}"
    )
    for feature, values in FEATURES.items():  # draws run per feature value, and failures among them
        cells = [
            f"{v}: {sum(o.draw.features()[feature] == v for o in ran)}"
            f"{'/' + str(sum(o.draw.features()[feature] == v for o in failed)) + ' failed' if failed else ''}"
            for v in values
        ]
        print(f"  {feature:12s} " + "   ".join(cells))
    for o in failed:
        print(f"  failed: seed {o.draw.seed}  (python -m tests.matrix --seed {o.draw.seed})")
    if not a.keep and not failed:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
