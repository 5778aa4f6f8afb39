"""`python -m control.replay INPUT... [--from T] [--to T] [--speed max|realtime|N] [-n RANKS] [-- master args]`:
replay archived or user-provided streams into the cluster.

Spark reads the inputs (Parquet or CSV with the file source's columns stream, id, ts, key[, value]; a
folder stands for the files in it, so the cluster's input archive `<out>/archive/` works as it is),
keeps the tuples with `from <= ts < to` (compared as decimals to the microsecond, as the engine compares
event time: docs/time.md), orders them by ts (ties by stream, then id) and writes them as
one Parquet file, `<output.path>/replay/selection.parquet`.  The cluster then runs with the file source on
that file, paced by the tuples' own times (`source.speed`, master.sources.paced): `max` = unpaced,
`realtime` = speed 1, `N` = N times real time; bursts and gaps are kept.  A push to a running cluster
(`--endpoint`) is paced uniformly at the selection's mean rate (control.produce).
Also runnable as `spark-submit control/replay.py ...` (with `--prepare-only` where mpirun is elsewhere).

Without INPUT, the declared streams of `--config` (`[streams.*]` of files): Spark reads each stream's files in
their order, keeps the rows whose time column is in the range (a number in the stream's time_unit, a timestamp,
or ISO-8601 text; no zone = UTC), and writes them, in their files' order, as one file per stream in the
stream's own format (`<output.path>/replay/NAME.csv|parquet|jsonl`); the cluster then runs the config with those
files as the streams and `source.speed` = --speed: each tuple is handed on as its time says
(master.sources.paced), so bursts and gaps are kept, not smoothed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import argparse
import json
import math
import shlex
import shutil
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file (spark-submit control/replay.py): make the project importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from protocol.config import ConfigError
from protocol.output import OUTPUT_PARTS
from protocol.lifetime import invocation
from control.spark import is_nanos, seconds_text, stream_micros, stream_rows
from common.chunks import InputError
from common.stream_file import first_schema, stream_files
from protocol.eventtime import duration

if TYPE_CHECKING:
    from protocol.plan import Plan

COLUMNS = ("stream", "id", "ts", "key", "value")
FORMATS = {".parquet": "parquet", ".pq": "parquet", ".csv": "csv"}


class ReplayError(Exception):
    """A user mistake in the replay's input or options; the message names it."""


def parse_speed(text: str) -> float:
    """'max' -> inf, 'realtime' -> 1, 'N' -> N (> 0)."""
    if text == "max":
        return math.inf
    if text == "realtime":
        return 1.0
    try:
        speed = float(text)
    except ValueError:
        speed = -1.0
    if not (speed > 0 and math.isfinite(speed)):
        raise ReplayError(f"--speed: expected max, realtime or a number > 0, got {text!r}")
    return speed


def shown(seconds: float) -> str:
    """A --from or --to as written: its exact decimals (never 1.77246e+09), or -inf / inf."""
    return seconds_text(duration(seconds)) if math.isfinite(seconds) else f"{seconds:g}"


def within(start: float, end: float):
    """The rows whose `_us` lies in [start, end) seconds, the bounds from their decimals (the config's rule)."""
    from pyspark.sql import functions as F

    inside = F.col("_us").isNotNull()
    if math.isfinite(start):
        inside &= F.col("_us") >= F.lit(duration(start))
    if math.isfinite(end):
        inside &= F.col("_us") < F.lit(duration(end))
    return inside


def pace(tuples: int, span: float, speed: float) -> float:
    """source.rate (tuples/s) that plays `span` seconds of event time at `speed` x real time; 0 = unpaced."""
    if math.isinf(speed) or span <= 0:
        return 0.0
    return tuples * speed / span


def input_files(inputs: list[str]) -> list[tuple[Path, str]]:
    """(file, format) of every input; a folder contributes its Parquet/CSV files (not hidden ones)."""
    files = []
    for item in inputs:
        p = Path(item)
        if p.is_dir():
            inside = sorted(f for f in p.iterdir() if f.suffix.lower() in FORMATS and not f.name.startswith((".", "_")))
            if not inside:
                raise ReplayError(f"input folder {item!r} holds no Parquet or CSV files")
            files += inside
        elif p.is_file():
            if p.suffix.lower() not in FORMATS:
                raise ReplayError(
                    f"input file {item!r} has extension {p.suffix or '(none)'!r}; accepted: {', '.join(FORMATS)}"
                )
            files.append(p)
        else:
            raise ReplayError(f"input {item!r} does not exist")
    return [(f, FORMATS[f.suffix.lower()]) for f in files]


