"""The peers' own interval-join tests with conditions beyond key and time, ported as queries (docs/query.md) and run
on the real cluster: the peer's input rows as declared streams' Parquet files, the peer's SQL in Spark's dialect,
and the engine's rows asserted equal to the rows the peer's test expects, as it writes them, and to DuckDB's
rows for the same SQL over the same files (less the rows the engine, like the peer, calls late).

Ported, from Apache Flink's IntervalJoinITCase (flink-table-planner, runtime/stream/sql), every rowtime case with
a condition beyond key and time: testRowTimeInnerJoinWithOtherConditions (open bounds, `t1.b < t2.b`, a filter
`t1.b > 2`), testRowTimeLeftOuterJoin (`t1.id <> 'L-5'` on the kept side), testRowTimeRightOuterJoin (`t2.id <>
'R-5'`) and testRowTimeFullOuterJoin (`NOT (t1.id = 'L-5' OR t2.id = 'R-5')`). Flink's rowtime (ms) is the
streams' `rowtime` timestamp column; each stream's rows come in time order, so none is late for Flink's
watermark assigner (each row's time less 1 ms) nor here with `max_delay = 0s`. Flink's SQL is kept but for
aliases on result columns of one name (`t1.c AS c1`): a query may not give two columns one name.

From Apache Spark's StreamingJoinSuite (sql/core, streaming): "left outer join with non-key condition violated",
the early-state-exclusion cases (a condition on the left or the right stream, in left outer, right outer, full
outer and left semi form), and the inner "with time range - with watermark - one side condition" and "- two
side conditions". Each side's MemoryStream is one file in the order the test adds its rows; the answer
compared is the union of the test's CheckNewAnswer steps, the final total. Spark's DataFrame conditions are
written as the SQL they mean. What Spark computes in its SELECT (`window(time, "10 second")`, `.cast`) our
query cannot say (a computed column or a function other than ABS is refused), so the file carries the column as
the peer's select computes it: `window_end` (its window's end in seconds, `window.end` cast to long), and the
text `rightValue` beside the number `rightValueInt` (Spark casts it to text and back). The window equality is
then `l.window_end = r.window_end`, a second key column; time bounds are needed by a streaming interval join,
so those queries add the ones the peer's condition implies (one window: less than 10 s apart; one side: a far
end of an hour), and DuckDB gives the same rows with and without them. Spark's watermark is the least over both
streams of the largest time less the delay, and a row at or below it is late; ours is per stream and strictly
below, so each case's `max_delay` makes late exactly the rows Spark's test drops. Where the test stops before
Spark's watermark passes a row that has no partner, the row comes out here at the end of the input, as SQL
says: those rows are listed apart from the peer's (`at_end`).

Not ported: Flink's testRowTimeInnerJoinWithOtherTimeCondition (`QUARTER(t1.rowtime) = t2.a`: no functions but
ABS) and testProcessTimeInnerJoinWithOtherConditions (processing time, and no expected rows); the peers' cases
with key and time only (Flink's other rowtime joins, its window aggregations after a join and its negative
intervals; Spark's windowed joins, "... with watermark range condition", self joins and the nullable keys of
`<=>`) are not conditions beyond key and time.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from protocol.output import read_tables
from tests.reference import _row_order, duckdb_query
from tests.runs import Run, run_cluster


def stream_file(folder: Path, name: str, columns: dict[str, pa.Array]) -> pa.Table:
    table = pa.table(columns)
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, folder / f"{name}.parquet")
    return table


def run_query(tmp_path: Path, sql: str, tables: dict[str, pa.Table], max_delay: dict[str, str]) -> tuple[list, Run]:
    """The engine's result rows, sorted, for `sql` over the declared streams `tables` (written to tmp/data)."""
    settings = {f"streams.{name}.path": str(tmp_path / "data" / f"{name}.parquet") for name in tables}
    settings |= {f"streams.{name}.max_delay": delay for name, delay in max_delay.items()}
    run = run_cluster(tmp_path, 3, {**settings, "partitioning.partitions": 4, "query.sql": sql})
    assert run.returncode == 0, run.stderr
    results = read_tables(run.out / "results")
    rows = list(zip(*(c.to_pylist() for c in results.columns)))
    return sorted(rows, key=_row_order), run


def on_time(table: pa.Table, late_rows: list[int]) -> pa.Table:
    return table.filter(pa.array([i not in late_rows for i in range(table.num_rows)]))


# -- Apache Flink: IntervalJoinITCase -------------------------------------------------------------------------------


