"""Two streams declared in the config, one `[streams.NAME]` table each (docs/input.md, "Two streams").

Each names its files (a file, a glob or a folder of CSV, Parquet or JSON-lines), a ZeroMQ endpoint its producers
push to, or a Kafka topic (`kafka`), then its key column(s), its event-time column and optionally an id column;
the first declared is R unless `side` says otherwise.  The validated config keeps them as its `streams` table, an
ordered {name: settings} with R first, and `source.kind` becomes "streams"; the plan (protocol.plan) types them,
and master.sources.streams reads them side by side.  The Kafka result sink's table, `[output.kafka]`
(`kafka_sink`), is here too: it shares the librdkafka settings' rules with a stream's `kafka` table.  Pure
checks, no pyarrow: Spark's workers read configs.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from protocol.durations import parse_duration
from protocol.eventtime import DURATION_LIMIT, PER_SECOND, UNITS

#: key -> (default, description); None = required
STREAM_KEYS: dict[str, tuple[Any, str]] = {
    "path": (
        "",
        "a file, a glob (`data/*.csv`) or a folder of CSV, Parquet or JSON-lines files, read in name order "
        "(this, `endpoint` or `kafka`)",
    ),
    "endpoint": (
        "",
        "a live stream instead of files: the ZeroMQ endpoint its producers push Arrow record batches "
        "to (`python -m control.produce --stream`); needs `schema`; dispatcher i of several binds its port + i "
        "(ack_endpoint's too) for its own producers",
    ),
    "producers": (1, "with endpoint: the stream ends after this many producers sent their END (per dispatcher)"),
    "ack_endpoint": (
        "",
        "with endpoint and checkpoints: where the master publishes what each checkpoint made durable per "
        "producer of the stream, so producers resend after a crash (`control.produce --stream --ack-endpoint`; "
        '"" = none)',
    ),
    "kafka": (
        {},
        "a Kafka topic instead of files: a table of the `streams.NAME.kafka.*` keys below "
        "(docs/input.md#kafka-topics); needs `schema`",
    ),
    "schema": (
        {},
        'with endpoint or kafka: its columns and their Arrow types, e.g. {user_id = "string", at = '
        '"timestamp[ms, tz=UTC]", cost = "double", price = "decimal128(12, 2)"}; with CSV files: the types of '
        "some of their columns, applied by the CSV reader (decimals stay exact; the others as pyarrow infers "
        "them; refused for Parquet and JSON-lines files, which carry their own types)",
    ),
    "time_format": (
        "",
        "with CSV files: how the text of the columns `schema` declares as timestamps is written, a strptime "
        'format ("%d/%m/%Y %H:%M:%S") or a list of them tried in order; "" = ISO-8601',
    ),
    "key": (None, "the join key: a column, or a list of columns (a composite key); integers, strings or binary"),
    "time": (None, "the event-time column: a timestamp (any unit, any zone), ISO-8601 text, or numbers in `time_unit`"),
    "time_unit": ("s", 'the unit of numbers in the time column: "s", "ms", "us" or "ns"'),
    "id": (
        "",
        'an integer id column, unique within the stream; "" = rows numbered by their position in the stream '
        "(0, 1, ...)",
    ),
    "side": ("", '"R" or "S"; "" = the first stream declared is R, the second S'),
    "max_delay": (
        "",
        "this stream's allowed out-of-orderness (a duration): a tuple more than this behind the largest "
        'earlier time of its own stream (a Kafka stream: of its own partition) is late; "" = '
        "`join.max_delay`",
    ),
    "idle_timeout": (
        0.0,
        "wall-clock time (a duration) without a tuple of this stream after which it stops holding "
        "the join's watermark back, until its next tuple (Flink's `withIdleness`; 0 = never idle); "
        "a Kafka stream's partitions too",
    ),
    "payload": (
        "*",
        'the columns results carry besides key, time and id: "*" = every other column of the files, '
        "or a list of column names ([] = none)",
    ),
    "prefix": (
        "{stream}_",
        "what the stream's columns are named with in results and late rows; {stream} is the "
        "stream's name (\"\" = the columns' own names)",
    ),
}
SIDES = ("R", "S")
#: the single file's columns (`source.kind = "file"`): the side (R or S), id, time, key, and the optional value
FILE_COLUMNS = ("stream", "id", "ts", "key", "value")
#: the ways a stream comes in: exactly one of them per stream
INPUTS = ("path", "endpoint", "kafka")
#: the keys of a stream's `kafka` table: key -> (default, description); None = required
KAFKA_KEYS: dict[str, tuple[Any, str]] = {
    "bootstrap": (None, 'the Kafka cluster: "host:port", or several comma-separated'),
    "topic": (
        "",
        "a topic, or a list of topics read as one stream: every partition, assigned explicitly (no "
        "consumer-group rebalancing), read from its beginning",
    ),
    "pattern": (
        "",
        "instead of `topic`: a regular expression; the topics whose whole name matches it when the run first "
        "starts are read (a recovery reads the checkpoint's), topics made later are not",
    ),
    "group": (
        "",
        "the consumer group under which the positions the stream has handed on (with checkpoints: each complete "
        'checkpoint\'s) are committed, for monitoring only (nothing resumes from them); "" = "streamjoin-NAME"',
    ),
    "config": (
        {},
        'librdkafka client settings passed through, e.g. {"security.protocol" = "SASL_SSL"}; values are never printed; '
        'a value "${env:NAME}" or "${file:PATH}" is read from that environment variable or file as the client starts',
    ),
    "bounded": (
        False,
        "true: the stream ends at each partition's end offset as read when the run starts; false: it "
        "never ends (the run ends on a stop signal)",
    ),
    "on_lost": (
        "stop",
        '"stop": records deleted at the broker before the stream read them (retention, DeleteRecords; a recovery\'s '
        "checkpointed offset below a partition's first record) end the run with exit 8, naming topic, partition and "
        'offsets; "skip": the partition goes on from its first record still there, the lost records counted per '
        "partition in summary.json and the metrics; a recovery's offset beyond a partition's end (the broker lost "
        'records the stream had read) is exit 8 too, and with "skip" reads on from the end (summary.json\'s '
        "`rewound`)",
    ),
    "format": (
        "json",
        '"json": each record\'s value is one JSON object; "csv": one CSV line, its cells in the order of `schema`; '
        '"avro": one Avro datum of the record schema in `avro_schema`',
    ),
    "avro_schema": ("", 'with format = "avro": the path of the writer\'s schema (an .avsc file of an Avro record)'),
    "registry_header": (
        False,
        'with format = "avro": true when each value starts with the Confluent Schema Registry\'s 5-byte header '
        "(magic byte 0, schema id), which is skipped",
    ),
    "select": (
        {},
        'one topic for both streams: {column = "type", value = "click"} takes the records whose value\'s `column` '
        "is `value`; the other stream names the same topic and column with its own value",
    ),
}
#: the value formats of a Kafka stream (master.sources.kafka_values)
KAFKA_FORMATS = ("json", "csv", "avro")
#: the keys of `[output.kafka]`, the result sink (docs/output.md#the-kafka-result-sink): key -> (default, description)
SINK_KEYS: dict[str, tuple[Any, str]] = {
    "topic": ("", 'the topic every result row is produced to ("" = no Kafka sink); it must exist'),
    "bootstrap": ("", 'the Kafka cluster: "host:port", or several comma-separated; required with `topic`'),
    "config": (
        {},
        'librdkafka producer settings passed through, e.g. {"security.protocol" = "SASL_SSL"}; values are never '
        "printed",
    ),
    "format": ("json", "\"json\": each record's value is one JSON object of the result row's columns"),
    "marker_topic": (
        "",
        'with checkpoints: where each transaction\'s commit marker goes ("" = TOPIC.streamjoin-markers; made '
        "with one partition if missing)",
    ),
    "timeout": (
        60.0,
        "how long (a duration) the broker may stay unreachable or refuse rows before the job ends (exit 7)",
    ),
}
#: librdkafka settings the sink sets itself (its exactness depends on them)
SINK_OWN = (
    "bootstrap.servers",
    "transactional.id",
    "enable.idempotence",
    "acks",
    "transaction.timeout.ms",
    "message.timeout.ms",
    "queue.buffering.max.messages",
    "queue.buffering.max.kbytes",
)
#: the columns a Kafka stream's records carry besides their values' fields, with their Arrow types: usable as key,
#: time, id or payload columns, never declared in `schema`
KAFKA_COLUMNS = {"@topic": "string", "@partition": "int32", "@offset": "int64", "@timestamp": "timestamp[ms, tz=UTC]"}
#: librdkafka settings the stream sets itself (its reading depends on them)
KAFKA_OWN = ("bootstrap.servers", "group.id", "enable.partition.eof", "enable.auto.offset.store", "auto.offset.reset")
#: what a stream does when records it had not read were deleted at the broker (KAFKA_KEYS' `on_lost`)
ON_LOST = ("stop", "skip")


def set_key(streams: dict, name: str, value: Any, error: type[Exception]) -> None:
    """`--set streams.NAME.KEY=value`: one key of one stream's table (`kafka.KEY` and `kafka.config.SETTING`:
    one key of its kafka table)."""
    stream, _, key = name.partition(".")
    if not stream or not key:
        raise error(f"--set streams.{name}: expected streams.NAME.KEY=value")
    table = streams.setdefault(stream, {})
    inner, _, sub = key.partition(".")
    if inner == "kafka" and sub:
        kafka = table.setdefault("kafka", {})
        setting, _, rest = sub.partition(".")
        table, key = (kafka.setdefault("config", {}), rest) if setting == "config" and rest else (kafka, sub)
    table[key] = value


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
        raise error(
            f'source.kind = "{source["kind"]}" and [streams.*] tables: use one or the other '
            '(remove source.kind, or set it to "streams")'
        )
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
    _one_topic(out, error)
    lengths = {name: len(s["key"]) for name, s in out.items()}
    if len(set(lengths.values())) > 1:
        raise error(f"streams.*.key: both streams need as many key columns, got {lengths}")
    source["kind"] = "streams"
    return out


def file_streams(source: dict, join: dict) -> dict[str, dict]:
    """The single file (`source.kind = "file"`, docs/input.md) declared as two streams: R and S are the rows of
    the one file `source.path` whose column `stream` says R or S (`select`, as two streams share a Kafka topic),
    key `key`, time `ts` (numbers in `source.ts_unit`), id `id` and payload `value`, named r_* and s_* in results.
    Both come in one arrival order, the file's rows, under one watermark (`join.max_delay` over both streams, as the
    single file always was): master.sources.streams reads them with one reader, no merge, no payload log."""
    base = {k: default for k, (default, _) in STREAM_KEYS.items()}
    column, id_, time, key, value = FILE_COLUMNS
    return {
        side: base
        | {
            "path": source["path"],
            "key": [key],
            "time": time,
            "time_unit": source["ts_unit"],
            "id": id_,
            "side": side,
            "max_delay": join["max_delay"],
            "payload": [value],
            "prefix": f"{side.lower()}_",
            "select": {"column": column, "value": side},
        }
        for side in SIDES
    }


def generator_streams(join: dict) -> dict[str, dict]:
    """The generator (`source.kind = "generator"`, common.workload) declared as the single file is (file_streams:
    columns id, ts, key and value, r_* and s_* in results, one arrival order under one watermark), its tuples drawn
    rather than read: no path, times already in microseconds."""
    return file_streams({"path": "", "ts_unit": "us"}, join)


def zmq_streams(source: dict, join: dict) -> dict[str, dict]:
    """The single file's two streams pushed live (`source.kind = "zmq"`): its columns as file_streams declares
    them, their tuples pushed by `source.producers` producers to `source.endpoint` (acknowledged on
    `source.ack_endpoint`) in one arrival order, times already in microseconds (protocol.wire)."""
    live = {k: source[k] for k in ("endpoint", "producers", "ack_endpoint")}
    return {side: spec | live for side, spec in file_streams({"path": "", "ts_unit": "us"}, join).items()}


def single_streams(source: dict, join: dict) -> dict[str, dict]:
    """The two streams of a run without `[streams.*]`: the generator's, the pushed single file's or the single
    file's, by `source.kind`."""
    if source["kind"] == "generator":
        return generator_streams(join)
    return (zmq_streams if source["kind"] == "zmq" else file_streams)(source, join)


