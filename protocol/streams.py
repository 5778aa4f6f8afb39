"""Two streams declared in the config, one `[streams.NAME]` table each (docs/input.md, "Two streams").

Each names its files (a file, a glob or a folder of CSV, Parquet or JSON-lines), its key column(s), its
event-time column and optionally an id column; the first declared is R unless `side` says otherwise.  The
config keeps them as `cfg["streams"]`, an ordered {name: settings} with R first, and `source.kind` becomes
"streams"; master.sources.streams reads them side by side.  Pure checks, no pyarrow: Spark's workers read configs.
"""
from __future__ import annotations

from typing import Any

from protocol.durations import parse_duration
from protocol.eventtime import DURATION_LIMIT, PER_SECOND, UNITS

#: key -> (default, description); None = required
STREAM_KEYS: dict[str, tuple[Any, str]] = {
    "path": ("", "a file, a glob (`data/*.csv`) or a folder of CSV, Parquet or JSON-lines files, read in name order "
                 "(this or `endpoint`)"),
    "endpoint": ("", "a live stream instead of files: the ZeroMQ endpoint its producers push Arrow record batches "
                     "to (`python -m control.produce --stream`); needs `schema`"),
    "producers": (1, "with endpoint: the stream ends after this many producers sent their END"),
    "schema": ({}, 'with endpoint: its columns and their Arrow types, e.g. {user_id = "string", at = '
                   '"timestamp[ms, tz=UTC]", cost = "double", price = "decimal128(12, 2)"}'),
    "key": (None, "the join key: a column, or a list of columns (a composite key); integers, strings or binary"),
    "time": (None, "the event-time column: a timestamp (any unit, any zone), ISO-8601 text, or numbers in `time_unit`"),
    "time_unit": ("s", 'the unit of numbers in the time column: "s", "ms", "us" or "ns"'),
    "id": ("", "an integer id column, unique within the stream; \"\" = rows numbered by their position in the stream "
               "(0, 1, ...)"),
    "side": ("", '"R" or "S"; "" = the first stream declared is R, the second S'),
    "max_delay": ("", "this stream's allowed out-of-orderness (a duration): a tuple more than this behind the largest "
                      'earlier time of its own stream is late; "" = `join.max_delay`'),
    "idle_timeout": (0.0, "wall-clock time (a duration) without a tuple of this stream after which it stops holding "
                          "the join's watermark back, until its next tuple (Flink's `withIdleness`; 0 = never idle)"),
    "payload": ("*", 'the columns results carry besides key, time and id: "*" = every other column of the files, '
                     "or a list of column names ([] = none)"),
    "prefix": ("{stream}_", "what the stream's columns are named with in results and late rows; {stream} is the "
                            "stream's name (\"\" = the columns' own names)"),
}
SIDES = ("R", "S")


def set_key(streams: dict, name: str, value: Any, error: type[Exception]) -> None:
    """`--set streams.NAME.KEY=value`: one key of one stream's table."""
    stream, _, key = name.partition(".")
    if not stream or not key:
        raise error(f"--set streams.{name}: expected streams.NAME.KEY=value")
    streams.setdefault(stream, {})[key] = value


def declared(streams: dict, source: dict, join: dict, error: type[Exception]) -> dict[str, dict]:
    """The `[streams.*]` tables checked and completed, R first ({} when none); sets source.kind to
    "streams" when there are some.  A stream's `max_delay` left out is `join`'s.  `error`
    (protocol.config.ConfigError) names the key."""
    if not isinstance(streams, dict):
        raise error("streams: must be tables [streams.NAME], one per stream")
    if not streams:
        if source["kind"] == "streams":
            raise error('source.kind = "streams" needs two [streams.NAME] tables (docs/input.md)')
        return {}
    if source["kind"] not in ("generator", "streams"):
        raise error(f'source.kind = "{source["kind"]}" and [streams.*] tables: use one or the other '
                    '(remove source.kind, or set it to "streams")')
    if len(streams) != 2:
        raise error(f"[streams.*]: a join takes two streams, got {len(streams)} ({', '.join(streams) or 'none'})")
    out = {name: _one(name, table, join, error) for name, table in streams.items()}
    sides = [s["side"] for s in out.values()]
    if sides[0] == sides[1] != "":
        raise error(f"streams.{list(out)[1]}.side: both streams are {sides[0]!r}; one must be R, the other S")
    if sides[0] == "S" or sides[1] == "R":
        out = dict(reversed(list(out.items())))
    for (name, s), side in zip(out.items(), SIDES):
        s["side"] = side
    lengths = {name: len(s["key"]) for name, s in out.items()}
    if len(set(lengths.values())) > 1:
        raise error(f"streams.*.key: both streams need as many key columns, got {lengths}")
    source["kind"] = "streams"
    return out