def flink_rows(rows) -> list[str]:
    """Rows as Flink's TestingAppendSink writes them (`1,LEFT3,RIGHT6`, NULL as `null`), sorted as its test does."""
    return sorted(",".join("null" if v is None else str(v) for v in row) for row in rows)


def flink_table(folder: Path, name: str, names: tuple[str, ...], rows: list[tuple]) -> pa.Table:
    """A Flink test's collection: its tuples' fields as `names`, the one whose name is `rowtime` in ms."""
    columns = dict(zip(names, zip(*rows)))
    columns["rowtime"] = pa.array([ms * 1000 for ms in columns["rowtime"]], pa.timestamp("us", "UTC"))
    return stream_file(folder, name, columns)


ROW4 = ("a", "b", "c", "rowtime")  # (Int, Long, String, Long) and Row4WatermarkExtractor
ROW3 = ("key", "id", "rowtime")  # (String, String, Long) and Row3WatermarkExtractor2
#: the outer joins' inputs: the left's and the full join's T1, the right's and the full join's T2
L_ROWS = [("A", "L-1", 1000), ("A", "L-2", 2000), ("B", "L-4", 4000), ("B", "L-5", 5000), ("A", "L-6", 6000)]
L_ROWS += [("C", "L-7", 7000), ("A", "L-10", 10000), ("A", "L-12", 12000), ("A", "L-20", 20000)]
R_ROWS = [("A", "R-5", 5000), ("A", "R-6", 6000), ("B", "R-7", 7000), ("D", "R-8", 8000)]

#: test name -> (schema, T1's rows, T2's rows, the SQL, the expected rows as the test writes them)
FLINK = {
    "testRowTimeInnerJoinWithOtherConditions": (
        ROW4,
        [(1, 4, "LEFT1", 1000), (1, 8, "LEFT1.1", 1001), (1, 2, "LEFT2", 2000), (1, 7, "LEFT3", 3000)]
        + [(2, 5, "LEFT4", 4000), (1, 4, "LEFT4.9", 4999), (1, 4, "LEFT5", 5000), (1, 10, "LEFT6", 6000)],
        [(1, 1, "RIGHT1", 1000), (1, 9, "RIGHT6", 6000), (2, 14, "RIGHT7", 7000), (1, 4, "RIGHT8", 8000)],
        """SELECT t2.a, t1.c AS c1, t2.c AS c2
        FROM T1 as t1 JOIN T2 as t2 ON
          t1.a = t2.a AND
          t1.rowtime > t2.rowtime - INTERVAL '5' SECOND AND
            t1.rowtime < t2.rowtime - INTERVAL '1' SECOND AND
          t1.b < t2.b AND
          t1.b > 2""",
        ["1,LEFT3,RIGHT6", "1,LEFT1.1,RIGHT6", "2,LEFT4,RIGHT7", "1,LEFT4.9,RIGHT6"],
    ),
    "testRowTimeLeftOuterJoin": (
        ROW3,
        L_ROWS,
        [("A", "R-6", 6000), ("B", "R-7", 7000), ("D", "R-8", 8000), ("A", "R-11", 11000)],
        """SELECT t1.key, t2.id AS id2, t1.id AS id1
        FROM T1 AS t1 LEFT OUTER JOIN  T2 AS t2 ON
         t1.key = t2.key AND
         t1.rowtime BETWEEN t2.rowtime - INTERVAL '5' SECOND AND
         t2.rowtime + INTERVAL '6' SECOND AND
         t1.id <> 'L-5'""",
        ["A,R-6,L-1", "A,R-6,L-2", "A,R-6,L-6", "A,R-6,L-10", "A,R-6,L-12", "B,R-7,L-4", "A,R-11,L-6"]
        + ["A,R-11,L-10", "A,R-11,L-12", "B,null,L-5", "C,null,L-7", "A,null,L-20"],
    ),
    "testRowTimeRightOuterJoin": (
        ROW3,
        [row for row in L_ROWS if row[1] not in ("L-5", "L-20")],
        R_ROWS + [("A", "R-20", 20000)],
        """SELECT t2.key, t2.id AS id2, t1.id AS id1
        FROM T1 AS t1 RIGHT OUTER JOIN T2 AS t2 ON
         t1.key = t2.key AND
         t1.rowtime BETWEEN t2.rowtime - INTERVAL '5' SECOND AND
         t2.rowtime + INTERVAL '6' SECOND AND
         t2.id <> 'R-5'""",
        ["A,R-5,null", "A,R-6,L-1", "A,R-6,L-2", "A,R-6,L-6", "A,R-6,L-10", "A,R-6,L-12", "A,R-20,null"]
        + ["B,R-7,L-4", "D,R-8,null"],
    ),
    "testRowTimeFullOuterJoin": (
        ROW3,
        L_ROWS,
        R_ROWS,
        """SELECT t2.key, t2.id AS id2, t1.id AS id1
        FROM T1 AS t1 FULL OUTER JOIN T2 AS t2 ON
        t1.key = t2.key AND
        t1.rowtime BETWEEN t2.rowtime - INTERVAL '5' SECOND AND
        t2.rowtime + INTERVAL '6' SECOND AND
        NOT (t1.id = 'L-5' OR t2.id = 'R-5')""",
        ["A,R-6,L-1", "A,R-6,L-2", "A,R-6,L-6", "A,R-6,L-10", "A,R-6,L-12", "B,R-7,L-4", "A,R-5,null"]
        + ["D,R-8,null", "null,null,L-5", "null,null,L-7", "null,null,L-20"],
    ),
}


