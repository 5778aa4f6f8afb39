"""The audit of a run of a query (`query.sql`, docs/query.md): the user's SQL itself run by Spark SQL over the
streams' on-time rows, its rows compared with the run's result rows as multisets.

control.audit_streams reads each stream's files and merges them into the engine's arrival order, after the
query's filter on that stream (`ingest_filter`: a row the filter drops is never read, so it moves no watermark);
control.audit classifies each row late or on time by the engine's lateness rule.  Here each stream's on-time
rows become a Spark temp view under the stream's name (its time column the timestamp of its microseconds, as the
results carry it), and the query runs on them with SELECT as the results name their columns: the user's
SELECT items as written, `*` expanded to `<prefix><column>` per stream (the layout of SELECT * and of a GROUP
BY's result files; the GROUP BY itself is left out: the view is audited by --view), the engine's `kind` as SQL
says it (a row alone has the other stream's time null), its `delay` (a latency) left out.  Every result row is
then expected as many times as Spark gives it: missing, extra (no such row expected) and duplicate (more copies
than expected) rows are counted and written out, each with its columns.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from protocol.output import LEFT_MATCHED, LEFT_UNMATCHED, MATCHED, RIGHT_UNMATCHED
from protocol.query import R, S, Call, Col, Lit, Node, QueryPlan

if TYPE_CHECKING:
    from protocol.plan import Plan, Stream

#: the engine's result columns beside the streams' (protocol.query.ENGINE_COLUMNS): `delay` is not audited
KIND, DELAY = "kind", "delay"
_INFIX = {"and": "AND", "or": "OR", "eq": "=", "ne": "<>", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}
_INFIX |= {"add": "+", "sub": "-", "mul": "*", "div": "/"}
#: off while the audit runs a query: Spark then evaluates it as SQL does (and as the engine's conditions:
#: protocol.condition), a division by zero NULL, not an error (Spark 4 defaults to ANSI mode, which raises)
ANSI = "spark.sql.ansi.enabled"


def quoted(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


def spark_sql(node: Node, column) -> str:
    """A condition tree (protocol.query) as Spark SQL text, each column as `column(col)` says."""
    if isinstance(node, Col):
        return column(node)
    if isinstance(node, Lit):
        v = node.value
        if node.interval:
            return f"INTERVAL {v} MICROSECONDS"
        if v is None:
            return "NULL"
        if isinstance(v, bool):
            return "TRUE" if v else "FALSE"
        if isinstance(v, str):
            return "'" + v.replace("\\", "\\\\").replace("'", "\\'") + "'"
        return repr(v)
    if not isinstance(node, Call):
        raise ValueError(f"{node!r}: no column, constant or operation")
    a = [spark_sql(x, column) for x in node.args]
    if node.op in _INFIX:
        return "(" + f" {_INFIX[node.op]} ".join(a) + ")"
    return {
        "not": lambda: f"(NOT {a[0]})",
        "neg": lambda: f"(- {a[0]})",
        "abs": lambda: f"ABS({a[0]})",
        "is_null": lambda: f"({a[0]} IS NULL)",
        "in": lambda: f"({a[0]} IN ({', '.join(a[1:])}))",
    }[node.op]()


@contextlib.contextmanager
def sql_semantics(spark):
    """Spark's session evaluating as SQL does (ANSI) for the duration."""
    saved = spark.conf.get(ANSI)
    spark.conf.set(ANSI, "false")
    try:
        yield
    finally:
        spark.conf.set(ANSI, saved)


def as_read(df, spec: Stream):
    """A stream's rows (control.spark.stream_rows) with the columns the engine gives the query: the time column as
    the timestamp of its microseconds (whatever the file holds: a timestamp of any unit, a number, text), and
    without an id column `row`, the stream row (what results name such a stream's rows by)."""
    from pyspark.sql import functions as F

    df = df.withColumn(spec.time, F.timestamp_micros(F.col("_us")))
    return df if spec.id else df.withColumn("row", F.col("_row"))


def ingest_filter(plan: QueryPlan | None, side: int, df, spec: Stream):
    """The rows of a stream (stream_rows) the query's filter on it keeps: the engine runs it where the rows are
    read, before the merge and the lateness rule, on the columns as_read gives; all rows without one."""
    from pyspark.sql import functions as F

    f = plan.filters[side] if plan is not None else None
    if f is None:
        return df
    time = "timestamp_micros(`_us`)"
    return df.where(F.expr(spark_sql(f, lambda c: time if c.name == spec.time else quoted(c.name))))


def kind_sql(plan: QueryPlan) -> str:
    """The engine's `kind` of a row of the query, in Spark SQL: a row alone has the other stream's time null (an
    on-time row's time never is)."""
    if plan.join_type in ("semi", "anti"):
        return f"'{LEFT_MATCHED if plan.join_type == 'semi' else LEFT_UNMATCHED}'"
    time = [f"{quoted(plan.aliases[side])}.{quoted(plan.time[side])}" for side in (R, S)]
    alone = {"left": [(S, LEFT_UNMATCHED)], "right": [(R, RIGHT_UNMATCHED)], "inner": []}
    alone["full"] = alone["left"] + alone["right"]
    cases = "".join(f" WHEN {time[side]} IS NULL THEN '{kind}'" for side, kind in alone[plan.join_type])
    return f"CASE{cases} ELSE '{MATCHED}' END" if cases else f"'{MATCHED}'"