def read_inputs(spark, files: list[tuple[Path, str]], unit: str = "s"):
    """All inputs as one DataFrame of the file source's columns plus `_us` (ts in microseconds as the engine
    reads it, numbers in `unit`: control.spark.stream_micros; null if it is not a time).

    With any CSV input every column but `_us` stays text, so the cluster's file source validates the cells
    as written and sets bad rows aside in rejected/ with the replay file's row number.
    """
    import pyarrow.parquet as pq
    from pyspark.sql import functions as F

    as_text = any(fmt == "csv" for _, fmt in files)
    frames = []
    for path, fmt in files:
        df = spark.read.csv(str(path), header=True) if fmt == "csv" else spark.read.parquet(str(path))
        missing = [c for c in COLUMNS[:4] if c not in df.columns]
        if missing:
            raise ReplayError(
                f"input file {str(path)!r} lacks column(s) {', '.join(missing)}; "
                f"columns found: {', '.join(df.columns) or '(none)'}"
            )
        nanos = fmt == "parquet" and is_nanos(pq.read_schema(path).field("ts").type)
        us = stream_micros(df, "ts", "ns" if nanos else unit)
        cols = [F.col(c) if c in df.columns else F.lit(None).cast("double") for c in COLUMNS]  # value is optional
        if nanos:  # read as its count of nanoseconds: written back as the microseconds the engine makes of them
            cols[2] = F.timestamp_micros(us)
        cols = [c.cast("string") if as_text else c for c in cols]
        frames.append(df.select(*(c.alias(n) for c, n in zip(cols, COLUMNS)), us.alias("_us")))
    out = frames[0]
    for f in frames[1:]:
        out = out.unionByName(f)
    return out


def select(spark, files: list[tuple[Path, str]], start: float, end: float, dest: Path, unit: str = "s") -> dict:
    """Write the tuples with start <= ts < end, ordered by ts, as the single Parquet file `dest`; numbers in the
    ts column count `unit`s (source.ts_unit)."""
    from pyspark.sql import functions as F

    df = read_inputs(spark, files, unit)
    stats = df.agg(F.count(F.lit(1)).alias("rows"), F.count("_us").alias("numeric")).first()
    chosen = df.where(within(start, end))
    span = chosen.agg(F.count(F.lit(1)).alias("n"), F.min("_us").alias("lo"), F.max("_us").alias("hi")).first()
    if span["n"] == 0:
        raise ReplayError(
            f"no tuples with {shown(start)} <= ts < {shown(end)} in {len(files)} input file(s) ({stats['rows']:,} rows)"
        )
    staging = dest.parent / f"_{dest.stem}.spark"
    (
        chosen.repartition(1)
        .sortWithinPartitions("_us", "stream", F.col("id").try_cast("long"), "id")
        .drop("_us")
        .write.mode("overwrite")
        .parquet(str(staging))
    )
    (part,) = staging.glob("part-*.parquet")
    part.replace(dest)
    shutil.rmtree(staging)
    return {
        "rows": stats["rows"],
        "no_ts": stats["rows"] - stats["numeric"],
        "tuples": span["n"],
        "first_us": span["lo"],
        "last_us": span["hi"],
    }