def _one_topic(streams: dict[str, dict], error: type[Exception]) -> None:
    """Two streams sharing a topic must each select their records by the same column with their own value; each
    then knows the other's (`select["values"]`: a record no stream takes is set aside by R)."""
    kafka = {name: s["kafka"] for name, s in streams.items() if s["kafka"]}
    patterned = [name for name, k in kafka.items() if k["pattern"] and k["select"]]
    if patterned:
        raise error(f"streams.{patterned[0]}.kafka.select: with the topics named, not with `pattern`")
    if len(kafka) < 2:
        if any(k["select"] for k in kafka.values()):
            raise error(f"streams.{next(iter(kafka))}.kafka.select: only when both streams read the same topic")
        return
    (a, ka), (b, kb) = kafka.items()
    if not set(ka["topics"]) & set(kb["topics"]):
        if ka["select"] or kb["select"]:
            raise error(f"streams.{a if ka['select'] else b}.kafka.select: only when both streams read the same topic")
        return
    if ka["topics"] != kb["topics"] or ka["bootstrap"] != kb["bootstrap"]:
        raise error(
            f"streams.{b}.kafka.topic: shares a topic with streams.{a}: give both the same topics and bootstrap"
        )
    if not ka["select"] or not kb["select"]:
        raise error(
            f"streams.{b if ka['select'] else a}.kafka.select: both streams read {ka['topics'][0]!r}: each needs "
            '{column = "NAME", value = ...} saying which records are its own'
        )
    if ka["select"]["column"] != kb["select"]["column"] or ka["select"]["value"] == kb["select"]["value"]:
        raise error(f"streams.{b}.kafka.select: the same column as streams.{a}'s, with another value")
    values = [ka["select"]["value"], kb["select"]["value"]]
    ka["select"]["values"] = kb["select"]["values"] = values


