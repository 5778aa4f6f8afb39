"""The Spark session of the control jobs and the command-line options they share.

Spark runs embedded (`local[*]`) unless a master URL is given; under `spark-submit` the submitter's master
wins.  Shuffles use few partitions (the control data is small: partial views, a replay selection), the UI
is off and the driver binds to 127.0.0.1 in local mode, so nothing listens beyond this host.
"""

from __future__ import annotations

import argparse
import os
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
