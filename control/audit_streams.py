"""The audit's view of a run of two declared streams (`[streams.*]` of files): the streams' own rows as the
audit's tuples, and the run's result and late files, which carry the streams' own columns, as its pairs and
tuples (control.audit reads both the same way from there on).

Nothing of the engine's reading is used: Spark reads each stream's files in their order (control.spark.
stream_rows), converts its time column itself (control.spark.stream_micros: a number in the stream's
time_unit, a timestamp, or ISO-8601 text) and gives each key value (one column or several, as text) a code
of its own by its rank among all key values of both streams, so equal keys join.  The arrival order is the
engine's contract (docs/input.md, "Two streams"): the two streams merged by each row's stream watermark (its
stream's largest time so far minus the stream's max_delay; ties R first, then row order), dispatcher i of k
taking every k-th row of that order from the i-th, and a row late iff its time is below the largest time
before it of its own stream in its dispatcher's share minus its stream's max_delay.  Each row is named as the
results name it: by its stream's id column, or without one by its stream row (`row`: control.spark.stream_rows
counts it as the engine does).

Audited: finished runs of streams of files without rejected rows; a live run (from its checkpoints), sampling,
runs with rejected rows and streams from Kafka or live producers are refused with the reason (control.audit's
exit code for "could not audit").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pathlib import Path

if TYPE_CHECKING:
    from protocol.plan import Plan, Stream


SIDES = ("R", "S")


class Refused(Exception):
    """A run of declared streams the audit cannot check yet; the message says why."""


def check_auditable(plan: Plan, sample: float, follow: bool) -> None:
    """Refused unless the run is one this module audits (the module's docstring)."""
    streams, out = plan.streams, plan.output.path
    reasons = [
        (follow or not (out / "summary.json").is_file(), "a live run of declared streams (audited once it has ended)"),
        (sample < 1, "--sample with declared streams"),
        (any(not s.path for s in streams), "a stream read from Kafka or live producers"),
        (plan.join.predicate != "equal", "a band or less join of declared streams"),
        (any((out / "rejected").glob("*.*")), "a run with rejected rows"),
    ]
    for refused, what in reasons:
        if refused:
            raise Refused(f"not audited yet: {what}")


def _key(df, columns: list[str]):
    """A stream's key as one text value (several columns: joined with a separator no text cell holds)."""
    from pyspark.sql import functions as F

    parts = [F.coalesce(F.col(c).cast("string"), F.lit("\u0000null")) for c in columns]
    return parts[0] if len(parts) == 1 else F.concat_ws("\u0001", *parts)


def arrivals(spark, target):
    """(DataFrame of d, f, row, stream, id, ts, t, key, value, delay; the key codes: key text -> code; what was
    read; the DataFrame cached: the caller unpersists it).  d numbers each dispatcher's share of each stream
    (dispatcher * 2 + side): the lateness rule runs within it, with its stream's max_delay (`delay`,
    microseconds)."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    from control.audit_query import ingest_filter
    from control.spark import stream_rows

    k = target.plan.cluster.dispatchers
    sides = []
    for side, spec in zip(SIDES, target.plan.streams):
        df, _ = target.rows[spec.name] = stream_rows(spark, spec.name, spec)  # read once: the payload check reuses them
        df = ingest_filter(target.plan.query, SIDES.index(side), df, spec)  # a row it drops never reaches the merge
        delay = spec.max_delay
        sides.append(
            df.select(
                F.lit(side).alias("stream"),
                F.col("_row").alias("row0"),
                F.col("_id").alias("id"),
                F.col("_us").alias("t"),
                _key(df, spec.key).alias("key_text"),
                F.lit(delay).alias("delay"),
            ).withColumn(
                "watermark",
                F.max("t").over(Window.orderBy("row0").rowsBetween(Window.unboundedPreceding, 0)) - F.col("delay"),
            )
        )
    both = sides[0].unionByName(sides[1])
    codes = (
        both.select("key_text")
        .distinct()
        .withColumn("key", F.dense_rank().over(Window.orderBy("key_text")).cast("long"))
        .cache()
    )
    merged = both.join(codes, "key_text").withColumn(
        "pos", F.row_number().over(Window.orderBy("watermark", "stream", "row0")) - 1
    )
    side = F.when(F.col("stream") == "R", 0).otherwise(1)
    df = merged.select(
        (F.pmod("pos", F.lit(k)) * 2 + side).cast("int").alias("d"),
        F.lit(0).cast("long").alias("f"),
        F.expr(f"pos div {k}").alias("row"),
        "stream",
        "id",
        (F.col("t") / 1e6).alias("ts"),
        "t",
        "key",
        F.lit(0.0).alias("value"),
        "delay",
    )
    names = ", ".join(f"streams.{s.name} ({s.path})" for s in target.plan.streams)
    # computed once: the merge's windows put a stream in one order (one task each), and the lateness rule reads
    # the merge twice; a leaf of the plans that read it (control.audit.kept)
    df = df.localCheckpoint(eager=True)
    return df, codes, f"the declared streams' files: {names}"


def named_by(spec: Stream) -> str:
    """The column that names a stream's rows in result and late files: its id column, or without one `row`,
    the stream row (common.stream_file)."""
    return spec.id or "row"


def _columns(df, spec: Stream) -> tuple:
    """A stream's id, time (float seconds, as the audit reads every file's times) and key text in result or
    late rows (its columns under the stream's prefix)."""
    from pyspark.sql import functions as F

    from control.spark import stream_micros

    own = lambda c: f"{spec.prefix}{c}"  # noqa: E731
    return (
        F.col(own(named_by(spec))).cast("long"),
        stream_micros(df, own(spec.time), spec.time_unit) / 1e6,
        _key(df, [own(c) for c in spec.key]),
    )


def read_output(spark, files: list[Path]):
    """The output files (Parquet or CSV) as one DataFrame with their own columns; None if there are none."""
    parquet = [str(f) for f in files if f.suffix == ".parquet"]
    csv = [str(f) for f in files if f.suffix == ".csv"]
    frames = ([spark.read.parquet(*parquet)] if parquet else []) + (
        [spark.read.option("header", True).csv(csv)] if csv else []
    )
    if not frames:
        return None
    return frames[0] if len(frames) == 1 else frames[0].unionByName(frames[1], allowMissingColumns=True)


def coded(df, codes, text: str, key: str):
    """`df` with the code of its key text column `text` as `key` (null: a missing side's)."""
    return df.join(codes.withColumnRenamed("key_text", text).withColumnRenamed("key", key), text, "left").drop(text)


def results(spark, plan: Plan, files: list[Path], codes, schema: str, matched: str):
    """The result files as the audit's pairs (r_id, s_id, r_key, s_key, r_ts, s_ts, r_value, s_value[, kind])."""
    from pyspark.sql import functions as F

    df = read_output(spark, files)
    if df is None:
        return spark.createDataFrame([], schema)
    (r, s) = plan.streams
    kind = [F.col("kind")] if "kind" in schema else []
    named = lambda cols, side: [c.alias(f"{side}_{n}") for c, n in zip(cols, ("id", "ts", "text"))]  # noqa: E731
    df = df.select(*named(_columns(df, r), "r"), *named(_columns(df, s), "s"), *kind)
    df = coded(coded(df, codes, "r_text", "r_key"), codes, "s_text", "s_key")
    return df.select(
        "r_id",
        "s_id",
        "r_key",
        "s_key",
        "r_ts",
        "s_ts",
        F.lit(0.0).alias("r_value"),
        F.lit(0.0).alias("s_value"),
        *kind,
    )


def late(spark, plan: Plan, files: list[Path], codes, schema: str):
    """The late files as the audit's tuples (stream, id, ts, key, value, reason, bound)."""
    from pyspark.sql import functions as F

    df = read_output(spark, files)
    if df is None:
        return spark.createDataFrame([], schema)
    (r, s) = plan.streams
    is_r = F.col("stream") == r.name
    mine = [
        F.when(is_r, a).otherwise(b).alias(name)
        for a, b, name in zip(_columns(df, r), _columns(df, s), ("id", "ts", "text"))
    ]
    df = df.select(F.when(is_r, "R").otherwise("S").alias("stream"), *mine, "reason", "bound")
    return coded(df, codes, "text", "key").select(
        "stream", "id", "ts", "key", F.lit(0.0).alias("value"), "reason", F.col("bound").cast("double")
    )


def payload_faults(spark, plan: Plan, files: list[Path], streams: dict):
    """Result rows whose own columns are not their input row's: per stream, every column of it the results
    carry (under its prefix), compared with the stream's row of the same id in its files (`streams`: each
    stream's stream_rows, as arrivals read them; cast to the
    result column's type; the time column by its microseconds).  Rows of r_id, s_id, r_ts, s_ts (seconds, to
    place them in a range), kind, problem "payload" and the reason naming the stream, the column and both
    values."""
    from pyspark.sql import functions as F

    from control.spark import stream_micros

    found = read_output(spark, files)
    if found is None:
        return None
    (r, s) = plan.streams
    ids = [
        c.alias(f"{side}_{n}")
        for side, spec in (("r", r), ("s", s))
        for c, n in zip(_columns(found, spec)[:2], ("id", "ts"))
    ]
    kind = [F.col("kind")] if "kind" in found.columns else [F.lit("matched").alias("kind")]
    faults = None
    for spec, side in zip(plan.streams, ("r", "s")):
        rows, _ = streams[spec.name]
        carried = [c for c in rows.columns if f"{spec.prefix}{c}" in found.columns and not c.startswith("_")]
        mine = found.where(F.col(f"{spec.prefix}{named_by(spec)}").isNotNull()).select(
            *ids, *kind, *(F.col(f"{spec.prefix}{c}").alias(f"_got_{c}") for c in carried)
        )
        given = rows.select(
            F.col("_id").alias(f"{side}_id"),
            *((F.col("_us") if c == spec.time else F.col(c)).alias(f"_want_{c}") for c in carried),
        )
        pairs = mine.join(given, f"{side}_id", "left")
        checks = []  # every column's comparison in one pass over the join, not a join per column
        for c in carried:
            got = stream_micros(pairs, f"_got_{c}", spec.time_unit) if c == spec.time else F.col(f"_got_{c}")
            want = (
                F.col(f"_want_{c}")
                if c == spec.time
                else F.col(f"_want_{c}").cast(found.schema[f"{spec.prefix}{c}"].dataType)
            )
            reason = F.concat(
                F.lit(f"{spec.name}.{c} is "), got.cast("string"), F.lit(" where its row has "), want.cast("string")
            )
            checks.append(F.struct((~got.eqNullSafe(want)).alias("bad"), reason.alias("reason")))
        bad = (
            pairs.select("r_id", "s_id", "r_ts", "s_ts", "kind", F.explode(F.array(*checks)).alias("check"))
            .where("check.bad")
            .select("r_id", "s_id", "r_ts", "s_ts", "kind", F.lit("payload").alias("problem"), "check.reason")
        )
        faults = bad if faults is None else faults.unionByName(bad)
    return faults


def result_rows(plan: Plan, ids, schema, streams: dict):
    """Result rows rebuilt from the input: `ids` (r_id, s_id, kind; a missing side's id null) with each stream's
    row of that id in its files (`streams`: as for payload_faults), under its prefix, cast to the types the
    result files have (`schema`, Arrow; the time column by its microseconds), so that the --batch aggregation
    of control.aggregate reads them as it reads the run's results."""
    import pyarrow as pa
    from pyspark.sql import functions as F
    from pyspark.sql.pandas.types import from_arrow_type

    rows = ids
    for spec, side in zip(plan.streams, ("r", "s")):
        df, _ = streams[spec.name]
        cols = []
        for c in (c for c in df.columns if f"{spec.prefix}{c}" in schema.names and not c.startswith("_")):
            kind = schema.field(f"{spec.prefix}{c}").type
            timed = c == spec.time and str(kind).startswith("timestamp")
            if timed:
                col = F.timestamp_micros(F.col("_us")).cast(from_arrow_type(kind))
            elif pa.types.is_timestamp(kind) and kind.unit == "ns":  # read as its nanoseconds, in both
                col = F.col(c)
            else:
                col = F.col(c).cast(from_arrow_type(kind))
            cols.append(col.alias(f"{spec.prefix}{c}"))
        own = df.select(F.col("_id").alias(f"{side}_id"), *cols)
        rows = rows.join(own, f"{side}_id", "left")
    return rows.drop("r_id", "s_id")
