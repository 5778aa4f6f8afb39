"""`python -m control.audit --config run.toml [--from T] [--to T] [--sample F] [--follow]`: recompute a time
range of the join with Spark SQL and diff it with the cluster's result files.

The engine promises every pair once, produced with its later tuple (paper 003, IV-D; BiStream, section 3.5
after a recovery); the tests check it against reference joins on their inputs, this checks it on a real
run.  Spark reads the input in arrival order -- the input archive `archive/` (written when checkpoints are
on: checkpoint.interval > 0 and checkpoint.archive), or without one the input the config names (the file of
source.kind = "file", or the generator's streams rebuilt on the driver) -- and recomputes, in Spark SQL and
without any code of master/ or slave/:

- lateness, per dispatcher (each applies the rule to its own share): a tuple is late iff its ts is below
  the largest ts before it in that dispatcher's arrival order minus join.max_delay;
- the join of the on-time tuples: r.key == s.key (equal), |r.key - s.key| <= band (band) or r.key < s.key
  (less), and lower <= s.ts - r.ts <= upper (join.lower / join.upper, or -+join.window), for every pair
  whose later ts lies in [from, to) (so only the input with ts >= from - reach is joined, reach the largest
  |s.ts - r.ts| that joins);
- with join.type other than inner (docs/joins-and-hot-keys.md), the rows without a partner whose own ts lies
  in [from, to): the on-time tuples no tuple of the other stream joins (left, right, full, anti), or the R
  tuples some S tuple joins (semi), from the input up to to + reach;

every time compared as the engine compares it, in integer microseconds (docs/time.md): the files' float
seconds are converted back in SQL (`micros`), the bounds, max_delay and the range's ends once from their
decimals (protocol.plan's bounds and protocol.eventtime.duration, the config's conversion), so a
pair exactly at lower or upper is expected and one a microsecond outside is not;

and compares them with results/ and late/ over the same range: pairs missing, extra, twice, the same for
the rows alone of each kind; tuples set aside as late that are not, and the reverse.  A finished run
(summary.json) counts every file; a live or crashed one only what its newest complete checkpoint committed
(the files past the commit are replaced by a restarted run: protocol.checkpoint.roll_back_output), and only
below that checkpoint's watermark (for rows alone: below the slaves' watermark minus reach, where R rows
(final below it minus upper) and S rows (below it plus lower) are both final).
A run of declared streams is read from the streams' own files, and its rows' own columns are checked too
(control.audit_streams).  Also runnable as `spark-submit control/audit.py ...`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import shutil
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from pathlib import Path

if __package__ in (None, ""):  # run as a file (spark-submit control/audit.py): make the project importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from common.chunks import InputError
from control import audit_query, audit_streams, audit_view
from control.audit_metrics import DEFAULT_ENDPOINT, PAIR_OUTCOMES, AuditMetrics
from control.spark import seconds_text
from protocol import checkpoint
from protocol.config import ConfigError
from protocol.eventtime import NEG_INF, PER_SECOND, POS_INF, TS_LIMIT, duration
from protocol.output import LEFT_MATCHED, LEFT_UNMATCHED, MATCHED, RESULT_COLUMNS, RIGHT_UNMATCHED
from protocol.plan import compile_plan
from protocol.lifetime import NOT_AUDITED, invocation

if TYPE_CHECKING:
    from protocol.plan import Join, Plan

#: exit codes: the range is exact, it differs, the command was wrong; NOT_AUDITED (protocol.lifetime): the audit
#: could not check it (a crash, a file it cannot read, a run it does not audit yet)
EXACT, DIFFERENT, USAGE = 0, 1, 2
TUPLE_SCHEMA = "stream string, id long, ts double, key long, value double"
RESULT_SCHEMA = ", ".join(f"{c} {'long' if c.endswith(('_id', '_key')) else 'double'}" for c in RESULT_COLUMNS)
LATE_SCHEMA = TUPLE_SCHEMA + ", reason string, bound double"
PAIR = ["r_id", "s_id", "r_key", "s_key", "r_ts", "s_ts", "r_value", "s_value"]
#: per join.type (docs/joins-and-hot-keys.md): whether it emits pairs, the kind of its R rows alone, of its S
#: rows alone (None: it emits none)
EMITS = {
    "inner": (True, None, None),
    "left": (True, LEFT_UNMATCHED, None),
    "right": (True, None, RIGHT_UNMATCHED),
    "full": (True, LEFT_UNMATCHED, RIGHT_UNMATCHED),
    "semi": (False, LEFT_MATCHED, None),
    "anti": (False, LEFT_UNMATCHED, None),
}
LONE_KINDS = (LEFT_UNMATCHED, RIGHT_UNMATCHED, LEFT_MATCHED)
#: rows per arrival block (of an archive file, or of an input read whole): the unit the lateness prefix is over
BLOCK = 1 << 16
#: the audit's own files while it runs, under <output>/audit (hidden: nothing reads it as output)
SCRATCH = ".scratch"
#: sampling resolution: a key is audited iff its hash modulo this is below sample x this
SAMPLE_SCALE = 1_000_000
#: the table's columns: (heading, report key)
COLUMNS = [
    ("range", "range"),
    ("input tuples", "input_tuples"),
    ("expected pairs", "expected"),
    ("found", "found"),
    ("missing", "missing"),
    ("extra", "extra"),
    ("duplicates", "duplicates"),
    ("late wrong", "late_wrong"),
    ("seconds", "seconds"),
]


class AuditError(Exception):
    """A usage or configuration mistake (exit 2); the message says what and where."""


@dataclass
class Target:
    """What of a run's output counts: everything (finished) or a checkpoint's commit below its watermark (int64
    microseconds, as every time here)."""

    out: Path
    plan: Plan
    finished: bool
    watermark: int = POS_INF
    commit: dict | None = None
    consumed: dict[int, int] = field(default_factory=dict)  #: live: input position of each dispatcher at the cut
    checkpoint_id: int | None = None
    rows_alone: bool = False  #: live, join.type other than inner: the watermark is the bound of rows alone
    codes: Any = None  #: declared streams: each key value's code (control.audit_streams.arrivals)
    rows: dict = field(default_factory=dict)  #: declared streams: each stream's rows (control.spark.stream_rows)

    def scratch(self, name: str) -> Path:
        """A path for a file of the audit's own (the generated input), in `<output>/audit/.scratch`, which
        `clean` removes."""
        folder = self.out / "audit" / SCRATCH
        folder.mkdir(parents=True, exist_ok=True)
        return folder / name

    def clean(self) -> None:
        """After each range: its scratch files and the key codes its declared streams' arrivals computed."""
        shutil.rmtree(self.out / "audit" / SCRATCH, ignore_errors=True)
        if self.codes is not None:
            release(self.codes)
            self.codes = None

    def describe(self) -> str:
        if self.finished:
            return "finished run"
        if self.rows_alone:
            return f"live run, checkpoint {self.checkpoint_id}, rows alone final below {seconds_text(self.watermark)}"
        return f"live run, checkpoint {self.checkpoint_id}, watermark {seconds_text(self.watermark)}"

    def files(self, folder: str) -> list[Path]:
        """The data files of `folder` that count, in name order (hidden temporaries never do)."""
        d = self.out / folder
        if self.commit is None:
            return (
                sorted(f for f in d.iterdir() if f.suffix in (".parquet", ".csv") and not f.name.startswith((".", "_")))
                if d.is_dir()
                else []
            )
        return sorted(
            f
            for prefix, count in self.commit.get(folder, {}).items()
            for number, f in checkpoint.numbered(d, prefix)
            if number < count
        )


