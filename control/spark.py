"""The Spark session of the control jobs and the command-line options they share.

Spark runs embedded (`local[*]`) unless a master URL is given; under `spark-submit` the submitter's master
wins.  Shuffles use few partitions (the control data is small: partial views, a replay selection), the UI
is off and the driver binds to 127.0.0.1 in local mode, so nothing listens beyond this host.
"""

from __future__ import annotations

import argparse
import os
from decimal import Decimal
import sys
from typing import Any

from protocol.config import load_config

LOCAL = "local[*]"


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


def config(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    return load_config(args.config, args.set)


def session(master: str | None = None, app: str = "streamjoin", settings: dict[str, str] | None = None):
    """A Spark session with quiet logging and small shuffles; `settings` add or override Spark settings."""
    from pyspark.sql import SparkSession

    submitted = "PYSPARK_GATEWAY_PORT" in os.environ  # spark-submit started the JVM and chose the master
    master = master or (None if submitted else LOCAL)
    b = SparkSession.builder.appName(app)
    b = b.config("spark.sql.shuffle.partitions", "4").config("spark.ui.enabled", "false")
    b = b.config("spark.sql.session.timeZone", "UTC").config("spark.pyspark.python", sys.executable)
    b = b.config("spark.ui.showConsoleProgress", "false")
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


#: a declared stream's time column read by Spark: a number in the stream's time_unit, else a timestamp (a
#: timestamp column, or ISO-8601 text with or without its zone; none is UTC, as docs/time.md says)
UNIT_MICROS = {"s": 1_000_000, "ms": 1_000, "us": 1, "ns": 0.001}


def stream_micros(df, column: str, unit: str):
    """The event time of a declared stream's rows in integer microseconds as Spark reads it (null: none)."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import NumericType, StringType

    kind = df.schema[column].dataType
    number = F.col(column).try_cast("decimal(38,9)") if isinstance(kind, (StringType, NumericType)) else None
    stamp = F.unix_micros(F.col(column).cast("timestamp"))
    scaled = (number * F.lit(Decimal(repr(UNIT_MICROS[unit])))).cast("decimal(38,0)").cast("long")
    return stamp if number is None else F.coalesce(scaled, stamp)


def stream_rows(spark, name: str, spec: dict):
    """A declared stream's rows from its files (common.stream_file.stream_files), each file one partition read
    in order, with `_file` and `_row` (its place in the stream's order), and the files' format (csv, parquet,
    json); CSV cells stay text."""
    from pyspark.sql import functions as F

    from common.chunks import InputError
    from common.stream_file import stream_files

    files = stream_files(name, spec["path"])
    formats = {".csv": "csv", ".parquet": "parquet", ".pq": "parquet"}
    fmt = formats.get(files[0].suffix.lower(), "json")
    if any(formats.get(f.suffix.lower(), "json") != fmt for f in files):
        raise InputError(f"streams.{name}.path: its files mix formats; this reads one format per stream")
    frames = []
    for i, f in enumerate(files):
        read = spark.read.option("header", True).csv if fmt == "csv" else getattr(spark.read, fmt)
        df = read(str(f)).coalesce(1)
        frames.append(df.withColumn("_file", F.lit(i)).withColumn("_row", F.monotonically_increasing_id()))
    df = frames[0]
    for extra in frames[1:]:
        df = df.unionByName(extra, allowMissingColumns=True)
    return df, fmt
