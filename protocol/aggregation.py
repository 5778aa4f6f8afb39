"""What `[aggregate]` asks: the view's groups, window and measures over the results' own columns (declared
streams' `[streams.NAME]` columns, or the single file's r_key, s_ts, r_value, ...), for phase one
(slave.aggregate) and the merger (control.aggregate) alike.

A measure is `count` or `FN(column)` with FN one of sum, min, max, avg, count_distinct.  Partials carry only
what merges exactly: the row count, and per column its sum, its count of values (not null: avg = sum / that),
min, max and its distinct values (count_distinct, exact: the sets are merged, then counted).
Pure, no pyarrow at import: Spark's workers and the config read it.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from protocol import eventtime
from protocol.predicates import time_bounds

FUNCTIONS = ("sum", "min", "max", "avg", "count_distinct")
#: the partial columns a measure of each function needs, by prefix (nn: the count of values, not null;
#: distinct: the distinct values, not null, as a list)
NEEDS = {"sum": ("sum",), "min": ("min",), "max": ("max",), "avg": ("sum", "nn"), "count_distinct": ("distinct",)}
#: a measure as written: `count`, or `fn(column)`
_MEASURE = re.compile(r"^\s*([a-z_]+)\s*(?:\(\s*(.+?)\s*\))?\s*$")
#: the view's window bounds and the partials' window start (int64 microseconds)
WINDOW_START, WINDOW_END = "window_start", "window_end"
COUNT, KIND, FINAL = "count", "kind", "final"
#: a partial file's stamp, one row besides its groups' (theirs null): the slave's rank, the file's number, 1
#: (files merged add up), the watermark of the last batch in it and the number of slaves (all int64)
RANK, FILE, FILES, WATERMARK, SLAVES = "__rank", "__file", "__files", "__watermark", "__slaves"
STAMP = (RANK, FILE, FILES, WATERMARK, SLAVES)


class Measure(NamedTuple):
    fn: str  #: "count", "sum", "min", "max" or "avg"
    column: str | None  #: None for count

    @property
    def name(self) -> str:
        """The view's column: `count`, `sum_<column>`, ..."""
        return self.fn if self.column is None else f"{self.fn}_{self.column}"


def parse_measure(text: str, error: type[Exception]) -> Measure:
    m = _MEASURE.match(text) if isinstance(text, str) else None
    if m and m.group(1) == "count" and m.group(2) is None:
        return Measure("count", None)
    if not m or m.group(1) not in FUNCTIONS or m.group(2) is None:
        raise error(
            f"aggregate.measures: {text!r} is not a measure: write count, sum(COLUMN), min(COLUMN), "
            "max(COLUMN), avg(COLUMN) or count_distinct(COLUMN) over a result column"
        )
    return Measure(m.group(1), m.group(2))


class Aggregation(NamedTuple):
    """`[aggregate]` of a run, resolved to result columns."""

    groups: tuple[str, ...]  #: the view's group columns, as results name them (TOML: `kind` too outside inner joins)
    times: tuple[str, ...]  #: the time columns whose latest (not null) is a row's time
    window: int  #: microseconds; 0 = no window
    slide: int  #: microseconds between two windows' starts (= window: tumbling)
    measures: tuple[Measure, ...]
    #: how far below the watermark that decides it a row's time may lie (microseconds): a window is final
    #: once every slave's watermark is past its end by this; None: only once the run has ended
    reach: int | None

    @property
    def parts(self) -> tuple[tuple[str, str, str], ...]:
        """The partials' measure columns: (name, pyarrow's hash function in phase one, column), each once."""
        seen = {}
        for m in self.measures:
            for prefix in NEEDS.get(m.fn, ()):
                name = f"{prefix}_{m.column}"
                seen.setdefault(name, (name, {"nn": "count"}.get(prefix, prefix), m.column))
        return tuple(seen.values())

    @property
    def keys(self) -> list[str]:
        """What partials are grouped by."""
        return [*self.groups, *([WINDOW_START] if self.window else [])]


def result_column(spec: dict, column: str) -> str:
    return spec["prefix"] + column


#: the single file's result columns of each side's key and time (its times are float64 seconds)
FILE_SIDES = ((["r_key"], "r_ts"), (["s_key"], "s_ts"))


def sides(cfg: dict) -> tuple[tuple[list[str], str], ...]:
    """R's and S's key column(s) and time column, as results name them."""
    if not cfg.get("streams"):
        return FILE_SIDES
    return tuple(
        ([result_column(s, k) for k in s["key"]], result_column(s, s["time"])) for s in cfg["streams"].values()
    )


def measures_of(cfg: dict) -> list[str]:
    """`aggregate.measures`; the single file's default (["count"]) is its `value`'s count, sum, min, max and
    average, the view an `[aggregate]` of the single file always had."""
    agg = cfg["aggregate"]
    if cfg.get("streams") or agg["measures"] != ["count"]:
        return agg["measures"]
    return ["count", *(f"{fn}({agg['value']})" for fn in ("sum", "min", "max", "avg"))]


