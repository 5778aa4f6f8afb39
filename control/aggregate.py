"""`python -m control.aggregate [--config F] [--set K=V] [--until-idle N] [--batch]`: phase two of the
two-phase aggregation (BiStream, paper 001 section 3.4.2), the merger.

Streaming (default): a Spark Structured Streaming job reads the slaves' partial files in
`<output.path>/aggregates/` as a file stream, merges them per group and window into the global view
(`[aggregate]`'s measures over the result columns: protocol.aggregation) and writes every new snapshot of the
view as `<view>/view-BBBBBBBBBB.parquet`
(B = Spark's batch id), atomically.  Exactly once across restarts: Spark logs which files make up batch B
before running it and keeps the merged state per batch under `--checkpoint-location`; a batch that was cut
short is re-run after a restart with the same files on the state of batch B-1, and its snapshot is written
under the same name, so it replaces rather than adds.  Slaves write partial files whole (temporary dot-name,
then rename), and Spark's file source ignores names starting with `.` or `_`.

Batch (`--batch`): the same view straight from a finished run's full result files (`results/`), with the
grouping of the config's `[aggregate]` section; for comparison, and for runs made without partials.  It cuts
windows as phase one does, in integer microseconds (protocol.eventtime), and Spark's min / max order NaN
above every number, as phase one's do (slave/aggregate.py).
Also runnable as `spark-submit control/aggregate.py ...`.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file (spark-submit control/aggregate.py): make the project importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from protocol import eventtime
from protocol.aggregation import (
    COUNT,
    FILE,
    FILES,
    FINAL,
    KIND,
    RANK,
    SLAVES,
    STAMP,
    WATERMARK,
    WINDOW_END,
    WINDOW_START,
    Aggregation,
)
from protocol.config import ConfigError
from protocol.output import result_schema, write_table
from protocol.lifetime import invocation

#: snapshots of the view kept besides the newest, so a reader that just listed the folder can still open its file
KEEP = 2


def spark_schema(schema: pa.Schema):
    """The Spark schema of an Arrow schema of int64 / float64 / string columns."""
    from pyspark.sql import types as T

    kinds = {pa.int64(): T.LongType(), pa.float64(): T.DoubleType(), pa.string(): T.StringType()}
    return T.StructType([T.StructField(f.name, kinds[f.type]) for f in schema])


NEWEST = "__newest"  #: a slave's newest stamp in the merger's state


def merge(df, spec: Aggregation):
    """Partials -> view of `spec`'s groups and measures: counts and sums add up, min of mins, max of maxes, avg =
    sum / count of values."""
    from pyspark.sql import functions as F

    how = {"sum": F.sum, "count": F.sum, "min": F.min, "max": F.max}
    how["distinct"] = lambda c: F.array_distinct(F.flatten(F.collect_list(c)))
    # per slave (RANK): its newest file's watermark (it drops when a group moves in) and its run's slave count
    newest = F.max_by(F.struct(WATERMARK, SLAVES), FILE)
    g = df.groupBy(*spec.keys, RANK).agg(
        F.sum(COUNT).alias(COUNT),
        *(how[fn](name).alias(name) for name, fn, _ in spec.parts),
        F.max(FILE).alias(FILE),
        F.sum(FILES).alias(FILES),
        newest.alias(NEWEST),
    )
    shape = {
        "avg": lambda c: F.col(f"sum_{c}") / F.col(f"nn_{c}"),
        "count_distinct": lambda c: F.size(F.col(f"distinct_{c}")).cast("long"),
    }
    measures = {
        m.name: shape[m.fn](m.column) if m.fn in shape else F.col(m.name) for m in spec.measures if m.fn != "count"
    }
    newest = (F.col(NEWEST)[c].alias(c) for c in (WATERMARK, SLAVES))
    return g.select(*spec.keys, COUNT, *(c.alias(n) for n, c in measures.items()), RANK, FILE, FILES, *newest)


def result_files(results: Path) -> list[Path]:
    """The result files (Parquet or CSV) of a finished run; a clear error when there are none."""
    files = sorted(p for p in results.glob("*") if p.suffix in (".parquet", ".csv")) if results.is_dir() else []
    if not files:
        raise ConfigError(f"no result files (*.parquet, *.csv) in {str(results)!r}: run the cluster first")
    return files


def from_results(spark, files: list[Path], spec: Aggregation):
    """The view computed directly from result files with the `[aggregate]` grouping: Parquet, or the single
    file's CSV (its columns' types are known; declared streams' CSV is refused: `main`)."""
    csv = [str(p) for p in files if p.suffix == ".csv"]
    if csv:
        schema = spark_schema(result_schema("inner" if KIND not in spec.groups else "outer"))  # kind: not inner
        df = spark.read.csv(csv, header=True, schema=schema)
    else:
        df = spark.read.parquet(*(str(p) for p in files))
    return view_of(df, spec)