def _completed(where: str, table: Any, keys: dict[str, tuple[Any, str]], error: type[Exception]) -> dict:
    """The table of keys at `where` (`[streams.NAME]`, its `kafka`) checked against `keys` and completed with
    their defaults."""
    if not isinstance(table, dict):
        raise error(f"{where}: must be a table [{where}] of keys ({', '.join(keys)})")
    unknown = [k for k in table if k not in keys]
    if unknown:
        raise error(f"unknown key {where}.{unknown[0]} (known: {', '.join(keys)})")
    out = {k: table.get(k, default) for k, (default, _) in keys.items()}
    missing = [k for k, v in out.items() if v is None]
    if missing:
        raise error(f"{where}.{missing[0]}: required ({keys[missing[0]][1]})")
    return out


def _one(name: str, table: Any, join: dict, error: type[Exception]) -> dict:
    s = _completed(f"streams.{name}", table, STREAM_KEYS, error)
    if "kafka" in table:
        s["kafka"] = _kafka(name, table["kafka"], error)
    key = [s["key"]] if isinstance(s["key"], str) else s["key"]
    if (
        not isinstance(key, list)
        or not key
        or not all(isinstance(c, str) and c for c in key)
        or len(set(key)) < len(key)
    ):
        raise error(f"streams.{name}.key: expected a column name or a list of distinct column names, got {s['key']!r}")
    s["key"] = key
    for k in ("path", "endpoint", "ack_endpoint", "time", "time_unit", "id", "side", "prefix"):
        if not isinstance(s[k], str):
            raise error(f"streams.{name}.{k}: expected a string, got {s[k]!r}")
    if not s["time"]:
        raise error(f"streams.{name}.time: must not be empty")
    given = [k for k in INPUTS if s[k]]
    if len(given) != 1:
        raise error(
            f"streams.{name}: give it one of path (files), endpoint (live producers) or kafka (a topic), "
            f"{'not ' + ' and '.join(given) if given else 'none given'}"
        )
    if not isinstance(s["producers"], int) or isinstance(s["producers"], bool) or s["producers"] < 1:
        raise error(f"streams.{name}.producers: expected a positive integer, got {s['producers']!r}")
    if not isinstance(s["schema"], dict) or not all(isinstance(t, str) for t in s["schema"].values()):
        raise error(f'streams.{name}.schema: expected a table of column = "Arrow type", got {s["schema"]!r}')
    if s["endpoint"] or s["kafka"]:
        own = KAFKA_COLUMNS if s["kafka"] else {}
        missing = [c for c in [*key, s["time"], *([s["id"]] if s["id"] else [])] if c not in {**s["schema"], **own}]
        if missing:
            raise error(
                f"streams.{name}.schema: a live stream declares its columns with their types; "
                f"missing {', '.join(missing)}"
            )
        taken = [c for c in s["schema"] if c in own]
        if taken:
            raise error(
                f"streams.{name}.schema: {taken[0]} is the record's own column "
                f"({', '.join(KAFKA_COLUMNS)}), not a field of its value: leave it out of schema"
            )
    s["time_format"] = _time_formats(name, s, error)
    if s["time_unit"] not in UNITS:
        raise error(f"streams.{name}.time_unit: must be one of {', '.join(map(repr, UNITS))}, got {s['time_unit']!r}")
    if s["side"] not in ("", *SIDES):
        raise error(f'streams.{name}.side: must be "R" or "S", got {s["side"]!r}')
    if s["max_delay"] == "":
        s["max_delay"] = join["max_delay"]
    for k in ("max_delay", "idle_timeout"):
        s[k] = _duration(f"streams.{name}.{k}", s[k], error)
    used = [*key, s["time"], *([s["id"]] if s["id"] else [])]
    if len(set(used)) < len(used):
        raise error(f"streams.{name}: key, time and id must be different columns, got {used}")
    if s["payload"] != "*" and (
        not isinstance(s["payload"], list) or not all(isinstance(c, str) and c for c in s["payload"])
    ):
        raise error(f'streams.{name}.payload: expected "*" or a list of column names, got {s["payload"]!r}')
    s["prefix"] = s["prefix"].replace("{stream}", name)
    return s