def select_streams(spark, streams: dict, start: float, end: float, folder: Path) -> dict:
    """Each declared stream's rows with start <= time < end, in their files' order, as one file per stream in
    `folder` (the stream's own format: CSV cells stay text, so the cluster reads them as it read the originals);
    per stream its rows, rows kept and first and last time (seconds)."""
    from pyspark.sql import functions as F

    out = {}
    for name, spec in streams.items():
        df, fmt = stream_rows(spark, name, spec, typed=False)  # the cells as written: read again as declared
        inside = within(start, end)
        chosen = df.where(inside)
        counts = df.agg(F.count(F.lit(1)).alias("rows"), F.sum(inside.cast("long")).alias("kept")).first()
        span = chosen.agg(F.min("_us").alias("lo"), F.max("_us").alias("hi")).first()
        staging = folder / f"_{name}.spark"
        writer = chosen.repartition(1).sortWithinPartitions("_row").drop("_row", "_id", "_us").write
        writer = writer.mode("overwrite")
        (writer.option("header", True).csv if fmt == "csv" else getattr(writer, fmt))(str(staging))
        (part,) = [p for p in staging.glob("part-*") if not p.name.endswith(".crc")]
        dest = folder / f"{name}.{ {'csv': 'csv', 'parquet': 'parquet', 'json': 'jsonl'}[fmt] }"
        if fmt == "parquet":
            as_read(part, dest, first_schema(stream_files(name, spec.path)[0]))
        else:
            part.replace(dest)
        shutil.rmtree(staging)
        out[name] = {
            "path": str(dest),
            "rows": counts["rows"],
            "kept": counts["kept"] or 0,
            "first_us": span["lo"],
            "last_us": span["hi"],
        }
    if not any(s["kept"] for s in out.values()):
        raise ReplayError(f"no row of any stream with {shown(start)} <= time < {shown(end)}")
    return out