def aggregation(cfg: dict) -> Aggregation:
    """The `[aggregate]` of a config (checked: protocol.config), in result columns."""
    agg, both = cfg["aggregate"], sides(cfg)
    by = agg["group_by"]
    if by in ("key", "r_key", "s_key"):  # the join key: one side's key column(s)
        by = both[1 if by == "s_key" else 0][0]
    groups = [by] if isinstance(by, str) else list(by)
    if cfg["join"]["type"] != "inner" and KIND not in groups and not cfg["query"]["sql"]:
        groups.append(KIND)  # the TOML form's view keeps rows alone apart; a query's groups are its GROUP BY's
    times = (agg["time"],) if agg["time"] else tuple(time for _, time in both)
    window = eventtime.duration(agg["window"])
    slide = eventtime.duration(agg["slide"]) or window
    measures = tuple(dict.fromkeys(parse_measure(m, ValueError) for m in measures_of(cfg)))
    # a slave's watermark bounds its own future rows (a pair's time from its fresher tuple, a row alone from
    # the bound that decides it, the other side's time by the bounds; a moved group's by the move's floor,
    # slave.aggregate.ColumnAggregator.installed); a hot key's grid brings it rows its watermark does not bound
    lower, upper = time_bounds(cfg["join"])
    stream_times = {time for _, time in both}
    reach = None if cfg["hotkeys"]["enabled"] or not set(times) <= stream_times else max(0, upper, -lower) + 1
    return Aggregation(tuple(groups), times, window, slide, measures, reach)


def check(cfg: dict, error: type[Exception]) -> None:
    """The `[aggregate]` keys: groups, measures, window, slide; the single file's columns, known before the run,
    too (declared streams' once their files or schemas are read: `check_columns`).  Checked on or off: the view
    they say is also control.aggregate's, which merges a run's partials."""
    agg = cfg["aggregate"]
    by = agg["group_by"]
    if not isinstance(by, (str, list)) or not all(
        isinstance(c, str) and c for c in ([by] if isinstance(by, str) else by)
    ):
        raise error(f"aggregate.group_by: a result column or a list of them, got {by!r}")
    if not isinstance(agg["measures"], list) or not agg["measures"]:
        raise error(
            f'aggregate.measures: a list of measures, e.g. ["count", "sum(clicks_cost)"], got {agg["measures"]!r}'
        )
    for m in agg["measures"]:
        parse_measure(m, error)
    if agg["slide"] and not agg["window"]:
        raise error("aggregate.slide: needs aggregate.window (hopping windows of that length)")
    window, slide = eventtime.duration(agg["window"]), eventtime.duration(agg["slide"])
    if agg["slide"] and not 0 < slide <= window:
        raise error(
            f"aggregate.slide: must be at least a microsecond and at most aggregate.window, got {agg['slide']!r}"
        )
    spec = aggregation(cfg)
    names = [*spec.keys, *([WINDOW_END] if spec.window else []), COUNT, FINAL]
    names += [m.name for m in spec.measures if m.fn != "count"]
    if len(set(names)) < len(names):
        raise error(f"aggregate.group_by: the view's columns would repeat a name: {names}")
    if not cfg.get("streams"):
        from protocol.output import result_schema

        check_columns(spec, result_schema(cfg["join"]["type"]), error, seconds=tuple(t for _, t in FILE_SIDES))


def check_columns(spec: Aggregation, schema, error: type[Exception], seconds: tuple[str, ...] = ()) -> None:
    """Once the results' columns are known (a pyarrow schema): every named column is there, times are
    timestamps (or among `seconds`: the single file's r_ts and s_ts, float64 seconds), and measures are over
    numbers or decimals."""
    import pyarrow as pa

    def field(column: str, key: str):
        if column not in schema.names:
            raise error(f"aggregate.{key}: {column!r} is not a result column (they are {', '.join(schema.names)})")
        return schema.field(column).type

    for c in spec.groups:
        field(c, "group_by")
    for c in spec.times if spec.window else ():
        if not pa.types.is_timestamp(field(c, "time")) and c not in seconds:
            raise error(f"aggregate.time: {c!r} is {schema.field(c).type}, not a timestamp")
    for m in spec.measures:
        if m.column is not None:
            t = field(m.column, "measures")
            if m.fn == "count_distinct":
                if pa.types.is_nested(t):
                    raise error(
                        f"aggregate.measures: {m.fn}({m.column}): the column is {t}, whose values are not compared"
                    )
            elif not (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t)):
                raise error(f"aggregate.measures: {m.fn}({m.column}): the column is {t}, not a number or a decimal")