def _time_formats(name: str, s: dict, error: type[Exception]) -> list[str]:
    """`time_format` as a list of strptime formats ([] = ISO-8601), for a stream of files whose `schema` declares
    a timestamp column (Arrow's types as text: "timestamp[ms]")."""
    formats = s["time_format"]
    formats = ([formats] if formats else []) if isinstance(formats, str) else formats
    if not isinstance(formats, list) or not all(isinstance(f, str) and f for f in formats):
        raise error(f"streams.{name}.time_format: expected a strptime format or a list of them, got {formats!r}")
    if formats and not s["path"]:
        raise error(f"streams.{name}.time_format: only for a stream of CSV files (path)")
    if formats and not any(t.strip().startswith("timestamp[") for t in s["schema"].values()):
        raise error(
            f"streams.{name}.time_format: the format of the columns `schema` declares as timestamps, and it "
            f'declares none (e.g. schema = {{{s["time"]} = "timestamp[ms]"}})'
        )
    return formats


def _kafka(name: str, table: Any, error: type[Exception]) -> dict:
    """A stream's `kafka` table checked and completed: `topic` becomes the list `topics`.  The librdkafka
    settings' values are never put in a message (they may be credentials)."""
    where = f"streams.{name}.kafka"
    k = _completed(where, table, KAFKA_KEYS, error)
    for key in ("bootstrap", "group"):
        if not isinstance(k[key], str):
            raise error(f"{where}.{key}: expected a string, got {k[key]!r}")
    if not k["bootstrap"]:
        raise error(f"{where}.bootstrap: must not be empty")
    if not isinstance(k["pattern"], str) or bool(k["pattern"]) == bool(k["topic"]):
        raise error(f"{where}.topic: give it a topic or a list of topics, or `pattern` instead (one of the two)")
    if k["pattern"]:
        try:
            re.compile(k["pattern"])
        except re.error as e:
            raise error(f"{where}.pattern: not a regular expression: {e}") from None
    topics = [] if k["pattern"] else [k["topic"]] if isinstance(k["topic"], str) else k["topic"]
    if not k["pattern"] and (
        not isinstance(topics, list)
        or not topics
        or not all(isinstance(t, str) and t for t in topics)
        or len(set(topics)) < len(topics)
    ):
        raise error(f"{where}.topic: expected a topic name or a list of distinct topic names, got {k['topic']!r}")
    if not isinstance(k["bounded"], bool):
        raise error(f"{where}.bounded: expected true or false, got {k['bounded']!r}")
    if k["on_lost"] not in ON_LOST:
        raise error(f"{where}.on_lost: one of {', '.join(map(repr, ON_LOST))}, got {k['on_lost']!r}")
    if k["format"] not in KAFKA_FORMATS:
        raise error(f"{where}.format: one of {', '.join(map(repr, KAFKA_FORMATS))}, got {k['format']!r}")
    if (k["format"] == "avro") != bool(k["avro_schema"]) or not isinstance(k["avro_schema"], str):
        raise error(f'{where}.avro_schema: the writer\'s schema file, given with format = "avro" (and only then)')
    if not isinstance(k["registry_header"], bool) or (k["registry_header"] and k["format"] != "avro"):
        raise error(f'{where}.registry_header: true or false, and true only with format = "avro"')
    select = k["select"]
    if select:
        if (
            not isinstance(select, dict)
            or set(select) != {"column", "value"}
            or not isinstance(select["column"], str)
            or not select["column"]
            or not isinstance(select["value"], (str, int))
            or isinstance(select["value"], bool)
        ):
            raise error(f'{where}.select: expected {{column = "NAME", value = "TEXT" or an integer}}, got {select!r}')
        if k["format"] == "csv":
            raise error(f'{where}.select: not with format = "csv" (its cells have no names: one topic per stream)')
    return {
        "bootstrap": k["bootstrap"],
        "topics": topics,  #: with a pattern: the topics it matched, filled as the run starts (master.sources)
        "pattern": k["pattern"],
        "group": k["group"] or f"streamjoin-{name}",
        "config": client_settings(
            where,
            k["config"],
            KAFKA_OWN,
            f"the stream itself (bootstrap.servers from {where}.bootstrap, group.id from {where}.group, "
            f"auto.offset.reset: records deleted before they were read are never skipped silently, {where}.on_lost "
            "decides; its reading depends on the others)",
            error,
        ),
        "bounded": k["bounded"],
        "on_lost": k["on_lost"],
        "format": k["format"],
        "avro_schema": k["avro_schema"],
        "registry_header": k["registry_header"],
        "select": dict(select),
    }