def run_state(plan: Plan) -> Target:
    """A finished run (summary.json) or the newest complete checkpoint of a live or crashed one.

    The watermark of a checkpoint is the lowest of each dispatcher's watermark (master.state.lateness.Lateness: a
    tuple arriving later with a smaller ts is late) and of the ts buffered at the master (not joined yet): every
    on-time pair whose later ts is below it was joined before the cut and lies in the committed files."""
    out = plan.output.path
    summary = out / "summary.json"
    if summary.is_file():
        check_same_join(plan, json.loads(summary.read_text()).get("config"), str(summary))
        return Target(out, plan, finished=True)
    for attempt in range(3):  # a running cluster prunes old checkpoints: one may go while it is read
        try:
            return _at_checkpoint(plan, out)
        except (OSError, checkpoint.CheckpointError):
            if attempt == 2:
                raise
            time.sleep(0.5)


def _at_checkpoint(plan: Plan, out: Path) -> Target:
    found = checkpoint.latest_complete(plan.checkpoint.root, log=lambda _: None)
    if found is None:
        raise AuditError(
            f"{out} holds no summary.json (the run has not finished) and no complete checkpoint "
            f"under {plan.checkpoint.root}: nothing is committed yet (a live run is audited "
            "from its checkpoints: checkpoint.interval > 0)"
        )
    directory, manifest = found
    check_same_join(plan, manifest["config"], str(directory / checkpoint.MANIFEST))
    sections = {0: manifest["master"], **{int(d): m for d, m in manifest.get("dispatchers", {}).items()}}
    dtype = compile_plan(manifest["config"]).dtype
    buffered = [
        rows.view(dtype)["ts"]
        for d in sections  # R rows, S rows (then the rows per partition)
        for rows in checkpoint.read_part(directory / checkpoint.master_part(d))[:2]
    ]
    lowest = min((int(ts.min()) for ts in buffered if len(ts)), default=POS_INF)
    watermark = min(min(m["lateness"]["watermark"] for m in sections.values()), lowest)
    rows_alone = plan.join.type != "inner"
    if rows_alone:
        # a row alone is written once the watermark its slave joined by passes its ts + upper (R) or ts - lower
        # (S), both at most ts + reach (the slave's:
        # the lowest of the last batch each dispatcher sent it); its partners must have been joined too
        sent = min(w for m in sections.values() for w in m["sent_watermark"].values())
        watermark = min(watermark, sent) - plan.join.reach
    return Target(
        out,
        plan,
        finished=False,
        watermark=watermark,
        commit=manifest["commit"],
        consumed={d: m["consumed"] for d, m in sections.items()},
        checkpoint_id=manifest["id"],
        rows_alone=rows_alone,
    )


def check_same_join(plan: Plan, then: dict | None, where: str) -> None:
    """The audit must join as the run did: same [join], dispatcher count and query, as written down then and now."""
    if then is None:
        return
    now = plan.document
    for section, keys in (
        ("join", now["join"]),
        ("cluster", {"dispatchers": plan.cluster.dispatchers}),
        ("query", {"sql": now["query"]["sql"]}),
    ):
        for key, value in keys.items():
            if then.get(section, {}).get(key, value) != value:
                raise AuditError(
                    f"{section}.{key} is {value!r} here but the run had "
                    f"{then[section][key]!r} ({where}): audit with the run's config"
                )