def _one(name: str, table: Any, join: dict, error: type[Exception]) -> dict:
    if not isinstance(table, dict):
        raise error(f"streams.{name}: must be a table [streams.{name}] of keys ({', '.join(STREAM_KEYS)})")
    unknown = [k for k in table if k not in STREAM_KEYS]
    if unknown:
        raise error(f"unknown key streams.{name}.{unknown[0]} (known: {', '.join(STREAM_KEYS)})")
    s = {k: table.get(k, default) for k, (default, _) in STREAM_KEYS.items()}
    for k, v in s.items():
        if v is None:
            raise error(f"streams.{name}.{k}: required ({STREAM_KEYS[k][1]})")
    key = [s["key"]] if isinstance(s["key"], str) else s["key"]
    if not isinstance(key, list) or not key or not all(isinstance(c, str) and c for c in key) \
            or len(set(key)) < len(key):
        raise error(f"streams.{name}.key: expected a column name or a list of distinct column names, got {s['key']!r}")
    s["key"] = key
    for k in ("path", "endpoint", "time", "time_unit", "id", "side", "prefix"):
        if not isinstance(s[k], str):
            raise error(f"streams.{name}.{k}: expected a string, got {s[k]!r}")
    if not s["time"]:
        raise error(f"streams.{name}.time: must not be empty")
    if bool(s["path"]) == bool(s["endpoint"]):
        raise error(f"streams.{name}: give it a path (files) or an endpoint (live producers), "
                    f"{'not both' if s['path'] else 'one of them'}")
    if not isinstance(s["producers"], int) or isinstance(s["producers"], bool) or s["producers"] < 1:
        raise error(f"streams.{name}.producers: expected a positive integer, got {s['producers']!r}")
    if not isinstance(s["schema"], dict) or not all(isinstance(t, str) for t in s["schema"].values()):
        raise error(f"streams.{name}.schema: expected a table of column = \"Arrow type\", got {s['schema']!r}")
    if s["endpoint"]:
        missing = [c for c in [*key, s["time"], *([s["id"]] if s["id"] else [])] if c not in s["schema"]]
        if missing:
            raise error(f"streams.{name}.schema: a live stream declares its columns with their types; "
                        f"missing {', '.join(missing)}")
    elif s["schema"]:
        raise error(f"streams.{name}.schema: only for a live stream (endpoint): files carry their own schema")
    if s["time_unit"] not in UNITS:
        raise error(f"streams.{name}.time_unit: must be one of {', '.join(map(repr, UNITS))}, got {s['time_unit']!r}")
    if s["side"] not in ("", *SIDES):
        raise error(f"streams.{name}.side: must be \"R\" or \"S\", got {s['side']!r}")
    if s["max_delay"] == "":
        s["max_delay"] = join["max_delay"]
    for k in ("max_delay", "idle_timeout"):
        s[k] = _duration(f"streams.{name}.{k}", s[k], error)
    used = [*key, s["time"], *([s["id"]] if s["id"] else [])]
    if len(set(used)) < len(used):
        raise error(f"streams.{name}: key, time and id must be different columns, got {used}")
    if s["payload"] != "*" and (not isinstance(s["payload"], list)
                                or not all(isinstance(c, str) and c for c in s["payload"])):
        raise error(f'streams.{name}.payload: expected "*" or a list of column names, got {s["payload"]!r}')
    s["prefix"] = s["prefix"].replace("{stream}", name)
    return s


def _duration(name: str, value: Any, error: type[Exception]) -> float:
    """A duration key's value in float seconds (text such as "5s" or a number), finite, >= 0 and below
    protocol.eventtime.DURATION_LIMIT."""
    if isinstance(value, str):
        try:
            value = parse_duration(value)
        except ValueError as e:
            raise error(f"{name}: {e}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < DURATION_LIMIT // PER_SECOND:
        raise error(f"{name}: expected a duration >= 0 and below {DURATION_LIMIT // PER_SECOND} seconds "
                    f'(a number of seconds or text such as "5s"), got {value!r}')
    return float(value)


def reference() -> list[str]:
    """The [streams.NAME] part of docs/configuration.md."""
    lines = ["", "## [streams.NAME]", "",
             "Two tables, one per stream, named as you like (`[streams.impressions]`, `[streams.clicks]`); with them "
             '`source.kind` is "streams" (docs/input.md). Override one key with `--set streams.NAME.KEY=value`.', "",
             "| key | default | meaning |", "|---|---|---|"]
    for key, (default, meaning) in STREAM_KEYS.items():
        shown = "required" if default is None else f'`"{default}"`' if isinstance(default, str) else f"`{default}`"
        lines.append(f"| `streams.NAME.{key}` | {shown} | {meaning} |")
    return lines


def live_endpoints(cfg: dict) -> list[str]:
    """The config keys of the live inputs a run binds (producers push to them): `source.endpoint` of a ZeroMQ
    source, `streams.NAME.endpoint` of live declared streams."""
    return ["source.endpoint"] * (cfg["source"]["kind"] == "zmq") + [
        f"streams.{n}.endpoint" for n, spec in cfg.get("streams", {}).items() if spec["endpoint"]]