#: a librdkafka setting's value taken from elsewhere, as Kafka's config providers write it: ${env:NAME}, ${file:PATH}
SECRET_REFERENCE = re.compile(r"\$\{(env|file):([^}]+)\}")


def resolved_settings(config: dict, where: str, error: type[Exception]) -> dict:
    """librdkafka settings with each value written `${env:NAME}` or `${file:PATH}` replaced by that environment
    variable or that file's text (stripped): read where the client starts, so the secret is in no config,
    summary, checkpoint or log.  A reference that cannot be read is named, never its value."""
    out = {}
    for setting, value in config.items():
        ref = SECRET_REFERENCE.fullmatch(value) if isinstance(value, str) else None
        if ref is None:
            out[setting] = value
        elif ref[1] == "env":
            if ref[2] not in os.environ:
                raise error(f"{where}.{setting}: the environment variable {ref[2]} is not set")
            out[setting] = os.environ[ref[2]]
        else:
            try:
                out[setting] = Path(ref[2]).read_text().strip()
            except OSError as e:
                raise error(f"{where}.{setting}: cannot read {ref[2]}: {e.strerror}") from None
    return out


def client_settings(where: str, table: Any, own: tuple[str, ...], setter: str, error: type[Exception]) -> dict:
    """`where`.config: librdkafka settings by their dotted names, none of `own` (set by `setter`, which the
    message names); values are never put in a message (they may be credentials)."""
    if not isinstance(table, dict):
        raise error(f"{where}.config: expected a table of librdkafka settings")
    config = _dotted(table)
    for setting, value in config.items():
        if setting in own:
            raise error(f"{where}.config.{setting}: set by {setter}")
        if isinstance(value, list):
            raise error(f"{where}.config.{setting}: expected a string, number or boolean (value not shown)")
    return config