def micros(column):
    """Float seconds (the run's files' ts) as int64 microseconds, by the engine's documented rule (docs/time.md),
    in SQL; null if not a valid ts: whole seconds and fraction apart, the fraction's microseconds rounded half to
    even, exact for the float64 of a decimal with up to 6 decimals while |ts| < 2**33 s (the files' ts are such
    floats of microseconds)."""
    from pyspark.sql import functions as F

    s = column.try_cast("double")
    whole = F.floor(F.when(F.abs(s) < F.lit(TS_LIMIT // PER_SECOND), s))  # NaN is above every number in Spark
    return whole * PER_SECOND + F.bround((s - whole) * PER_SECOND).cast("long")


def instant(seconds: float, option: str = "--from") -> int:
    """A --from / --to in microseconds, from its decimals as written (infinite: the sentinels)."""
    if seconds in (-math.inf, math.inf):
        return NEG_INF if seconds < 0 else POS_INF
    if not abs(seconds) < TS_LIMIT / PER_SECOND:
        raise AuditError(f"{option} {seconds:g}: not a valid ts (|ts| < {TS_LIMIT // PER_SECOND} s)")
    return duration(seconds)


def uri(path: Path) -> str:
    """A local path for Spark: file:// so that a cluster whose default file system is HDFS reads the engine's
    files (output.path must then be a folder every executor mounts)."""
    return f"file://{Path(path).resolve()}"


# -- the input in arrival order -------------------------------------------------------------------------------
def arrivals(spark, target: Target):
    """(DataFrame of d, f, row, stream, id, ts, t, key, value; what it was read from).

    d is the dispatcher, (f, row) the tuple's place in its arrival order: archive file number and row in
    it, or 0 and the position in the dispatcher's share of an input read whole; ts the seconds as the run's
    files hold them, t the same in microseconds (what every comparison uses)."""
    from pyspark.sql import functions as F

    if target.plan.source.kind == "streams":
        df, target.codes, what = audit_streams.arrivals(spark, target)
        return df, what
    files = target.files("archive")
    if files:
        name = F.col("_metadata.file_name")
        d = F.regexp_extract(name, r"^input-d(\d+)-", 1)
        df = (
            spark.read.schema(TUPLE_SCHEMA)
            .parquet(*map(uri, files))
            .select(
                F.when(d == "", 0).otherwise(d.cast("int")).alias("d"),
                F.regexp_extract(name, r"-(\d+)\.parquet$", 1).cast("long").alias("f"),
                F.col("_metadata.row_index").alias("row"),
                "stream",
                "id",
                "ts",
                micros(F.col("ts")).alias("t"),
                "key",
                "value",
            )
        )
        return df, f"archive ({len(files)} files)"
    src = target.plan.source
    if src.kind == "zmq":
        raise audit_streams.Refused(
            f'{target.out / "archive"} holds no input archive, and source.kind = "zmq" keeps no other '
            "record of the input: run with checkpoint.interval > 0 and checkpoint.archive = true"
        )
    if src.kind == "file":
        df, what = _input_file(spark, target, Path(src.path))
    else:
        df, what = _generated(spark, target), "generator (rebuilt on the driver: no archive)"
    k = target.plan.cluster.dispatchers
    df = df.select(
        F.pmod("pos", F.lit(k)).cast("int").alias("d"),
        F.expr(f"pos div {k}").alias("row"),
        "stream",
        "id",
        "ts",
        "t",
        "key",
        "value",
    ).withColumn("f", F.lit(0).cast("long"))
    if not target.finished:  # only what the dispatchers had taken by the cut
        df = df.where(
            F.col("row")
            < F.element_at(F.create_map(*[F.lit(x) for d, n in target.consumed.items() for x in (d, n)]), F.col("d"))
        )
    return df, what


def _input_file(spark, target: Target, path: Path):
    """The file source's input: its accepted rows (rejected/ names the others by row) numbered by `pos`."""
    import pyarrow.parquet as pq
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    from control.spark import is_nanos, stream_micros

    if not path.is_file():
        raise InputError(
            f"source.path {str(path)!r} does not exist, and {target.out / 'archive'} holds no input "
            "archive: the audit needs the input in arrival order"
        )
    if path.suffix.lower() == ".csv":
        raw = spark.read.csv(uri(path), header=True).withColumn("_mid", F.monotonically_increasing_id())
        raw = raw.withColumn("row0", F.row_number().over(Window.orderBy("_mid")) - 1)  # one task: no archive
    else:
        raw = spark.read.parquet(uri(path)).withColumn("row0", F.col("_metadata.row_index"))
    unit = target.plan.source.ts_unit
    if path.suffix.lower() != ".csv" and "ts" in raw.columns and is_nanos(pq.read_schema(path).field("ts").type):
        unit = "ns"  # read as its count of nanoseconds (control.spark)
    t = stream_micros(raw, "ts", unit)
    # try_cast: the rejected rows are still there (Spark may cast before the anti-join below drops them)
    cols = [
        F.col("stream").cast("string"),
        F.col("id").try_cast("long"),
        t / 1e6,
        t,
        F.col("key").try_cast("long"),
        F.coalesce(F.col("value").try_cast("double"), F.lit(0.0)) if "value" in raw.columns else F.lit(0.0),
    ]
    df = raw.select("row0", *(c.alias(n) for c, n in zip(cols, ("stream", "id", "ts", "t", "key", "value"))))
    rejected = [
        f for _, f in checkpoint.numbered(target.out / "rejected", "rejected") if f.suffix in (".parquet", ".csv")
    ]
    if not rejected:
        return df.withColumnRenamed("row0", "pos"), f"input file {path} (no archive)"
    rej = None
    for f in rejected:
        part = spark.read.csv(uri(f), header=True) if f.suffix == ".csv" else spark.read.parquet(uri(f))
        part = part.select((F.col("row").cast("long") - 1).alias("row0"))
        rej = part if rej is None else rej.unionByName(part)
    df = df.join(rej, "row0", "left_anti").withColumn("pos", F.row_number().over(Window.orderBy("row0")) - 1)
    return df.drop("row0"), f"input file {path} without its rejected rows (no archive)"


def _generated(spark, target: Target):
    """The generator's streams, as the master draws them (the same seed gives the same streams; ts in
    microseconds, and in seconds as the run's files would hold them), numbered by `pos`.  Drawn on the driver a
    chunk at a time into a Parquet file of the audit's own (scratch), which Spark reads: neither the driver nor
    Spark holds the whole input in memory."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from pyspark.sql import functions as F

    from common.workload import GeneratorSource

    path = target.scratch("generated.parquet")
    src, writer = GeneratorSource(target.plan.generator), None
    try:
        while (c := src.next_chunk(1 << 20)) is not None:
            chunk = pa.table(
                {
                    "stream": pa.DictionaryArray.from_arrays(c.stream.astype(np.int8), pa.array(["R", "S"])),
                    "id": c.id,
                    "ts": c.ts / PER_SECOND,
                    "t": c.ts,
                    "key": c.key,
                    "value": c.value,
                }
            )
            writer = writer or pq.ParquetWriter(path, chunk.schema)
            writer.write_table(chunk)
    finally:
        if writer is not None:
            writer.close()
    df = spark.read.parquet(uri(path)) if writer is not None else spark.createDataFrame([], TUPLE_SCHEMA + ", t long")
    return df.withColumn("pos", F.col("_metadata.row_index") if writer is not None else F.lit(0).cast("long"))


def classify(arrived, max_delay: int, lo: int, hi: int):
    """The tuples with lo <= t < hi, each with `late` by the lateness rule over its dispatcher's arrival order
    (microseconds: a tuple exactly max_delay behind the largest t before it is on time).

    Only the blocks (BLOCK rows of an archive file) holding such a tuple are ordered; every earlier block
    contributes its largest ts, so the running max is exact without one ordered pass over the whole input."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    inside = (F.col("t") >= lo) & (F.col("t") < hi)
    arrived = arrived.withColumn("f", F.col("f") * F.lit(1 << 32) + F.expr(f"row div {BLOCK}"))  # files in blocks
    blocks = arrived.groupBy("d", "f").agg(F.max("t").alias("block_max"), F.max(inside.cast("int")).alias("hits"))
    blocks = blocks.withColumn(
        "before",
        F.max("block_max").over(Window.partitionBy("d").orderBy("f").rowsBetween(Window.unboundedPreceding, -1)),
    )
    chosen = F.broadcast(blocks.where("hits = 1").select("d", "f", "before"))
    rows = arrived.join(chosen, ["d", "f"]).withColumn(
        "prev",
        F.greatest(
            "before",
            F.max("t").over(Window.partitionBy("d", "f").orderBy("row").rowsBetween(Window.unboundedPreceding, -1)),
        ),
    )
    delay = F.col("delay") if "delay" in arrived.columns else F.lit(max_delay)  # declared streams: their own
    late = F.coalesce(F.col("t") < F.col("prev") - delay, F.lit(False))
    return rows.where(inside).select("d", "stream", "id", "ts", "t", "key", "value", late.alias("late"))


def kept(df):
    """(`df` checkpointed, its row count): computed once now, in a job of its own, so that the branches of
    the plan that read it later share it instead of each computing it again; and a leaf of their plans, which
    Spark then analyses and optimizes in a fraction of the time the whole lineage takes (cache() keeps it)."""
    df = df.localCheckpoint(eager=False)
    return df, df.count()


def release(*frames) -> None:
    """Free what `kept` and cache() hold: a checkpoint's blocks are its RDD's, which the DataFrame's
    unpersist() does not reach (under --follow each range makes a few)."""
    for df in frames:
        plan = df._jdf.queryExecution().analyzed()
        if plan.getClass().getSimpleName() == "LogicalRDD":
            plan.rdd().unpersist(False)
        else:
            df.unpersist()


def sampled(key_column, sample: float):
    from pyspark.sql import functions as F

    return F.pmod(F.xxhash64(key_column), F.lit(SAMPLE_SCALE)) < F.lit(int(round(sample * SAMPLE_SCALE)))


def key_predicate(join: Join):
    """The join predicate on r_key and s_key, as the config defines it; exact for every int64 key."""
    from pyspark.sql import functions as F

    r, s = F.col("r_key").cast("decimal(20,0)"), F.col("s_key").cast("decimal(20,0)")
    if join.predicate == "band":
        return F.abs(s - r) <= F.lit(join.band)
    if join.predicate == "less":
        return r < s
    return r == s


def floor_div(column: str, width: int):
    """Floor division of a long column by a positive width (Spark's div truncates toward zero)."""
    from pyspark.sql import functions as F

    return F.expr(f"({column} - pmod({column}, {width})) div {width}")


def on_time_side(tuples, name: str, span: int):
    """The on-time tuples of stream `name` ("r" or "s") with their columns prefixed, and a time bucket of twice
    `span` (the `reach` of the join)."""
    from pyspark.sql import functions as F

    t = tuples.where(~F.col("late") & (F.col("stream") == name.upper())).select(
        *(F.col(c).alias(f"{name}_{c}") for c in ("id", "key", "ts", "t", "value"))
    )
    return t.withColumn(f"{name}_tb", floor_div(f"{name}_t", max(2 * span, 1)))


def matches(r, s, join: Join):
    """Every pair of the R and S sides (on_time_side) that joins (microseconds: lower <= s.ts - r.ts <= upper,
    both ends included).

    Both sides carry a time bucket of twice the reach (and, for band, a key bucket of band + 1): a pair is
    at most one bucket apart, so the R side, repeated at the neighbouring buckets, meets its partners in an
    equi-join; the exact predicate follows."""
    from pyspark.sql import functions as F

    near = F.array(F.lit(-1), F.lit(0), F.lit(1))
    r = r.withColumn("tb", F.explode(near)).withColumn("tb", F.col("tb") + F.col("r_tb"))
    on = [r["tb"] == s["s_tb"]]
    if join.predicate == "equal":
        on.append(r["r_key"] == s["s_key"])
    elif join.predicate == "band":
        w = join.band + 1
        r = r.withColumn("kb", F.explode(near)).withColumn("kb", F.col("kb") + floor_div("r_key", w))
        s = s.withColumn("s_kb", floor_div("s_key", w))
        on.append(r["kb"] == s["s_kb"])
    lower, upper = join.bounds
    return r.join(s, on).where((F.col("s_t") - F.col("r_t")).between(lower, upper) & key_predicate(join))


def expected_pairs(tuples, join: Join, start: int, end: int, sample: float):
    """Every pair of on-time tuples that joins and whose later t is in [start, end); sampled by s_key (and
    r_key for an equi-join)."""
    from pyspark.sql import functions as F

    r, s = on_time_side(tuples, "r", join.reach), on_time_side(tuples, "s", join.reach)
    if sample < 1:
        s = s.where(sampled("s_key", sample))
        if join.predicate == "equal":
            r = r.where(sampled("r_key", sample))
    later = F.greatest("r_t", "s_t")
    return matches(r, s, join).where((later >= start) & (later < end)).select(*PAIR)


def partnered(tuples, join: Join, start: int, end: int, sample: float, name: str):
    """The on-time tuples of stream `name` with ts in [start, end) (of the sampled keys), each with
    `partnered`: whether any on-time tuple of the other stream joins it.  `tuples` must reach `reach` past
    both ends: a partner is at most that far away.  For an equi-join the other side is sampled too (a
    partner has the same key); for band and less it is whole."""
    from pyspark.sql import functions as F

    other = "s" if name == "r" else "r"
    own = on_time_side(tuples, name, join.reach).where((F.col(f"{name}_t") >= start) & (F.col(f"{name}_t") < end))
    far = on_time_side(tuples, other, join.reach)
    if sample < 1:
        own = own.where(sampled(f"{name}_key", sample))
        if join.predicate == "equal":
            far = far.where(sampled(f"{other}_key", sample))
    r, s = (own, far) if name == "r" else (far, own)
    hit = matches(r, s, join).select(F.col(f"{name}_id").alias("hit")).distinct()
    return own.join(hit, own[f"{name}_id"] == hit["hit"], "left").select(
        *(F.col(f"{name}_{c}").alias(c) for c in ("id", "key", "ts", "t", "value")),
        F.col("hit").isNotNull().alias("partnered"),
    )


def read_folder(spark, files: list[Path], schema: str):
    """Parquet and CSV files of one output folder as one DataFrame (an empty one if there are none)."""
    parquet = [uri(f) for f in files if f.suffix == ".parquet"]
    csv = [uri(f) for f in files if f.suffix == ".csv"]
    frames = ([spark.read.schema(schema).parquet(*parquet)] if parquet else []) + (
        [spark.read.schema(schema).csv(csv, header=True)] if csv else []
    )
    if not frames:
        return spark.createDataFrame([], schema)
    return frames[0] if len(frames) == 1 else frames[0].unionByName(frames[1])


# -- one range --------------------------------------------------------------------------------------------------
def range_name(start: int, end: int) -> str:
    return f"{seconds_text(start)}-{seconds_text(end)}"


def within(start: int, end: int, *columns: str, nullable: bool = False):
    """The later of the columns' ts (float seconds, as the files hold them) in [start, end) microseconds.  A
    looser test in seconds first, which Parquet can use to skip row groups; the exact one on microseconds.
    `nullable`: a null column (the missing side of a row alone) is left out of the later ts."""
    from pyspark.sql import functions as F

    later = micros(F.greatest(*map(F.col, columns)) if len(columns) > 1 else F.col(columns[0]))  # monotone
    test = (later >= start) & (later < end)
    for c in columns if end < POS_INF else ():
        loose = F.col(c) < end / PER_SECOND + 1
        test = (F.col(c).isNull() | loose if nullable else loose) & test
    return test


def alone(own, want: str):
    """The tuples of `own` (partnered) the join emits alone as kind `want`: semi's left_matched ones with a
    partner, the *_unmatched ones without."""
    from pyspark.sql import functions as F

    return own.where(F.col("partnered") if want == LEFT_MATCHED else ~F.col("partnered"))


def lone_problems(rows, own, want: str | None, side: str, flags, join_type: str):
    """(diff rows, expected rows) of the rows of stream `side` emitted without the other side.

    `rows`: those the result files hold (PAIR and kind); `own`: `partnered` over the range, None when the
    join type emits no such row; `want`: the kind they carry (semi: left_matched, an R row with a partner;
    otherwise *_unmatched, one with none).  Compared by (id, kind): missing, extra (with why), duplicates."""
    from pyspark.sql import functions as F

    sid = f"{side}_id"
    mine = [c for c in PAIR if c.startswith(side)]
    copies = rows.groupBy(sid, "kind").agg(
        F.count(F.lit(1)).alias("copies"), *(F.first(c).alias(c) for c in PAIR if c != sid)
    )
    if own is None:
        expected = missing = None
        extra = copies.withColumn("partnered", F.lit(None).cast("boolean"))
    else:
        expected = alone(own, want).select(*(F.col(c[2:]).alias(c) for c in mine))
        extra = copies.join(expected.select(sid, F.lit(want).alias("kind")), [sid, "kind"], "left_anti").join(
            own.select(F.col("id").alias(sid), "partnered"), sid, "left"
        )
        missing = expected.join(copies.where(F.col("kind") == want).select(sid), sid, "left_anti")
    extra = extra.join(flags, sid, "left")
    why = (
        F.when(
            F.lit(want is None) | (F.col("kind") != F.lit(want or "")),
            F.concat(F.lit(f"join.type = {join_type!r} emits no "), F.col("kind"), F.lit(" rows")),
        )
        .when(F.col(f"{side}_late"), "its tuple is late")
        .when(F.col("partnered").isNull(), "no such on-time tuple in the input")
    )
    why = (
        why.when(~F.col("partnered"), "its tuple has no partner: semi emits an R row with one")
        if want == LEFT_MATCHED
        else why.when(F.col("partnered"), "its tuple has a partner: it belongs in a pair")
    )
    nulls = [
        F.lit(None).cast("long" if c.endswith(("_id", "_key")) else "double").alias(c)
        for c in PAIR
        if not c.startswith(side)
    ]
    diff = extra.select(
        F.lit("extra").alias("problem"), why.otherwise("not expected").alias("reason"), "copies", *PAIR, "kind"
    ).unionByName(
        copies.where("copies > 1").select(
            F.lit("duplicate").alias("problem"),
            F.lit("the result files hold this row more than once").alias("reason"),
            "copies",
            *PAIR,
            "kind",
        )
    )
    if missing is not None:
        diff = diff.unionByName(
            missing.select(
                F.lit("missing").alias("problem"),
                F.lit(f"no result file holds this {want} row").alias("reason"),
                F.lit(0).cast("long").alias("copies"),
                *mine,
                *nulls,
                F.lit(want).alias("kind"),
            )
        )
    return diff, expected


def late_problems(spark, target: Target, tuples, start: int, end: int, sample: float) -> list:
    """The tuples late/ holds that are not late by the rule (`tuples`: classified, of the sampled keys), and
    those late by it that late/ lacks, with ts in [start, end): diff rows (problem, reason, the tuple)."""
    from pyspark.sql import functions as F

    got_late = (
        audit_streams.late(spark, target.plan, target.files("late"), target.codes, LATE_SCHEMA)
        if target.codes is not None
        else read_folder(spark, target.files("late"), LATE_SCHEMA)
    ).where(within(start, end, "ts"))
    if sample < 1:
        got_late = got_late.where(sampled("key", sample))
    want_late = tuples.where(F.col("late") & (F.col("t") >= start) & (F.col("t") < end))
    key = ["stream", "id"]
    return [
        got_late.join(want_late.select(*key), key, "left_anti").select(
            F.lit("late_unexpected").alias("problem"),
            F.lit("set aside as late, but its ts is not below the max ts before it minus join.max_delay").alias(
                "reason"
            ),
            "stream",
            "id",
            "ts",
            "key",
            "value",
        ),
        want_late.join(got_late.select(*key), key, "left_anti").select(
            F.lit("late_missed").alias("problem"),
            F.lit("late by the rule, but late/ does not hold it").alias("reason"),
            "stream",
            "id",
            "ts",
            "key",
            "value",
        ),
    ]


def audit_range(spark, target: Target, start: int, end: int, sample: float = 1.0) -> dict:
    """Audit [start, end) (microseconds): the report (also written as audit/audit-<range>.json) and, on a
    difference, the offending pairs, rows and tuples in audit/diff-<range>.parquet.

    A pair is in the range by its later ts, a row without a partner (join.type other than inner) by its own
    ts; such a row's partners may lie `reach` past the range, so the input is read up to end + reach."""
    from pyspark.sql import functions as F

    began, jobs = time.monotonic(), job_group(spark)
    join = target.plan.join
    join_type = join.type
    far = join.reach
    arrived, source = arrivals(spark, target)
    hi = end if join_type == "inner" or end >= POS_INF else end + far
    tuples, _ = kept(classify(arrived, join.max_delay, start - far, hi))
    expected = expected_pairs(tuples, join, start, end, sample)
    expected, n_expected = kept(expected if EMITS[join_type][0] else expected.where(F.lit(False)))
    in_sample = tuples.where(sampled("key", sample)) if sample < 1 else tuples

    schema = RESULT_SCHEMA + ("" if join_type == "inner" else ", kind string")
    results = (
        audit_streams.results(spark, target.plan, target.files("results"), target.codes, schema, MATCHED)
        if target.codes is not None
        else read_folder(spark, target.files("results"), schema)
    )
    kind = F.col("kind") if join_type != "inner" else F.lit(MATCHED)
    alone = {"r": kind.isin(LEFT_UNMATCHED, LEFT_MATCHED), "s": kind == RIGHT_UNMATCHED}
    found = results.where(within(start, end, "r_ts", "s_ts", nullable=join_type != "inner"))
    if join_type != "inner":
        found = found.where(~alone["r"] & ~alone["s"])
    if sample < 1:
        found = found.where(sampled("s_key", sample))
    found, n_found = kept(found.select(*PAIR, kind.alias("kind")))
    copies = found.groupBy("r_id", "s_id").agg(
        F.count(F.lit(1)).alias("copies"), *(F.first(c).alias(c) for c in PAIR[2:] + ["kind"])
    )
    ids = ["r_id", "s_id"]
    lateness = tuples.select("stream", "id", "late")
    flag = lambda side: lateness.where(F.col("stream") == side.upper()).select(
        F.col("id").alias(f"{side}_id"), F.col("late").alias(f"{side}_late")
    )
    extra = (
        copies.join(expected.select(*ids), ids, "left_anti")
        .join(flag("r"), "r_id", "left")
        .join(flag("s"), "s_id", "left")
    )
    why = (
        F.when(
            F.col("kind") != MATCHED, F.concat(F.lit("its kind "), F.col("kind"), F.lit(" is none the engine writes"))
        )
        .when(F.lit(not EMITS[join_type][0]), f"join.type = {join_type!r} emits no pairs")
        .when(F.col("r_late"), "its R tuple is late")
        .when(F.col("s_late"), "its S tuple is late")
        .when(
            ~(micros(F.col("s_ts")) - micros(F.col("r_ts"))).between(*join.bounds),
            "s_ts - r_ts is outside the join's time bounds (join.lower, join.upper or -+join.window)",
        )
        .when(~key_predicate(join), f"its keys do not satisfy join.predicate = {join.predicate!r}")
        .otherwise("no such pair of on-time tuples in the input")
    )
    diff = (
        expected.join(copies.select(*ids), ids, "left_anti")
        .select(
            F.lit("missing").alias("problem"),
            F.lit("no result file holds this on-time pair").alias("reason"),
            F.lit(0).cast("long").alias("copies"),
            *PAIR,
            F.lit(MATCHED).alias("kind"),
        )
        .unionByName(extra.select(F.lit("extra").alias("problem"), why.alias("reason"), "copies", *PAIR, "kind"))
        .unionByName(
            copies.where("copies > 1").select(
                F.lit("duplicate").alias("problem"),
                F.lit("the result files hold this pair more than once").alias("reason"),
                "copies",
                *PAIR,
                "kind",
            )
        )
    )
    lone_found, lone_expected, cached = [], [], []
    for side in ("r", "s") if join_type != "inner" else ():
        rows = results.where(alone[side] & within(start, end, f"{side}_ts"))
        if sample < 1:
            rows = rows.where(sampled(f"{side}_key", sample))
        rows, _ = kept(rows.select(*PAIR, "kind"))
        lone_found.append(rows)
        want = EMITS[join_type][1 if side == "r" else 2]
        own = kept(partnered(tuples, join, start, end, sample, side))[0] if want else None
        problems, expected_rows = lone_problems(rows, own, want, side, flag(side), join_type)
        diff = diff.unionByName(problems)
        if want:
            lone_expected.append(expected_rows.select(F.lit(want).alias("kind")))
            cached.append(own)
    tuple_rows = late_problems(spark, target, in_sample, start, end, sample)
    for t in tuple_rows:
        diff = diff.unionByName(t, allowMissingColumns=True)
    if join_type == "inner":
        diff = diff.drop("kind")
    payload = (
        audit_streams.payload_faults(spark, target.plan, target.files("results"), target.rows)
        if target.codes is not None
        else None
    )
    if payload is not None:
        in_range = payload.where(within(start, end, "r_ts", "s_ts", nullable=True)).drop("r_ts", "s_ts")
        in_range = in_range.drop("kind") if join_type == "inner" else in_range
        diff = diff.unionByName(in_range, allowMissingColumns=True)
    diff = diff.localCheckpoint(eager=False)  # planned once; computed by the first job that reads it
    by_kind = F.col("kind") if join_type != "inner" else F.lit(MATCHED)
    # the other counts in one job: the problems by kind, the input, the expected and found rows alone
    tally = diff.select(F.col("problem").alias("what"), by_kind.alias("kind"), (F.col("copies") - 1).alias("surplus"))
    for what, df in [
        ("input", in_sample.select(F.lit(MATCHED))),
        *(("expected", rows) for rows in lone_expected),
        *(("found", rows.select("kind")) for rows in lone_found),
    ]:
        tally = tally.unionByName(df.toDF("kind").select(F.lit(what).alias("what"), "kind", F.lit(0).alias("surplus")))
    counts = {
        (r["what"], r["kind"]): (r["n"], r["surplus"])
        for r in tally.groupBy("what", "kind")
        .agg(F.count(F.lit(1)).alias("n"), F.sum("surplus").alias("surplus"))
        .collect()
    }
    n = lambda problem, k=MATCHED: counts.get((problem, k), (0, 0))[0]
    surplus = lambda k=MATCHED: int(counts.get(("duplicate", k), (0, 0))[1] or 0)
    report = {
        "range": range_name(start, end),
        "from": _finite(start),
        "to": _finite(end),
        "sample": sample,
        "run": target.describe(),
        "input": source,
        "predicate": join.predicate,
        "dispatchers": target.plan.cluster.dispatchers,
        "input_tuples": n("input"),
        "expected": n_expected,
        "found": n_found,
        "missing": n("missing"),
        "extra": n("extra"),
        "duplicates": surplus(),
        "duplicate_pairs": n("duplicate"),
        "late_unexpected": n("late_unexpected"),
        "late_missed": n("late_missed"),
    }
    wrong = ["missing", "extra", "duplicates"]
    if join_type != "inner":
        seen = {k: c for (what, k), (c, _) in counts.items() if what == "found" and k != MATCHED}
        report["join_type"] = join_type
        report["kinds"] = [k for k in LONE_KINDS if k in EMITS[join_type][1:] or k in seen]
        for k in report["kinds"]:
            report[f"{k}_expected"], report[f"{k}_found"] = n("expected", k), seen.get(k, 0)
            report.update({f"{k}_missing": n("missing", k), f"{k}_extra": n("extra", k), f"{k}_duplicates": surplus(k)})
            wrong += [f"{k}_missing", f"{k}_extra", f"{k}_duplicates"]
    report["late_wrong"] = report["late_unexpected"] + report["late_missed"]
    if payload is not None:  # declared streams: the rows' own columns checked against their input rows
        report["payload_wrong"] = sum(v[0] for (p, _), v in counts.items() if p == "payload")
        wrong.append("payload_wrong")
    exact = not any(report[k] for k in wrong + ["late_wrong"])
    report["verdict"] = "exact" if exact else "different"
    folder = target.out / "audit"
    folder.mkdir(parents=True, exist_ok=True)
    evidence = folder / f"diff-{report['range']}.parquet"
    evidence.unlink(missing_ok=True)  # an earlier audit's, of output that has been replaced since
    report["diff"] = (
        None if exact else str(write_single(diff.orderBy("problem", "r_id", "s_id", "stream", "id"), evidence))
    )
    release(arrived, tuples, expected, found, diff, *lone_found, *cached)
    report["seconds"] = round(time.monotonic() - began, 2)
    report["spark_jobs"] = len(spark.sparkContext.statusTracker().getJobIdsForGroup(jobs))
    (folder / f"audit-{report['range']}.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


def audit_query_run(spark, target: Target, plan) -> dict:
    """Audit a finished run of a query (control.audit_query): its result rows against the query run by Spark SQL
    over the streams' on-time rows, as multisets; its late tuples as for any run.  The report (also written as
    audit/audit-start-end.json) and, on a difference, its rows in audit/diff-start-end.parquet."""
    with audit_query.sql_semantics(spark):
        return _audit_query_run(spark, target, plan)


def _audit_query_run(spark, target: Target, plan) -> dict:
    from pyspark.sql import functions as F

    began, jobs = time.monotonic(), job_group(spark)
    arrived, source = arrivals(spark, target)
    tuples, n_input = kept(classify(arrived, target.plan.join.max_delay, NEG_INF, POS_INF))
    found = audit_streams.read_output(spark, target.files("results"))
    expected, sql, columns_wrong = audit_query.expected_rows(spark, target.plan, target.rows, tuples, found.schema)
    counts, problems = audit_query.compare(expected, found.select(*map(audit_query.quoted, expected.columns)))
    problems = problems.localCheckpoint(eager=False)
    first = [audit_query.describe(r.asDict(), expected.columns) for r in problems.orderBy("problem").limit(3).collect()]
    late = late_problems(spark, target, tuples, NEG_INF, POS_INF, 1.0)
    tally = {
        r["problem"]: r["n"]
        for r in late[0].unionByName(late[1]).groupBy("problem").agg(F.count(F.lit(1)).alias("n")).collect()
    }
    report = {
        "range": range_name(NEG_INF, POS_INF),
        "from": None,
        "to": None,
        "sample": 1.0,
        "run": target.describe(),
        "input": source,
        "query": sql,
        "join_type": plan.join_type,
        "dispatchers": target.plan.cluster.dispatchers,
        "input_tuples": n_input,
        **counts,
        "columns_wrong": columns_wrong,
        "late_unexpected": tally.get("late_unexpected", 0),
        "late_missed": tally.get("late_missed", 0),
    }
    report["late_wrong"] = report["late_unexpected"] + report["late_missed"]
    wrong = ["missing", "extra", "duplicates", "columns_wrong", "late_wrong"]
    exact = not any(report[k] for k in wrong)
    report["verdict"] = "exact" if exact else "different"
    report["first"] = first
    folder = target.out / "audit"
    folder.mkdir(parents=True, exist_ok=True)
    evidence = folder / f"diff-{report['range']}.parquet"
    evidence.unlink(missing_ok=True)
    diff = problems.unionByName(late[0], allowMissingColumns=True).unionByName(late[1], allowMissingColumns=True)
    report["diff"] = None if exact else str(write_single(diff.orderBy("problem"), evidence))
    release(arrived, tuples, problems)
    report["seconds"] = round(time.monotonic() - began, 2)
    report["spark_jobs"] = len(spark.sparkContext.statusTracker().getJobIdsForGroup(jobs))
    (folder / f"audit-{report['range']}.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


def view_refusal(target: Target, start: int, end: int, sample: float, follow: bool) -> str | None:
    """Why `--view` cannot audit this (None: it can): see docs/audit.md, "Aggregated views"."""
    plan = target.plan
    whole = start <= NEG_INF and end >= POS_INF
    spec, streams = plan.aggregate.view, plan.source.kind == "streams"
    stream_times = {s.prefix + s.time for s in plan.inputs}
    reasons = [
        (follow or sample < 1, "--follow or --sample (a view counts every row of its windows)"),
        (not target.finished, "a live run (audit its view once the run has ended)"),
        (not whole and not spec.window, "--from/--to with aggregate.window = 0 (one window spans the whole run)"),
        (
            not whole and not set(spec.times) <= stream_times,
            "--from/--to with aggregate.time on a column other than the streams' times (its rows lie anywhere)",
        ),
        (
            streams and any(f.suffix == ".csv" for f in target.files("results")),
            "CSV results of declared streams (their types are the Parquet files')",
        ),
    ]
    return next((f"--view: not audited: {why}" for refused, why in reasons if refused), None)


def audit_view_range(spark, target: Target, start: int, end: int, directory: Path) -> dict:
    """Audit the view in `directory` (control.aggregate's snapshots) over the windows inside [start, end): the
    rows of the range recomputed as audit_range recomputes them, aggregated by control.aggregate's --batch
    functions with the run's [aggregate], diffed with the view's final windows (control.audit_view).  Writes
    audit/view-<range>.json and, on a difference, audit/view-diff-<range>.parquet."""
    import pyarrow.parquet as pq
    from pyspark.sql import functions as F

    from control import aggregate

    began = time.monotonic()
    view = aggregate.read_view(directory)
    if view is None:
        raise AuditError(f"--view {directory}: no view-*.parquet there (run control.aggregate on the run first)")
    plan, join = target.plan, target.plan.join
    join_type = join.type
    spec, streams = plan.aggregate.view, plan.source.kind == "streams"
    far = join.reach
    arrived, source = arrivals(spark, target)
    tuples = classify(arrived, join.max_delay, start - far, end + far).localCheckpoint(eager=False)
    # a pair's window time (declared streams: one stream's time) lies up to `far` below its later ts
    pairs = expected_pairs(tuples, join, start, end + far if streams else end, 1.0) if EMITS[join_type][0] else None
    lone = [
        (side, want, alone(partnered(tuples, join, start, end, 1.0, side), want))
        for side, want in zip("rs", EMITS[join_type][1:])
        if want
    ]
    none = lambda c: F.lit(None).cast("long" if c.endswith(("_id", "_key")) else "double").alias(c)  # noqa: E731
    kind = lambda k: [F.lit(k).alias("kind")] if join_type != "inner" else []  # noqa: E731
    if plan.query is not None:  # a query's GROUP BY: the rows of its join, as the result files hold them
        found = audit_streams.read_output(spark, target.files("results"))
        if found is None:
            raise audit_streams.Refused(f"--view: {target.out / 'results'} holds no result file to take the types from")
        rows = audit_query.expected_rows(spark, plan, target.rows, tuples, found.schema)[0]
    elif streams:
        frames = [pairs.select("r_id", "s_id", *kind(MATCHED))] if pairs is not None else []
        for side, want, own in lone:
            frames.append(
                own.select(F.col("id").alias(f"{side}_id"), none("s_id" if side == "r" else "r_id"), *kind(want))
            )
        parquet = [f for f in target.files("results") if f.suffix == ".parquet"]
        if not parquet:
            raise audit_streams.Refused(
                f"--view: {target.out / 'results'} holds no Parquet result file to take the types from"
            )
        ids = frames[0]
        for f in frames[1:]:
            ids = ids.unionByName(f)
        rows = audit_streams.result_rows(plan, ids, pq.read_schema(parquet[0]), target.rows)
    else:  # the single file's result columns, as the audit's pairs and rows alone hold them
        rows = pairs.select(*PAIR, *kind(MATCHED)) if pairs is not None else None
        for side, want, own in lone:
            columns = (F.col(c[2:]).alias(c) if c.startswith(side) else none(c) for c in PAIR)
            alone_rows = own.select(*columns, *kind(want))
            rows = alone_rows if rows is None else rows.unionByName(alone_rows)
    want = aggregate.snapshot(aggregate.view_of(rows, spec), spec, POS_INF)
    counts, evidence = audit_view.diff(view, want, spec.keys, spec.window, start, end)
    release(tuples, arrived)
    exact = not (counts["missing"] or counts["extra"] or counts["different"])
    name = range_name(start, end)
    folder = target.out / "audit"
    folder.mkdir(parents=True, exist_ok=True)
    dest = folder / f"view-diff-{name}.parquet"
    dest.unlink(missing_ok=True)
    if not exact:
        pq.write_table(evidence, dest)
    report = {
        "range": name,
        "from": _finite(start),
        "to": _finite(end),
        "view": str(directory),
        "run": target.describe(),
        "input": source,
        **counts,
        "verdict": "exact" if exact else "different",
        "diff": None if exact else str(dest),
        "first": [audit_view.describe(r) for r in evidence.slice(0, 3).to_pylist()],
        "seconds": round(time.monotonic() - began, 2),
    }
    (folder / f"view-{name}.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


def job_group(spark) -> str:
    """A Spark job group of its own for this thread's next jobs, so the report can count them (its plan's
    cost: each job is a pass over data)."""
    group = f"streamjoin-audit-{time.monotonic_ns()}"
    spark.sparkContext.setJobGroup(group, "control.audit")
    return group


def _finite(us: int) -> float | None:
    """A bound in seconds for the report (None: open)."""
    return None if us <= NEG_INF or us >= POS_INF else us / PER_SECOND


def write_single(df, dest: Path) -> Path:
    """`df` as the one Parquet file `dest` (written beside it, then renamed)."""
    staging = dest.parent / f"_{dest.stem}.spark"
    df.coalesce(1).write.mode("overwrite").parquet(uri(staging))
    (part,) = staging.glob("part-*.parquet")
    part.replace(dest)
    shutil.rmtree(staging)
    return dest


# -- the command -----------------------------------------------------------------------------------------------
def table(reports: list[dict], kinds: list[str] | None = None) -> str:
    """The reports as a fixed-width table, one range a row; with a join type other than inner, five columns
    per kind of row alone (`kinds`, or the first report's) before `late wrong`."""
    kinds = kinds if kinds is not None else reports[0].get("kinds", []) if reports else []
    lone = [(f"{k} {o}", f"{k}_{o}") for k in kinds for o in PAIR_OUTCOMES]
    columns = COLUMNS[:-2] + lone + COLUMNS[-2:]
    if reports and "query" in reports[0]:  # a query's rows: pairs and rows alone alike
        columns = [("expected rows" if k == "expected" else h, k) for h, k in columns]
    cells = [[h for h, _ in columns]] + [
        [f"{r.get(k, 0):,}" if isinstance(r.get(k, 0), int) else str(r[k]) for _, k in columns] for r in reports
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    return "\n".join(
        "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in cells
    )


def verdict(r: dict) -> str:
    if r["verdict"] == "exact":
        return f"EXACT: range {r['range']} ({r['run']}, {r['input']}, sample {r['sample']:g})"
    labels = [("missing", "missing"), ("extra", "extra"), ("duplicates", "duplicates")]
    labels = (
        [(k, f"pairs {label}" if r.get("kinds") else f"rows {label}" if "query" in r else label) for k, label in labels]
        + [(f"{k}_{o}", f"{k} rows {o}") for k in r.get("kinds", []) for o in ("missing", "extra", "duplicates")]
        + [("late_unexpected", "late that should not be"), ("late_missed", "not set aside as late")]
    )
    wrong = [f"{r[k]:,} {label}" for k, label in labels if r[k]]
    if r.get("columns_wrong"):  # a query's: result columns the query does not give, or the reverse
        wrong.append(f"result columns not the query's: {', '.join(r['columns_wrong'])}")
    return f"DIFFERENT: range {r['range']} ({r['run']}): {', '.join(wrong)}; the evidence is in {r['diff']}"


def clamp(target: Target, start: int, end: int) -> int:
    """The range's end, no later than the watermark of a live run (later ranges are not final yet)."""
    if end <= target.watermark:
        return end
    if start >= target.watermark:
        raise AuditError(
            f"--from {seconds_text(start)}: the {target.describe()} has not passed it yet; "
            "audit an earlier range or wait for a later checkpoint"
        )
    print(
        f"audit: --to {seconds_text(end)} is past the watermark of the {target.describe()}: auditing up to it",
        file=sys.stderr,
        flush=True,
    )
    return target.watermark


def follow(spark, plan: Plan, start: float, step: float, sample: float, poll: float, log=print, metrics=None) -> int:
    """Audit [start, start + step), [start + step, ...) (seconds) as the watermark passes each; once the run
    has finished, the rest in one range.  Each verdict also goes to `metrics` (control.audit_metrics) if
    given.  Returns the exit code over all ranges."""
    worst = EXACT
    start, step = instant(start), duration(step)
    while True:
        target = run_state(plan)
        while target.finished or start + step <= target.watermark:
            end = POS_INF if target.finished else start + step
            try:
                r = audit_range(spark, target, start, end, sample)
            finally:
                target.clean()
            if metrics is not None:
                metrics.record(r)
            log(table([r]).splitlines()[1] + ("" if r["verdict"] == "exact" else "   " + verdict(r)))
            worst = max(worst, EXACT if r["verdict"] == "exact" else DIFFERENT)
            if end == POS_INF:
                return worst
            start = end
        time.sleep(poll)


#: the audit's Spark settings: one plan, run as planned (adaptive execution would add a job per shuffle
#: stage); shuffles of SHUFFLES_PER_CORE partitions per core, each a share of the input a task sorts or spills
STATIC_PLAN = {"spark.sql.adaptive.enabled": "false"}
SHUFFLES_PER_CORE = 4


def audit_session(master: str | None):
    """The audit's Spark session (control.spark.session: its heap sized for the machine), planned statically."""
    from control.spark import session

    spark = session(master, "streamjoin-audit", STATIC_PLAN)
    spark.conf.set("spark.sql.shuffle.partitions", str(SHUFFLES_PER_CORE * spark.sparkContext.defaultParallelism))
    return spark


def main(argv: list[str], spark=None) -> int:
    from control.spark import add_arguments, config

    p = argparse.ArgumentParser(prog=invocation("control.audit"), description=__doc__.split("\n")[0])
    p.add_argument(
        "--from",
        dest="start",
        type=float,
        default=-math.inf,
        help="first later-tuple ts audited (inclusive; default: the beginning)",
    )
    p.add_argument(
        "--to",
        dest="end",
        type=float,
        default=math.inf,
        help="later-tuple ts where the audit ends (exclusive; default: the end, or a live run's watermark)",
    )
    p.add_argument(
        "--sample",
        type=float,
        default=None,
        help="audit this fraction of the keys, chosen by hash (default 1; 0.1 with --follow)",
    )
    p.add_argument(
        "--follow",
        action="store_true",
        help="audit each range of --step seconds as the watermark passes it, until the run finishes",
    )
    p.add_argument("--step", type=float, default=10.0, help="with --follow: seconds of event time per range")
    p.add_argument("--poll", type=float, default=5.0, help="with --follow: seconds between looks at the checkpoints")
    p.add_argument(
        "--metrics",
        default=None,
        metavar="HOST:PORT",
        help=f'with --follow: serve the verdicts as Prometheus metrics here (default {DEFAULT_ENDPOINT}; "" off)',
    )
    p.add_argument(
        "--view",
        metavar="DIR",
        help="audit the merger's view in DIR (control.aggregate's snapshots) instead of the pairs: its final "
        "windows inside the range against the view of the recomputed rows",
    )
    add_arguments(p)
    a = p.parse_args(argv)
    sample = a.sample if a.sample is not None else (0.1 if a.follow else 1.0)
    target = None
    try:
        if not 0 < sample <= 1:
            raise AuditError(f"--sample: expected a fraction in (0, 1], got {sample:g}")
        start, end = instant(a.start, "--from"), instant(a.end, "--to")
        if not start < end:
            raise AuditError(f"--from ({a.start:g}) must be below --to ({a.end:g})")
        if a.follow and (start == NEG_INF or not a.step * PER_SECOND >= 1 or end != POS_INF):
            raise AuditError(
                "--follow needs --from T (where the first range starts) and --step of at least a "
                "microsecond, and no --to"
            )
        plan = config(a)
        if plan.source.kind == "streams":
            audit_streams.check_auditable(plan, sample, a.follow)
        if plan.query is not None and not (start <= NEG_INF and end >= POS_INF):
            raise audit_streams.Refused("not audited yet: --from/--to with a query (audit the whole run)")
        target = run_state(plan)
        if plan.query is not None and any(f.suffix == ".csv" for f in target.files("results")):
            raise audit_streams.Refused("not audited yet: CSV results of a query (their types are the Parquet files')")
        if a.view is not None:
            refused = view_refusal(target, start, end, sample, a.follow)
            if refused:
                raise audit_streams.Refused(refused)
            spark = spark or audit_session(a.spark_master)
            with audit_query.sql_semantics(spark) if plan is not None else contextlib.nullcontext():
                report = audit_view_range(spark, target, start, end, Path(a.view))
            print(audit_view.verdict(report), flush=True)
            return EXACT if report["verdict"] == "exact" else DIFFERENT
        end = end if a.follow else clamp(target, start, end)
        endpoint = (DEFAULT_ENDPOINT if a.metrics is None else a.metrics) if a.follow else ""
        metrics = AuditMetrics(endpoint, plan) if endpoint else None
        spark = spark or audit_session(a.spark_master)
        if a.follow:
            if metrics:
                print(f"audit: verdicts as metrics on {metrics.url}", file=sys.stderr, flush=True)
            print(table([], [k for k in LONE_KINDS if k in EMITS[plan.join.type][1:]]), flush=True)
            return follow(
                spark, plan, a.start, a.step, sample, a.poll, log=lambda s: print(s, flush=True), metrics=metrics
            )
        if plan.query is not None:
            report = audit_query_run(spark, target, plan.query)
        else:
            report = audit_range(spark, target, start, end, sample)
    except (AuditError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return USAGE
    except (audit_streams.Refused, InputError) as e:
        print(f"error: could not audit: {e}", file=sys.stderr)
        return NOT_AUDITED
    except Exception as e:  # Spark's own errors (a file it cannot read, memory) and bugs: no verdict either way
        traceback.print_exc()
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        print(f"error: could not audit: {type(e).__name__}: {first} (exit {NOT_AUDITED}: no verdict)", file=sys.stderr)
        return NOT_AUDITED
    finally:
        if target is not None:
            target.clean()
    print(verdict(report) + "".join(f"\n  {p}" for p in report.get("first", [])))  # a query's first problems
    print(table([report]), flush=True)
    return EXACT if report["verdict"] == "exact" else DIFFERENT


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