def as_read(part: Path, dest: Path, schema) -> None:
    """The Parquet file Spark wrote (`part`) as `dest` with its columns in the types of the stream's first file
    (`schema`): Spark has no nanoseconds (it reads a timestamp[ns] column as its count of them), no unsigned
    integers and no timestamps in other units, so the replayed run reads the rows the original run read, in
    the same types."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    written = pq.ParquetFile(part)
    target = pa.schema(
        [schema.field(n) if n in schema.names else written.schema_arrow.field(n) for n in written.schema_arrow.names]
    )
    with pq.ParquetWriter(dest, target) as w:
        for batch in written.iter_batches():
            w.write_table(pa.Table.from_batches([batch]).cast(target))
    part.unlink()


def inside_engine_output(path: Path, out: Path) -> str | None:
    """The part of `out` a new cluster run would remove that holds `path`, if any."""
    for part in OUTPUT_PARTS:
        if path.resolve().is_relative_to((out / part).resolve()):
            return part
    return None


def main(argv: list[str], spark=None) -> int:
    from control.spark import add_arguments, config, session

    p = argparse.ArgumentParser(prog=invocation("control.replay"), description=__doc__.split("\n")[0])
    p.add_argument(
        "inputs",
        nargs="*",
        metavar="INPUT",
        help="Parquet/CSV file or folder of them (e.g. <out>/archive); none: the declared streams' files of --config",
    )
    p.add_argument("--from", dest="start", type=float, default=-math.inf, help="first ts to replay (inclusive)")
    p.add_argument("--to", dest="end", type=float, default=math.inf, help="ts where the replay ends (exclusive)")
    p.add_argument("--speed", default="max", help="max (as fast as possible), realtime, or N (x real time)")
    p.add_argument("-n", "--ranks", type=int, default=17, help="ranks in all: 1 master + slaves (default 17)")
    p.add_argument("--hostfile", help="Open MPI hostfile for several hosts (see hosts.example)")
    p.add_argument("--prepare-only", action="store_true", help="write the selection and print the command only")
    p.add_argument(
        "--endpoint",
        help="instead of starting a cluster, push the selection at the chosen speed to a "
        'running one whose source.kind = "zmq" listens here (control.produce)',
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        help="with --endpoint: give up when the cluster takes no message for this long (default 60 s)",
    )
    add_arguments(p)
    a = p.parse_args(argv)
    try:
        speed = parse_speed(a.speed)
        if not a.start < a.end:
            raise ReplayError(f"--from ({shown(a.start)}) must be below --to ({shown(a.end)})")
        plan = config(a)
        out = plan.output.path
        if not a.inputs:
            return replay_streams(a, plan, speed, spark)
        files = input_files(a.inputs)
        for f, _ in files:
            if part := inside_engine_output(f, out):
                raise ReplayError(
                    f"input {str(f)!r} lies in {str(out / part)!r}, which the replayed run removes "
                    "when it starts: choose another output.path (--set output.path=...)"
                )
        dest = out / "replay" / "selection.parquet"
        dest.parent.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        spark = spark or session(a.spark_master, "streamjoin-replay")
        sel = select(spark, files, a.start, a.end, dest, plan.source.ts_unit)
    except (ReplayError, ConfigError, InputError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    span = (sel["last_us"] - sel["first_us"]) / 1e6
    rate = pace(sel["tuples"], span, speed)  # a push to a running cluster: uniform, as control.produce paces
    skipped = f"; {sel['no_ts']:,} rows left out: ts is not a number" if sel["no_ts"] else ""
    pacing = "unpaced" if math.isinf(speed) else f"as their ts say, x{speed:g}"
    if a.endpoint:
        pacing = "unpaced" if rate == 0 else f"{rate:,.0f} tuples/s"
    print(
        f"replay: {sel['tuples']:,} of {sel['rows']:,} rows, ts {seconds_text(sel['first_us'])} .. "
        f"{seconds_text(sel['last_us'])} ({seconds_text(sel['last_us'] - sel['first_us'])}s) -> {dest} "
        f"in {time.monotonic() - started:.1f}s; {pacing}{skipped}",
        flush=True,
    )
    if a.endpoint:  # a cluster is already running with the ZeroMQ source
        from control.produce import Blocked, produce
        from protocol.access import source_token

        try:  # the token of --config / --set source.token_file, as the running cluster's
            sent = produce(str(dest), a.endpoint, rate=rate, timeout=a.timeout, token=source_token(plan.source))
        except Blocked as e:
            print(
                f'error: replay to {a.endpoint}: {e} (is a cluster with source.kind = "zmq" running there?)',
                file=sys.stderr,
            )
            return 1
        print(f"replay: pushed to {a.endpoint}: {json.dumps(sent)}", flush=True)
        return 0
    at = f"source.speed={0.0 if math.isinf(speed) else speed!r}"
    return launch_replay(
        a, [*a.set, 'source.kind="file"', f"source.path={json.dumps(str(dest))}", at, "source.rate=0.0"]
    )


def launch_replay(a, sets: list[str]) -> int:
    """The cluster on the selection (deploy.launch with the replay's -n, --hostfile, --config and `sets`), or
    with --prepare-only its command line printed."""
    from deploy.launch import main as launch

    args = [
        "-n",
        str(a.ranks),
        *(["--hostfile", a.hostfile] if a.hostfile else []),
        "--",
        *(["--config", a.config] if a.config else []),
        *(x for s in sets for x in ("--set", s)),
    ]
    if a.prepare_only:
        print(shlex.join([sys.executable, "-m", "deploy.launch", *args]), flush=True)
        return 0
    return launch(args)


def replay_streams(a, plan: Plan, speed: float, spark) -> int:
    """The declared streams' rows of the range, each stream's from its own files, run with their own timing
    (source.speed) on the run's config with the selections as the streams' paths."""
    from control.spark import session

    streams = {s.name: s for s in plan.streams}
    if not streams:
        raise ReplayError("no INPUT given and the config declares no [streams.*] (give the files to replay)")
    if a.endpoint:
        raise ReplayError("--endpoint: not with declared streams yet (a live stream of each would be needed)")
    live = [n for n, spec in streams.items() if not spec.path]
    if live:
        raise ReplayError(f"streams.{live[0]}: replay reads a stream's files; a live stream or a topic has none")
    out = plan.output.path
    for name, spec in streams.items():
        for f in stream_files(name, spec.path):
            if part := inside_engine_output(f, out):
                raise ReplayError(
                    f"streams.{name}.path: {str(f)!r} lies in {str(out / part)!r}, which the replayed run "
                    "removes when it starts: choose another output.path (--set output.path=...)"
                )
    folder = out / "replay"
    folder.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    spark = spark or session(a.spark_master, "streamjoin-replay")
    chosen = select_streams(spark, streams, a.start, a.end, folder)
    for name, c in chosen.items():
        first = "-" if c["first_us"] is None else f"{seconds_text(c['first_us'])} .. {seconds_text(c['last_us'])}"
        print(f"replay: streams.{name}: {c['kept']:,} of {c['rows']:,} rows, time {first} -> {c['path']}", flush=True)
    pacing = "unpaced" if math.isinf(speed) else f"as their times say, x{speed:g}"
    print(f"replay: selected in {time.monotonic() - started:.1f}s; {pacing}", flush=True)
    sets = [
        *a.set,
        *(f"streams.{name}.path={json.dumps(c['path'])}" for name, c in chosen.items()),
        f"source.speed={0.0 if math.isinf(speed) else speed!r}",
        "source.rate=0.0",
    ]
    return launch_replay(a, sets)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