def set_sink_key(sink: dict, key: str, value: Any) -> None:
    """`--set output.kafka.KEY=value` (`output.kafka.config.SETTING`: one librdkafka setting)."""
    setting, _, rest = key.partition(".")
    if setting == "config" and rest:
        sink.setdefault("config", {})[rest] = value
    else:
        sink[key] = value


def kafka_sink(table: Any, error: type[Exception]) -> dict:
    """`[output.kafka]` checked and completed (`topic` "": no sink).  Avro is refused: only JSON values are
    built (docs/refusals.md)."""
    where = "output.kafka"
    k = _completed(where, table, SINK_KEYS, error)
    for key in ("topic", "bootstrap", "marker_topic"):
        if not isinstance(k[key], str):
            raise error(f"{where}.{key}: expected a string, got {k[key]!r}")
    if bool(k["topic"]) != bool(k["bootstrap"]):
        given, missing = ("topic", "bootstrap") if k["topic"] else ("bootstrap", "topic")
        raise error(f"{where}.{missing}: required with {where}.{given}")
    if k["format"] == "avro":
        raise error(
            f'{where}.format: "avro" is not built yet (it needs a schema registry and a schema per result '
            'layout); use "json"'
        )
    if k["format"] != "json":
        raise error(f'{where}.format: only "json" (one JSON object per record value) yet, got {k["format"]!r}')
    if k["topic"] and k["marker_topic"] == k["topic"]:
        raise error(f"{where}.marker_topic: must differ from {where}.topic (readers of the results would see markers)")
    k["timeout"] = _duration(f"{where}.timeout", k["timeout"], error)
    if k["timeout"] < 1:
        raise error(f"{where}.timeout: must be at least 1s, got {k['timeout']!r}")
    k["config"] = client_settings(
        where,
        k["config"],
        SINK_OWN,
        f"the sink itself (bootstrap.servers from {where}.bootstrap; its exactness depends on the others: "
        f"{', '.join(SINK_OWN[1:])})",
        error,
    )
    k["marker_topic"] = k["marker_topic"] or (f"{k['topic']}.streamjoin-markers" if k["topic"] else "")
    #: set by rank 0 as the run starts (master.sink): the run's id, and whether its end is in Kafka already
    return k | {"run": "", "complete": False}


