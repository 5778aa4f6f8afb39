"""The Kafka result sink without a broker: `[output.kafka]` checked with the key named and its settings' values
never shown or written, and the records built from result tables by Arrow's string kernels -- each value read
back by the json module is the row as pyarrow gives it."""

from __future__ import annotations

from types import SimpleNamespace
import json
import math
from datetime import datetime, timezone

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from protocol.access import public
from protocol.config import ConfigError, load_config
from protocol.kafka_sink import json_text, key_columns, records
from protocol.output import RESULT_SCHEMA

SINK = ["output.kafka.topic=pairs", "output.kafka.bootstrap=127.0.0.1:9092"]


@pytest.mark.parametrize(
    "overrides, named",
    [
        (["output.kafka.topic=pairs"], "output.kafka.bootstrap: required with output.kafka.topic"),
        (["output.kafka.bootstrap=h:1"], "output.kafka.topic: required with output.kafka.bootstrap"),
        ([*SINK, "output.kafka.format=avro"], 'output.kafka.format: "avro" is not built yet'),
        ([*SINK, "output.kafka.format=xml"], 'output.kafka.format: only "json"'),
        ([*SINK, "output.kafka.partition=1"], "unknown key output.kafka.partition"),
        ([*SINK, "output.kafka.marker_topic=pairs"], "output.kafka.marker_topic: must differ"),
        ([*SINK, "output.kafka.timeout=0.5"], "output.kafka.timeout: must be at least 1s"),
        ([*SINK, "output.kafka.timeout=forever"], "output.kafka.timeout: "),
        ([*SINK, "output.kafka.config.transactional.id=mine"], "output.kafka.config.transactional.id: set by"),
        ([*SINK, "output.kafka.config.enable.idempotence=false"], "output.kafka.config.enable.idempotence: set by"),
    ],
)
def test_a_sink_setting_that_cannot_work_is_refused_naming_its_key(overrides, named):
    with pytest.raises(ConfigError, match="^" + named.replace("(", r"\(")):
        load_config(None, overrides)


def test_the_sink_is_off_by_default_and_its_settings_values_are_never_written():
    assert load_config()["output"]["kafka"]["topic"] == ""
    cfg = load_config(None, [*SINK, 'output.kafka.config.sasl.password="hunter2"', "output.kafka.timeout=5s"])
    sink = cfg["output"]["kafka"]
    assert sink["config"] == {"sasl.password": "hunter2"} and sink["timeout"] == 5.0
    assert sink["marker_topic"] == "pairs.streamjoin-markers"
    shown = json.dumps(public(cfg))
    assert "hunter2" not in shown and '"sasl.password": "***"' in shown
    with pytest.raises(ConfigError) as e:
        load_config(None, [*SINK, "output.kafka.config.acks=[1]"])
    assert "[1]" not in str(e.value)


def test_records_are_the_rows_as_json_objects_keyed_by_the_pairs_ids():
    """Integers, floats (NaN and infinities become null), strings with quotes, backslashes, control characters
    and non-ASCII text, booleans, timestamps (ISO 8601, UTC) and nulls: each value parsed back is the row."""
    when = [
        datetime(2026, 1, 2, 3, 4, 5, 678000, tzinfo=timezone.utc),
        None,
        datetime(1999, 12, 31, tzinfo=timezone.utc),
    ]
    table = pa.table(
        {
            "views_vid": pa.array([1, 2, None], pa.int64()),
            "views_page": ['a "quoted" \\ path', "tab\tnew\nline\x01", "ünïcødé ✓"],
            "views_at": pa.array(when, pa.timestamp("ms", tz="UTC")),
            "buys_bid": pa.array([10, None, 30], pa.int64()),
            "cost": [1.5, float("nan"), -math.inf],
            "big": [1e300, 0.1, -0.0],
            "paid": [True, False, None],
        }
    )
    streams = (
        SimpleNamespace(id="vid", key=("user",), time="at", prefix="views_"),
        SimpleNamespace(id="bid", key=("user",), time="at", prefix="buys_"),
    )
    values, keys = records(table, key_columns(streams))
    assert keys == [b"1|10", b"2|", b"|30"]
    for value, row in zip(values, table.to_pylist()):
        got = json.loads(value)
        assert list(got) == table.column_names
        got["views_at"] = got["views_at"] and datetime.fromisoformat(got["views_at"])
        assert got["views_at"] is None or got["views_at"].utcoffset().total_seconds() == 0
        row["cost"] = row["cost"] if row["cost"] is not None and math.isfinite(row["cost"]) else None
        assert got == row


def test_a_plain_run_s_records_are_keyed_by_r_id_and_s_id():
    table = pa.table({c: pa.array([7, 8], RESULT_SCHEMA.field(c).type) for c in RESULT_SCHEMA.names})
    values, keys = records(table, key_columns(()))
    assert keys == [b"7|7", b"8|8"] and json.loads(values[1]) == {c: 8 for c in RESULT_SCHEMA.names}


@pytest.mark.parametrize("unit", ["s", "ms", "us", "ns"])
def test_a_utc_time_s_text_is_arrow_s_own_text_of_the_zoned_value(unit):
    """UTC times are written from their zoneless text (Arrow's zone lookup is slow): the same text as Arrow
    gives the zoned value, before 1970 and after, with nulls, inside records' values too."""
    raw = np.random.default_rng(2).integers(-(2**40), 2**42, 500) // {"s": 1000, "ms": 1}.get(unit, 1)
    zoned = pa.array([*raw.tolist(), None], pa.timestamp(unit, tz="UTC"))
    arrow = pc.replace_substring(pc.cast(zoned, pa.string()), " ", "T", max_replacements=1)
    want = [f'"{t}"' if t is not None else "null" for t in arrow.to_pylist()]
    assert json_text(zoned).to_pylist() == want
    values, _ = records(pa.table({"at": zoned[:-1]}), [])
    assert values == [f'{{"at":{t}}}'.encode() for t in want[:-1]]