def view_of(df, spec: Aggregation):
    """The view of result rows (a DataFrame in the result files' columns), as --batch computes it."""
    return merge(rows_as_partials(df, spec), spec)


def micros(df, column: str):
    """A time column in microseconds: a timestamp, or float64 seconds as the single file's results hold them
    (rounded back to the microseconds they were made from, as phase one does: slave.aggregate.micros)."""
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    if isinstance(df.schema[column].dataType, T.DoubleType):
        return F.round(F.col(column) * float(eventtime.PER_SECOND)).cast("long")
    return F.unix_micros(F.col(column))


def rows_as_partials(df, spec: Aggregation):
    """Result rows as partials of one row each, in the types phase one writes: each row in every window that
    holds its time (pair: the later of its not-null times), cut in integer microseconds."""
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    cols = [F.col(g) for g in spec.groups]
    if spec.window:
        times = [micros(df, c) for c in spec.times]
        t = F.greatest(*times) if len(times) > 1 else times[0]
        latest = t - F.pmod(t, F.lit(spec.slide))
        n = -(-spec.window // spec.slide)
        starts = F.filter(
            F.sequence(latest - F.lit((n - 1) * spec.slide), latest, F.lit(spec.slide)),
            lambda s: s > t - F.lit(spec.window),
        )
        cols.append(F.explode_outer(starts).alias(WINDOW_START))
    cols.append(F.lit(1).cast("long").alias(COUNT))
    cols += [F.lit(None).cast("long").alias(c) for c in STAMP]  # rows, no stamps
    for name, fn, col in spec.parts:
        kind = df.schema[col].dataType
        if fn == "count":
            cols.append(F.col(col).isNotNull().cast("long").alias(name))
        elif fn == "distinct":
            cols.append(
                F.when(F.col(col).isNotNull(), F.array(col)).otherwise(F.array().cast(T.ArrayType(kind))).alias(name)
            )
        elif fn == "sum":  # as pyarrow sums: decimals to 38 digits, integers in int64, floats in float64
            wide = T.DecimalType(38, kind.scale) if isinstance(kind, T.DecimalType) else None
            wide = wide or (T.DoubleType() if isinstance(kind, (T.FloatType, T.DoubleType)) else T.LongType())
            cols.append(F.col(col).cast(wide).alias(name))
        else:
            cols.append(F.col(col).alias(name))
    return df.select(*cols)


def watermark_of(stamps: pa.Table) -> int:
    """The lowest of the slaves' newest watermarks, from the stamps merged so far (a row per slave); NEG_INF unless
    every slave of the newest run has stamped and none has a file numbered below its newest that is not merged yet.

    A slave's stamp counts the slaves of the run that wrote its newest file.  A recovery on fewer slaves leaves
    the ranks it no longer has with stamps of the run before, which counted more: they are not the newest run's
    and their watermarks, which never rise again, are left out (a rank of the newest run that has not written
    yet also still counts more, and the view waits for it)."""
    if not stamps.num_rows:
        return eventtime.NEG_INF
    slaves = pc.min(stamps[SLAVES]).as_py()
    stamps = stamps.filter(pc.equal(stamps[SLAVES], slaves))
    files, newest = stamps[FILES].to_numpy(), stamps[FILE].to_numpy()
    if stamps.num_rows != slaves or (files != newest + 1).any():
        return eventtime.NEG_INF
    return pc.min(stamps[WATERMARK]).as_py()


def final_view(t: pa.Table, spec: Aggregation, watermark: int | None) -> pa.Table:
    """The view of merged partials (declared streams): window starts as timestamps and window ends beside,
    the slaves' stamps taken out and `final` added: true where the lowest slave watermark (`watermark`, None:
    the stamps') is past the window's end by `spec.reach`, or the run has ended."""
    is_stamp = pc.is_valid(t[RANK])
    watermark = watermark_of(t.filter(is_stamp)) if watermark is None else watermark
    t = t.filter(pc.invert(is_stamp)).drop_columns([*STAMP])
    ended = pa.scalar(watermark >= eventtime.POS_INF)
    final = pa.array(np.full(t.num_rows, ended.as_py()))
    if spec.window:
        start = t[WINDOW_START].cast(pa.int64())
        at = t.column_names.index(WINDOW_START)
        end = pc.add(start, spec.window)
        if spec.reach is not None:
            final = pc.fill_null(pc.less_equal(pc.add(end, spec.reach), watermark), ended)
        t = t.set_column(at, WINDOW_START, start.cast(pa.timestamp("us", "UTC")))
        t = t.add_column(at + 1, WINDOW_END, end.cast(pa.timestamp("us", "UTC")))
    return t.append_column(FINAL, final)


def snapshot(df, spec: Aggregation, watermark: int | None) -> pa.Table:
    """The view (a merged DataFrame) as one sorted table with `final` (final_view)."""
    t = df.toArrow()
    t = t.sort_by([(c, "ascending") for c in spec.keys]) if t.num_rows and spec.keys else t  # keys: one group
    return final_view(t, spec, watermark)


class ViewWriter:
    """foreachBatch sink: the batch's whole view (complete mode) as one file named after the batch id."""

    def __init__(
        self, directory: Path, spec: Aggregation, quiet: bool = False, ended: bool = False, keep: int | None = None
    ):
        """`spec`: the view's (protocol.aggregation), `ended`: of a run that has ended (every window final:
        `--batch`), `keep`: snapshots kept besides the newest (None: KEEP)."""
        self.directory, self.quiet, self.spec = directory, quiet, spec
        self.keep = KEEP if keep is None else keep
        self.watermark = eventtime.POS_INF if ended else None
        self.batches = 0
        self.last = time.monotonic()  #: when the last batch ended (for --until-idle)

    def __call__(self, df, batch_id: int) -> None:
        t = snapshot(df, self.spec, self.watermark)
        write_table(self.directory, f"view-{batch_id:010d}", t, "parquet")
        for old in sorted(self.directory.glob("view-*.parquet"))[: -(self.keep + 1)]:
            old.unlink(missing_ok=True)
        self.batches += 1
        self.last = time.monotonic()
        if not self.quiet:
            print(f"[view] batch {batch_id}: {t.num_rows:,} groups, {view_results(t, self.spec)}", flush=True)


def view_results(t: pa.Table, spec: Aggregation) -> str:
    """The results a view counts, as its report line says them: with hopping windows a result is in several, so
    only the windows that tile time (those starting at a multiple of the window's length, and rows without a
    time) are added up; when the slide does not divide the window the sum is of window memberships, and says so."""
    counts = t["count"].to_numpy(zero_copy_only=False) if t.num_rows else np.zeros(0, np.int64)
    if spec.window and spec.slide < spec.window and t.num_rows:
        if spec.window % spec.slide:
            return f"{int(counts.sum()):,} window memberships (hopping windows: a result is in several)"
        starts = t[WINDOW_START]
        null = pc.is_null(starts).to_numpy(zero_copy_only=False)
        micros = pc.fill_null(starts.cast(pa.timestamp("us")).cast(pa.int64()), 0).to_numpy()
        counts = counts[null | (micros % spec.window == 0)]
    return f"{int(counts.sum()):,} results"


def read_view(directory: str | Path) -> pa.Table | None:
    """The newest snapshot of a view folder (None if there is none yet)."""
    snaps = sorted(Path(directory).glob("view-*.parquet"))
    return pq.read_table(snaps[-1]) if snaps else None


def run_stream(
    spark,
    source: Path,
    view: Path,
    checkpoint: Path,
    until_idle: float = 0.0,
    max_files: int = 64,
    trigger: float = 1.0,
    quiet: bool = False,
    *,
    spec: Aggregation,
    keep: int | None = None,
    stop: threading.Event | None = None,
) -> ViewWriter:
    """Merge partial files of `spec`'s view as they appear; returns after `until_idle` seconds without a batch
    (0 = never), or once `stop` is set (between two of Spark's calls: a signal that raised inside one leaves py4j's
    connection half read).  The partials' schema, whose group columns have the results' own types, is the first
    partial file's (the merger waits for it)."""
    stop = stop or threading.Event()
    from pyspark.sql.pandas.types import from_arrow_schema

    source.mkdir(parents=True, exist_ok=True)  # the file source wants the folder; slaves may start later
    writer = ViewWriter(view, spec, quiet, keep=keep)
    first = first_partial(source, until_idle, stop)
    if first is None:
        return writer
    stream = (
        spark.readStream.schema(from_arrow_schema(pq.read_schema(first)))
        .option("maxFilesPerTrigger", max_files)
        .parquet(str(source))
    )
    query = (
        merge(stream, spec)
        .writeStream.outputMode("complete")
        .foreachBatch(writer)
        .option("checkpointLocation", str(checkpoint))
        .trigger(processingTime=f"{trigger} seconds")
        .queryName(f"aggregate-{int(time.time() * 1000)}")
        .start()
    )
    try:
        while until_idle <= 0 and not stop.is_set() and not query.awaitTermination(1.0):
            pass
        while until_idle > 0 and not stop.is_set():
            query.processAllAvailable()  # every file present now is merged and committed (or the query failed)
            if time.monotonic() - writer.last >= until_idle:
                break
            time.sleep(min(trigger, until_idle))
    finally:
        query.stop()
    return writer


def first_partial(source: Path, until_idle: float, stop: threading.Event) -> Path | None:
    """The first partial file in `source`, once there is one; None after `until_idle` seconds without (0 =
    wait until there is) or once `stop` is set."""
    started = time.monotonic()
    while not (files := sorted(source.glob("slave-*.parquet"))):
        if (until_idle and time.monotonic() - started >= until_idle) or stop.is_set():
            return None
        time.sleep(0.2)
    return files[0]


def main(argv: list[str], spark=None) -> int:
    p = argparse.ArgumentParser(prog=invocation("control.aggregate"), description=__doc__.split("\n")[0])
    from control.spark import add_arguments, config, session

    add_arguments(p)
    p.add_argument("--out", help="the cluster's output folder (default: output.path of the config)")
    p.add_argument("--view", help="folder of the view's snapshots (default <out>/view, <out>/view-batch with --batch)")
    p.add_argument("--checkpoint-location", help="Spark checkpoint of this job (default <out>/aggregate-checkpoint)")
    p.add_argument("--batch", action="store_true", help="aggregate <out>/results/ once instead of streaming")
    p.add_argument(
        "--until-idle",
        type=float,
        default=0.0,
        metavar="N",
        help="stop after N seconds without new partial files (default 0: run until Ctrl-C)",
    )
    p.add_argument("--max-files-per-trigger", type=int, default=64, help="partial files per micro-batch (default 64)")
    p.add_argument("--trigger", type=float, default=1.0, help="seconds between micro-batches (default 1)")
    a = p.parse_args(argv)
    try:
        plan = config(a)
        if a.max_files_per_trigger < 1 or a.trigger <= 0 or a.until_idle < 0:
            raise ConfigError("--max-files-per-trigger must be >= 1, --trigger > 0 and --until-idle >= 0")
        out = Path(a.out or plan.output.path)
        files = result_files(out / "results") if a.batch else []
        spec = plan.aggregate.view
        if plan.streams and any(p.suffix == ".csv" for p in files):
            raise ConfigError(
                "--batch with [streams.*] reads Parquet results: CSV results lose the columns' types "
                '(run with output.format = "parquet")'
            )
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    view = Path(a.view or out / ("view-batch" if a.batch else "view"))
    spark = spark or session(a.spark_master, "streamjoin-aggregate")
    started = time.monotonic()
    if a.batch:
        ViewWriter(view, spec, ended=True)(from_results(spark, files, spec), 0)
    else:
        checkpoint = Path(a.checkpoint_location or out / "aggregate-checkpoint")
        print(
            f"merging partial aggregates from {out / 'aggregates'} into {view} (checkpoint {checkpoint}); "
            + (f"stops after {a.until_idle:g}s without new files" if a.until_idle else "Ctrl-C stops"),
            flush=True,
        )
        stop = threading.Event()

        def interrupted(signum, frame):  # the first Ctrl-C or SIGTERM stops between two calls to Spark
            if stop.is_set():
                raise KeyboardInterrupt
            stop.set()

        handlers = {s: signal.signal(s, interrupted) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            run_stream(
                spark,
                out / "aggregates",
                view,
                checkpoint,
                a.until_idle,
                a.max_files_per_trigger,
                a.trigger,
                spec=spec,
                stop=stop,
            )
        finally:
            for s, h in handlers.items():
                signal.signal(s, h)
        if stop.is_set():
            print("interrupted: stopped; a restart with the same checkpoint goes on where this left off", flush=True)
    t = read_view(view)
    if t is None:
        waiting = len(list((out / "aggregates").glob("slave-*.parquet"))) if not a.batch else 0
        why = f"stopped before a first batch ended; {waiting:,} partial files wait" if waiting else "no partial files"
        print(f"done in {time.monotonic() - started:.1f}s: no view yet ({why})", flush=True)
    else:
        print(
            f"done in {time.monotonic() - started:.1f}s: view of {t.num_rows:,} groups, {view_results(t, spec)}, "
            f"in {view}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