def _dotted(table: dict, prefix: str = "") -> dict:
    """librdkafka settings by their dotted names: TOML reads `security.protocol = "SSL"` as nested tables."""
    out = {}
    for key, value in table.items():
        out |= _dotted(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value}
    return out


def _duration(name: str, value: Any, error: type[Exception]) -> float:
    """A duration key's value in float seconds (text such as "5s" or a number), finite, >= 0 and below
    protocol.eventtime.DURATION_LIMIT."""
    if isinstance(value, str):
        try:
            value = parse_duration(value)
        except ValueError as e:
            raise error(f"{name}: {e}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < DURATION_LIMIT // PER_SECOND:
        raise error(
            f"{name}: expected a duration >= 0 and below {DURATION_LIMIT // PER_SECOND} seconds "
            f'(a number of seconds or text such as "5s"), got {value!r}'
        )
    return float(value)


def reference() -> list[str]:
    """The [streams.NAME] part of docs/configuration.md."""
    lines = [
        "",
        "## [streams.NAME]",
        "",
        "Two tables, one per stream, named as you like (`[streams.impressions]`, `[streams.clicks]`); with them "
        '`source.kind` is "streams" (docs/input.md). Override one key with `--set streams.NAME.KEY=value`.',
        "",
        "| key | default | meaning |",
        "|---|---|---|",
    ]
    shown = lambda d: (
        "required"
        if d is None
        else f'`"{d}"`'
        if isinstance(d, str)
        else f"`{str(d).lower() if isinstance(d, bool) else d}`"
    )
    for prefix, keys in (("streams.NAME.", STREAM_KEYS), ("streams.NAME.kafka.", KAFKA_KEYS)):
        lines += [f"| `{prefix}{key}` | {shown(default)} | {meaning} |" for key, (default, meaning) in keys.items()]
    lines += [
        "",
        "## [output.kafka]",
        "",
        "The Kafka result sink (docs/output.md#the-kafka-result-sink); override one key with "
        "`--set output.kafka.KEY=value`.",
        "",
        "| key | default | meaning |",
        "|---|---|---|",
    ]
    return lines + [f"| `output.kafka.{key}` | {shown(d)} | {meaning} |" for key, (d, meaning) in SINK_KEYS.items()]