@pytest.mark.parametrize("case", list(FLINK))
def test_flink_interval_join_with_other_conditions(tmp_path, case):
    """Flink's rows, as its test writes them, and DuckDB's for the same SQL; no row is late."""
    schema, rows1, rows2, sql, expected = FLINK[case]
    tables = {name: flink_table(tmp_path / "data", name, schema, rows) for name, rows in (("T1", rows1), ("T2", rows2))}
    got, run = run_query(tmp_path, sql, tables, {"T1": "0s", "T2": "0s"})
    assert flink_rows(got) == sorted(expected)
    assert got == duckdb_query(sql, tables)
    assert run.summary["late"] == 0


# -- Apache Spark: StreamingJoinSuite ---------------------------------------------------------------------------------


def spark_stream(folder: Path, name: str, prefix: str, multiplier: int, values: list[int], text=False) -> pa.Table:
    """setupStream(prefix, multiplier) fed `values` in order: key = value, <prefix>Time = timestamp_seconds(value),
    <prefix>Value = value * multiplier (`text`: as text, its number beside it as <prefix>ValueInt), and the end of
    `window(<prefix>Time, "10 second")` in seconds as `window_end`."""
    value = [v * multiplier for v in values]
    columns = {
        "key": pa.array(values, pa.int64()),
        f"{prefix}Time": pa.array([v * 1_000_000 for v in values], pa.timestamp("us", "UTC")),
        f"{prefix}Value": pa.array([str(v) for v in value] if text else value),
        "window_end": pa.array([v // 10 * 10 + 10 for v in values], pa.int64()),
    }
    if text:
        columns[f"{prefix}ValueInt"] = pa.array(value, pa.int64())
    return stream_file(folder, name, columns)


#: the window equality of the two windowed streams, and the time bounds it implies (less than 10 s apart)
WINDOW = "l.key = r.key AND l.window_end = r.window_end"
WITHIN = "r.rightTime > l.leftTime - INTERVAL 10 SECONDS AND r.rightTime < l.leftTime + INTERVAL 10 SECONDS"


def windowed_query(join: str, condition: str, columns: str, bounds: bool = True) -> str:
    on = f"{WINDOW} AND {WITHIN} AND {condition}" if bounds else f"{WINDOW} AND {condition}"
    return f"SELECT {columns} FROM left_input l {join} right_input r ON {on}"


def test_spark_left_outer_join_with_non_key_condition_violated(tmp_path):
    """Spark's "left outer join with non-key condition violated": a left row whose pairs all fail the condition
    comes out alone though its key and window match."""
    left = spark_stream(tmp_path / "data", "left_input", "left", 2, [1, 2, 3, 20, 40, 41, 70, 101, 102, 103, 1000])
    right = [1, 2, 3, 21, 20, 40, 41, 71, 70, 101, 102, 103, 1001]
    right = spark_stream(tmp_path / "data", "right_input", "right", 3, right)
    tables = {"left_input": left, "right_input": right}
    condition = "l.leftValue > 10 AND (r.rightValue < 300 OR r.rightValue > 1000)"
    columns = "l.key, l.window_end, l.leftValue, r.rightValue"
    sql = windowed_query("LEFT OUTER JOIN", condition, columns)
    got, run = run_query(tmp_path, sql, tables, {"left_input": "10s", "right_input": "10s"})
    peer = [(1, 10, 2, None), (2, 10, 4, None), (3, 10, 6, None), (20, 30, 40, 60), (40, 50, 80, 120)]
    peer += [(41, 50, 82, 123), (70, 80, 140, 210), (101, 110, 202, None), (102, 110, 204, None)]
    peer += [(103, 110, 206, None)]
    at_end = [(1000, 1010, 2000, None)]  # Spark's test ends before its watermark passes left 1000
    assert got == sorted(peer + at_end, key=_row_order)
    without_bounds = windowed_query("LEFT OUTER JOIN", condition, columns, bounds=False)
    assert got == duckdb_query(sql, tables) == duckdb_query(without_bounds, tables)
    assert run.summary["late"] == 0


#: setupWindowedJoinWith{Left,Right}Condition: the inputs, the condition
SETUPS = {
    "left": ([1, 2, 3, 20], [3, 4, 5, 21, 20], "l.leftValue > 4"),
    "right": ([3, 4, 5, 20], [1, 2, 3, 21, 20], "r.rightValueInt > 7"),  # $"rightValue".cast("int") > 7
}
#: join type -> (the JOIN, the peer's select)
SELECTS = {
    "left_outer": ("LEFT OUTER JOIN", "l.key, l.window_end, l.leftValue, r.rightValue"),
    "right_outer": ("RIGHT OUTER JOIN", "r.key, r.window_end, l.leftValue, r.rightValue"),
    "full_outer": (
        "FULL OUTER JOIN",
        "l.key AS left_key, l.window_end AS left_end, l.leftValue, r.key AS right_key, r.window_end AS right_end,"
        " r.rightValue",
    ),
    "left_semi": ("LEFT SEMI JOIN", "l.key, l.window_end, l.leftValue"),
}
#: (condition's side, join type) -> (the test, its rows, the rows after its last step: right 21 has no partner)
EARLY_EXCLUSION = {
    ("left", "left_outer"): (
        "left outer early state exclusion on left",
        [(3, 10, 6, "9"), (1, 10, 2, None), (2, 10, 4, None), (20, 30, 40, "60")],
        [],
    ),
    ("right", "left_outer"): (
        "left outer early state exclusion on right",
        [(3, 10, 6, "9"), (4, 10, 8, None), (5, 10, 10, None), (20, 30, 40, "60")],
        [],
    ),
    ("left", "right_outer"): (
        "right outer early state exclusion on left",
        [(3, 10, 6, "9"), (4, 10, None, "12"), (5, 10, None, "15"), (20, 30, 40, "60")],
        [(21, 30, None, "63")],
    ),
    ("right", "right_outer"): (
        "right outer early state exclusion on right",
        [(3, 10, 6, "9"), (1, 10, None, "3"), (2, 10, None, "6"), (20, 30, 40, "60")],
        [(21, 30, None, "63")],
    ),
    ("left", "full_outer"): (
        "full outer early state exclusion on left",
        [(1, 10, 2, None, None, None), (2, 10, 4, None, None, None), (3, 10, 6, 3, 10, "9")]
        + [(None, None, None, 4, 10, "12"), (None, None, None, 5, 10, "15"), (20, 30, 40, 20, 30, "60")],
        [(None, None, None, 21, 30, "63")],
    ),
    ("right", "full_outer"): (
        "full outer early state exclusion on right",
        [(None, None, None, 1, 10, "3"), (None, None, None, 2, 10, "6"), (3, 10, 6, 3, 10, "9")]
        + [(4, 10, 8, None, None, None), (5, 10, 10, None, None, None), (20, 30, 40, 20, 30, "60")],
        [(None, None, None, 21, 30, "63")],
    ),
    ("left", "left_semi"): ("left semi early state exclusion on left", [(3, 10, 6), (20, 30, 40)], []),
    ("right", "left_semi"): ("left semi early state exclusion on right", [(3, 10, 6), (20, 30, 40)], []),
}


@pytest.mark.parametrize("side, join_type", list(EARLY_EXCLUSION), ids=[v[0] for v in EARLY_EXCLUSION.values()])
def test_spark_early_state_exclusion(tmp_path, side, join_type):
    """A condition on one stream in ON: rows of that stream that fail it are no one's partner, and come out alone
    where the join keeps them."""
    lefts, rights, condition = SETUPS[side]
    tables = {
        "left_input": spark_stream(tmp_path / "data", "left_input", "left", 2, lefts),
        "right_input": spark_stream(tmp_path / "data", "right_input", "right", 3, rights, text=True),
    }
    join, columns = SELECTS[join_type]
    sql = windowed_query(join, condition, columns)
    _, peer, at_end = EARLY_EXCLUSION[side, join_type]
    got, run = run_query(tmp_path, sql, tables, {"left_input": "10s", "right_input": "10s"})
    assert got == sorted(peer + at_end, key=_row_order)
    without_bounds = windowed_query(join, condition, columns, bounds=False)
    assert got == duckdb_query(sql, tables) == duckdb_query(without_bounds, tables)
    assert run.summary["late"] == 0


def range_streams(folder: Path, lefts: list[tuple], rights: list[tuple]) -> dict[str, pa.Table]:
    """The time-range tests' streams: (key, time) tuples as (<side>Key, <side>Time = timestamp_seconds(time),
    <side>Value = key * 2 or 3)."""

    def table(name, side, multiplier, rows):
        keys, times = zip(*rows)
        columns = {
            f"{side}Key": pa.array(keys, pa.int64()),
            f"{side}Time": pa.array([t * 1_000_000 for t in times], pa.timestamp("us", "UTC")),
            f"{side}Value": pa.array([k * multiplier for k in keys], pa.int64()),
        }
        return stream_file(folder, name, columns)

    return {
        "left_input": table("left_input", "left", 2, lefts),
        "right_input": table("right_input", "right", 3, rights),
    }


def seconds(rows: list[tuple]) -> list[tuple]:
    """The peer's `$"...Time".cast("int")`: timestamps as whole seconds."""
    return [tuple(int(v.timestamp()) if isinstance(v, dt.datetime) else v for v in row) for row in rows]


#: test -> (left's rows, right's rows, the ON, the ON as the peer says it, max_delay per stream, the rows Spark
#: drops as late by (stream, place), the peer's rows)
TIME_RANGE = {
    "stream stream inner join with time range - with watermark - one side condition": (
        [(1, 5), (1, 3), (1, 30), (1, 20), (1, 21)],
        [(1, 11), (1, 10), (0, 30), (1, 20), (1, 21), (1, 28)],
        # the peer's one bound, and a far end a streaming join needs (no pair of these rows is an hour apart)
        "l.leftKey = r.rightKey AND l.leftTime < r.rightTime - interval 5 seconds"
        " AND l.leftTime > r.rightTime - interval 1 hour",
        "l.leftKey = r.rightKey AND l.leftTime < r.rightTime - interval 5 seconds",
        # both with watermark 10 s; Spark drops the 20 s rows when both streams have reached 30 s
        {"left_input": "9.5s", "right_input": "9.5s"},
        {"left_input": [3], "right_input": [3]},
        [(1, 5, 11), (1, 3, 10), (1, 3, 11), (1, 3, 21), (1, 5, 21), (1, 3, 28), (1, 5, 28), (1, 21, 28)],
    ),
    "stream stream inner join with time range - with watermark - two side conditions": (
        [(1, 20), (1, 49), (1, 50), (1, 65), (1, 66), (1, 30), (1, 31)],
        [(1, 14), (1, 15), (1, 25), (1, 26), (1, 30), (1, 31), (1, 60), (1, 80), (1, 46), (1, 50)],
        "l.leftKey = r.rightKey AND"
        " l.leftTime BETWEEN r.rightTime - interval 10 seconds AND r.rightTime + interval 5 seconds",
        None,
        # watermarks 20 s (left) and 30 s (right), the global one their least: Spark drops left 30 (global 30)
        # and right 46 (global 46); each stream's own largest time then is 66 and 80
        {"left_input": "35.5s", "right_input": "32s"},
        {"left_input": [5], "right_input": [8]},
        [(1, 20, 15), (1, 20, 25), (1, 20, 26), (1, 20, 30), (1, 50, 60), (1, 65, 60), (1, 31, 26), (1, 31, 30)]
        + [(1, 31, 31), (1, 49, 50), (1, 50, 50)],
    ),
}


@pytest.mark.parametrize("case", list(TIME_RANGE))
def test_spark_inner_join_with_time_range(tmp_path, case):
    """The time-range cases: an open bound, asymmetric bounds, and the rows Spark's watermark drops late here
    too."""
    lefts, rights, on, peer_on, max_delay, late, peer = TIME_RANGE[case]
    tables = range_streams(tmp_path / "data", lefts, rights)
    sql = f"SELECT l.leftKey, l.leftTime, r.rightTime FROM left_input l JOIN right_input r ON {on}"
    got, run = run_query(tmp_path, sql, tables, max_delay)
    assert seconds(got) == sorted(peer, key=_row_order)
    kept = {name: on_time(table, late[name]) for name, table in tables.items()}
    assert got == duckdb_query(sql, kept)
    if peer_on:
        assert got == duckdb_query(sql.replace(on, peer_on), kept)
    # late here: the rows Spark's test drops, each named by its stream and its place in the stream's file
    late_here = {(row["stream"], row[f"{row['stream']}_row"]) for row in read_tables(run.out / "late").to_pylist()}
    assert late_here == {(name, place) for name, places in late.items() for place in places}
