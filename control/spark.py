"""The Spark session of the control jobs and the command-line options they share.

Spark runs embedded (`local[*]`) unless a master URL is given; under `spark-submit` the submitter's master
wins.  Shuffles use few partitions (the control data is small: partial views, a replay selection), the UI
is off and the driver binds to 127.0.0.1 in local mode, so nothing listens beyond this host.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from decimal import Decimal
from typing import TYPE_CHECKING

from protocol.plan import load_plan
from protocol.eventtime import FLOAT_TEXT, ISO_TEXT, NEG_INF, POS_INF, TS_LIMIT

if TYPE_CHECKING:
    from protocol.plan import Plan, Stream

LOCAL = "local[*]"
#: the share of the machine's memory an embedded Spark's JVM may take (its heap: execution, cache and the
#: driver), at least MIN_HEAP_GIB; what does not fit spills to spark.local.dir
HEAP_SHARE, MIN_HEAP_GIB = 0.25, 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    """--config/--set (the cluster's config: output.path, [aggregate]) and --spark-master."""
    p.add_argument("--config", help="the cluster's TOML config (output.path, [aggregate]: docs/configuration.md)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one config key, as for python -m master (repeatable)",
    )
    p.add_argument("--spark-master", help=f"Spark master URL (default {LOCAL}, or spark-submit's --master)")


def config(args: argparse.Namespace) -> Plan:
    """The plan of `--config` and `--set` (the run's, for a command that reads its output)."""
    return load_plan(args.config, args.set)


def machine_heap() -> str:
    """The embedded JVM's heap for this machine: HEAP_SHARE of its memory (Spark's default, 1 GiB, runs out on
    make run's 6M tuples: sorts and aggregations then fail instead of spilling)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return f"{max(MIN_HEAP_GIB << 10, int(total * HEAP_SHARE) >> 20)}m"


def session(master: str | None = None, app: str = "streamjoin", settings: dict[str, str] | None = None):
    """A Spark session with quiet logging, small shuffles and a heap sized for the machine (machine_heap; it
    applies when this starts the JVM, not under spark-submit, whose --driver-memory wins); `settings` add or
    override Spark settings."""
    from pyspark.sql import SparkSession

    submitted = "PYSPARK_GATEWAY_PORT" in os.environ  # spark-submit started the JVM and chose the master
    master = master or (None if submitted else LOCAL)
    b = SparkSession.builder.appName(app)
    b = b.config("spark.sql.shuffle.partitions", "4").config("spark.ui.enabled", "false")
    b = b.config("spark.sql.session.timeZone", "UTC").config("spark.pyspark.python", sys.executable)
    b = b.config("spark.ui.showConsoleProgress", "false")
    if not submitted:
        b = b.config("spark.driver.memory", machine_heap())
    # a timestamp[ns] Parquet column (pandas' and pyarrow's default) is read as its count of nanoseconds: Spark
    # has no such type and refuses the file otherwise (stream_micros rounds it as the engine does)
    b = b.config("spark.sql.legacy.parquet.nanosAsLong", "true")
    for name, value in (settings or {}).items():
        b = b.config(name, value)
    if master:
        b = b.master(master)
        if master.startswith("local"):
            os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
            b = b.config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
    spark = b.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def seconds_text(us: int) -> str:
    """Microseconds as the shortest decimal of their seconds ("1", "-0.5", "0.000001"): exact, for names."""
    if us <= NEG_INF or us >= POS_INF:
        return "start" if us <= NEG_INF else "end"
    return format(Decimal(us).scaleb(-6).normalize(), "f")


#: a time column read by Spark: a number in its unit, else a timestamp (a
#: timestamp column, or ISO-8601 text with or without its zone; none is UTC), by docs/time.md's rules
UNIT_DIGITS = {"s": 0, "ms": 3, "us": 6, "ns": 9}
#: ISO-8601 as protocol.eventtime reads it, its groups numbered (Java's regex): date, hh:mm, ss, fraction,
#: the offset's sign, hours, minutes
ISO_GROUPS = re.sub(r"\?P<\w+>", "", ISO_TEXT)
#: a plain decimal as text, converted from its digits; other numbers (exponents, nan, inf) go through a double
PLAIN_DECIMAL = r"^[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)$"


def stream_micros(df, column: str, unit: str):
    """The event time of a column in integer microseconds as the engine reads it (protocol.eventtime.
    from_column, docs/time.md), in Spark SQL; null where the engine would reject the row.  Timestamps (any
    unit Spark reads) are their UTC microseconds; integers count `unit`s (nanoseconds rounded half to even:
    a `timestamp[ns]` Parquet column, which Spark reads as its count of nanoseconds, is passed with unit
    "ns"); floats are rounded to the microsecond; decimals and text from their digits (rounded half to even),
    else as ISO-8601 text (the fraction's digits rounded half to even, minus the zone's offset)."""
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    kind, col = df.schema[column].dataType, F.col(column)
    if isinstance(kind, (T.TimestampType, T.TimestampNTZType)):
        us = F.unix_micros(col.cast("timestamp"))
    elif isinstance(kind, T.IntegralType):
        us = _integer_micros(col.cast("long"), unit)
    elif isinstance(kind, (T.FloatType, T.DoubleType)):
        us = _float_micros(col.cast("double"), unit)
    else:
        text = F.regexp_replace(col.cast("string"), r"^\s+|\s+$", "")
        plain = text.rlike(PLAIN_DECIMAL)
        number = F.when(text.rlike("(?i)" + FLOAT_TEXT), text.try_cast("double"))
        us = F.when(plain, _decimal_micros(text, unit)).when(number.isNotNull(), _float_micros(number, unit))
        us = F.coalesce(us, F.when(~plain & number.isNull(), _iso_micros(text)))
    return F.when((us > -TS_LIMIT) & (us < TS_LIMIT), us)


def _integer_micros(x, unit: str):
    from pyspark.sql import functions as F

    if unit == "ns":  # half to even, as a decimal: exact for every long
        return (F.bround(x.cast("decimal(20,0)"), -3) / 1000).cast("long")
    per_unit = 10 ** (6 - UNIT_DIGITS[unit])
    return F.when(F.abs(x) < TS_LIMIT // per_unit, x * per_unit)


def _float_micros(x, unit: str):
    """Whole units and the fraction apart, so the product adds no error (eventtime.from_numbers)."""
    from pyspark.sql import functions as F

    ok = F.abs(x) < TS_LIMIT / 10 ** (6 - UNIT_DIGITS[unit])  # NaN is above every number in Spark
    if unit == "ns":
        return F.when(ok, F.rint(x / 1000.0)).cast("long")
    per_unit = 10 ** (6 - UNIT_DIGITS[unit])
    whole = F.floor(F.when(ok, x))
    return whole * per_unit + F.rint((x - whole) * per_unit).cast("long")


def _decimal_micros(text, unit: str):
    """A plain decimal's digits moved to microseconds and rounded half to even (up to 24 decimals of a second)."""
    from pyspark.sql import functions as F

    shift = 6 - UNIT_DIGITS[unit]  # decimals of the unit that are whole microseconds
    number = text.try_cast(f"decimal(38,{18 + shift})")
    return (F.bround(number, shift) * F.lit(Decimal(10) ** shift)).cast("long")


def _iso_micros(text):
    from pyspark.sql import functions as F

    part = lambda i: F.regexp_extract(text, ISO_GROUPS, i)  # noqa: E731 -- "" where the group is absent
    hm, sec = part(2), part(3)
    stamp = F.concat(
        part(1), F.lit("T"), F.when(hm == "", "00:00").otherwise(hm), F.lit(":"), F.when(sec == "", "00").otherwise(sec)
    )
    local = F.unix_micros(F.try_to_timestamp(stamp, F.lit("yyyy-MM-dd'T'HH:mm:ss")))
    zh, zm = (F.when(part(i) == "", 0).otherwise(part(i).cast("long")) for i in (6, 7))
    offset = F.when(part(5) == "-", -1).otherwise(1) * (zh * 3600 + zm * 60) * 1_000_000
    frac = F.rpad(part(4), 7, "0")
    us = local - offset + F.substring(frac, 1, 6).cast("long")
    seventh, beyond = F.substring(frac, 7, 1).cast("int"), F.substring(frac, 8, 1 << 20).rlike("[1-9]")
    up = (seventh > 5) | ((seventh == 5) & (beyond | (F.pmod(us, F.lit(2)) == 1)))
    return F.when(text.rlike(ISO_GROUPS) & (zh < 24) & (zm < 60), us + up.cast("long"))


#: strptime directives (pyarrow's CSV timestamp_parsers) as Spark's datetime pattern letters: (1-2 digits or as
#: written, the fixed width next to another directive)
_PATTERNS = {
    "Y": ("y", "yyyy"),
    "y": ("yy", "yy"),
    "m": ("M", "MM"),
    "d": ("d", "dd"),
    "H": ("H", "HH"),
    "I": ("h", "hh"),
    "M": ("m", "mm"),
    "S": ("s", "ss"),
    "j": ("D", "DDD"),
    "b": ("MMM", "MMM"),
    "B": ("MMMM", "MMMM"),
    "p": ("a", "a"),
    "z": ("[XXX][XX]", "[XXX][XX]"),
}


def spark_pattern(fmt: str) -> str:
    """A strptime format (a stream's `time_format`) as a Spark datetime pattern that reads the same text; a
    ValueError for a directive it does not translate."""
    parts = re.split(r"(%.)", fmt)
    out = []
    for i, part in enumerate(parts):
        if part.startswith("%") and len(part) == 2:
            if part == "%%":
                out.append("%")
                continue
            if part[1] not in _PATTERNS:
                raise ValueError(f"{fmt!r}: {part} is not read by the Spark tools (known: %{', %'.join(_PATTERNS)})")
            directive = lambda j: 0 <= j < len(parts) and parts[j].startswith("%")  # noqa: E731
            adjacent = (directive(i + 2) and parts[i + 1] == "") or (directive(i - 2) and parts[i - 1] == "")
            out.append(_PATTERNS[part[1]][adjacent])
        elif part:
            out.append(re.sub(r"([A-Za-z]+)", r"'\1'", part.replace("'", "''")))
    return "".join(out)


def csv_column(text, kind, formats: list[str], where: str):
    """A CSV column of declared Arrow type `kind` (common.stream_file.csv_types) from its text, as pyarrow's CSV
    reader converts it for the engine: timestamps by the stream's strptime `formats` (each tried in order) or
    as ISO-8601; unsigned integers widened (Spark has none); the others cast."""
    import pyarrow as pa
    from pyspark.sql import functions as F
    from pyspark.sql.pandas.types import from_arrow_type

    from common.chunks import InputError

    if pa.types.is_timestamp(kind):
        try:
            stamps = [F.try_to_timestamp(text, F.lit(spark_pattern(f))) for f in formats]
        except ValueError as e:
            raise InputError(f"{where}.time_format: {e}") from None
        return F.coalesce(*stamps) if stamps else F.timestamp_micros(_iso_micros(text))
    wide = {pa.uint8(): "smallint", pa.uint16(): "int", pa.uint32(): "bigint", pa.uint64(): "decimal(20,0)"}
    return text.cast(wide.get(kind) or from_arrow_type(kind))


def is_nanos(kind) -> bool:
    """A timestamp[ns] column, which Spark reads as its count of nanoseconds (session)."""
    import pyarrow as pa

    return pa.types.is_timestamp(kind) and kind.unit == "ns"


def stream_rows(spark, name: str, spec: Stream, typed: bool = True):
    """A declared stream's rows from its files (common.stream_file.stream_files) and the files' format (csv,
    parquet, json; CSV cells stay text but for the columns the stream's `schema` declares, in their types as the
    engine reads them: csv_column; `typed` False: those too as written, their time still read as declared), each
    row with `_row`, its place in the stream: 0-based, counted over the files in their order, as the engine
    numbers a stream's rows (and names them, without an id column); `_id`, the row's name in results (its id
    column as a long, else `_row`); and `_us`, its time in microseconds (stream_micros; a `timestamp[ns]`
    Parquet column, read as its nanoseconds, as such).

    A Parquet row's place is its file's rows before it (from the footers) plus its row index; a CSV or JSON
    row's is counted per split of its file (Spark reads a large file's splits in any order): the rows of the
    splits before it plus its place in its split, from one count per split, so nothing is put in one order."""
    import pyarrow.parquet as pq
    from pyspark.sql import functions as F

    from common.chunks import InputError
    from common.stream_file import csv_types, stream_files

    files = stream_files(name, spec.path)
    declared = csv_types(name, spec, files)
    formats = {".csv": "csv", ".parquet": "parquet", ".pq": "parquet"}
    fmt = formats.get(files[0].suffix.lower(), "json")
    if any(formats.get(f.suffix.lower(), "json") != fmt for f in files):
        raise InputError(f"streams.{name}.path: its files mix formats; this reads one format per stream")
    frames, before = [], 0
    for i, f in enumerate(files):
        if fmt == "parquet":
            footer = pq.ParquetFile(f)
            kind = footer.schema_arrow.field(spec.time).type if spec.time in footer.schema_arrow.names else None
            nanos = kind is not None and is_nanos(kind)
            df = spark.read.parquet(str(f)).withColumn("_row", F.col("_metadata.row_index") + before)
            df = df.withColumn("_us", stream_micros(df, spec.time, "ns" if nanos else spec.time_unit))
            before += footer.metadata.num_rows
        else:
            df = spark.read.option("header", True).csv(str(f)) if fmt == "csv" else spark.read.json(str(f))
            df = df.select(
                "*",
                F.lit(i).alias("_file"),
                F.col("_metadata.file_block_start").alias("_split"),
                F.monotonically_increasing_id().alias("_at"),  # rises by one from a row to the next in a split
            )
        frames.append(df)
    df = frames[0]
    for extra in frames[1:]:
        df = df.unionByName(extra, allowMissingColumns=True)
    if fmt != "parquet":
        splits = df.groupBy("_file", "_split").agg(F.count(F.lit(1)).alias("n"), F.min("_at").alias("first"))
        starts, before = [], 0
        for s in sorted(splits.collect(), key=lambda s: (s["_file"], s["_split"])):
            starts.append((s["_file"], s["_split"], before - s["first"]))
            before += s["n"]
        offsets = spark.createDataFrame(starts, "_file int, _split long, _start long")
        df = df.join(F.broadcast(offsets), ["_file", "_split"]).withColumn("_row", F.col("_at") + F.col("_start"))
        df = df.drop("_file", "_split", "_at", "_start")
        columns = {c: csv_column(F.col(c), t, declared.formats, f"streams.{name}") for c, t in declared.types.items()}
        df = df.withColumn("_time", columns.get(spec.time, F.col(spec.time)))
        df = df.withColumn("_us", stream_micros(df, "_time", spec.time_unit)).drop("_time")
        df = df.withColumns(columns) if typed else df
    return df.withColumn("_id", F.col(spec.id).cast("long") if spec.id else F.col("_row")), fmt