def statement(plan: QueryPlan, streams: tuple[Stream, ...], own: dict, columns: list[str]) -> str:
    """The user's query as Spark SQL whose columns are the result files' `columns` (but `delay`): its SELECT
    items as written but the engine's (kind as kind_sql, delay left out); with SELECT * or GROUP BY each
    stream's columns (`own`: by stream name) as `<prefix><column>`, where the results hold them, and kind; no
    GROUP BY (the result files hold the join's rows)."""
    import sqlglot
    from sqlglot import exp

    tree = sqlglot.parse_one(plan.sql, read="spark")
    tree.set("group", None)
    items = []
    if plan.projection is None:
        for side, (name, spec) in enumerate(zip(plan.streams, streams)):
            prefix = spec.prefix
            for c in own[name]:
                if prefix + c in columns:
                    # a semi or anti join's rows are R's: S's columns (if the results hold them) are null
                    value = "NULL" if side == S and plan.join_type in ("semi", "anti") else None
                    value = value or f"{quoted(plan.aliases[side])}.{quoted(c)}"
                    items.append(f"{value} AS {quoted(prefix + c)}")
        if KIND in columns:
            items.append(f"{kind_sql(plan)} AS {KIND}")
    else:
        for item in tree.expressions:
            node = item.this if isinstance(item, exp.Alias) else item
            if isinstance(node, exp.Column) and not node.table and node.name in (KIND, DELAY):
                if node.name == KIND:
                    items.append(f"{kind_sql(plan)} AS {quoted(item.alias_or_name)}")
                continue
            items.append(item.sql("spark"))
    return tree.select(*items, append=False, dialect="spark").sql("spark")


def register(spark, streams: tuple[Stream, ...], rows: dict, tuples) -> dict[str, list[str]]:
    """Each stream's on-time rows (`rows`: stream_rows by stream name; `tuples`: control.audit.classify's, R and
    S by the streams' order) as a temp view named as the stream (as_read's columns); the columns of each."""
    from pyspark.sql import functions as F

    own = {}
    for letter, spec in zip("RS", streams):
        name = spec.name
        on_time = tuples.where(~F.col("late") & (F.col("stream") == letter)).select(F.col("id").alias("_id"))
        df = as_read(rows[name][0], spec).join(on_time, "_id", "left_semi")
        own[name] = [c for c in df.columns if not c.startswith("_")]
        df.select(*map(quoted, own[name])).createOrReplaceTempView(quoted(name))
    return own


def expected_rows(spark, plan: Plan, rows: dict, tuples, schema):
    """(The query's rows over the on-time rows, in the result files' columns and types (`schema`: Spark's, of
    the result files; `delay` left out), the Spark SQL that gave them)."""
    from pyspark.sql import functions as F

    own = register(spark, plan.streams, rows, tuples)
    columns = [f.name for f in schema.fields if f.name != DELAY]
    sql = statement(plan.query, plan.streams, own, columns)
    df = spark.sql(sql)
    given = set(df.columns)
    value = lambda f: F.col(quoted(f.name)) if f.name in given else F.lit(None)  # noqa: E731
    df = df.select(*(value(f).cast(f.dataType).alias(f.name) for f in schema.fields if f.name != DELAY))
    return df, sql, sorted(given.symmetric_difference(columns))


def compare(expected, found):
    """(Rows counted, problem rows): every distinct row of either multiset with the copies each holds (`want`:
    the query's, `got`: the results'); the problems are the rows whose copies differ, each `missing` (fewer
    copies found), `extra` (none expected) or `duplicate` (more than expected), with its reason.  Rows are
    compared column by column, nulls and NaNs equal."""
    from pyspark.sql import functions as F

    columns = [quoted(c) for c in expected.columns]
    both = expected.select(*columns, F.lit(1).alias("_want"), F.lit(0).alias("_got")).unionByName(
        found.select(*columns, F.lit(0).alias("_want"), F.lit(1).alias("_got"))
    )
    counted = both.groupBy(*columns).agg(F.sum("_want").alias("want"), F.sum("_got").alias("got"))
    want, got = F.col("want"), F.col("got")
    problem = F.when(want == 0, "extra").when(got > want, "duplicate").otherwise("missing")
    times = lambda a, b, c, d: F.concat(F.lit(a), b, F.lit(c), d)  # noqa: E731
    reason = (
        F.when(want == 0, F.lit("the query does not give this row over the on-time input"))
        .when(got > want, times("the result files hold this row ", got, " times, the query gives it ", want))
        .otherwise(times("the query gives this row ", want, " times, the result files hold it ", got))
    )
    problems = counted.where(want != got).select(
        problem.alias("problem"), reason.alias("reason"), "want", "got", *columns
    )
    totals = counted.agg(
        F.sum(want).alias("expected"),
        F.sum(got).alias("found"),
        F.sum(F.when(want > got, want - got)).alias("missing"),
        F.sum(F.when(want == 0, got)).alias("extra"),
        F.sum(F.when((want > 0) & (got > want), got - want)).alias("duplicates"),
    ).first()
    return {k: int(totals[k] or 0) for k in ("expected", "found", "missing", "extra", "duplicates")}, problems


def describe(problem: dict, columns: list[str]) -> str:
    """One problem row in words: the problem and the row's columns."""
    cells = ", ".join(f"{c}={problem[c]}" for c in columns)
    return f"{problem['problem']} ({problem['want']} expected, {problem['got']} found): {cells}"
