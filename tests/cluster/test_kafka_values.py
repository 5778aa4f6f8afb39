"""Kafka record values in each format (`streams.NAME.kafka.format`: CSV lines, Avro datums with and without the
Schema Registry's header) and both streams in one topic (`kafka.select`), against the broker the suite starts:
the joins equal the reference join of the records as produced, bad records are set aside with their reason,
partition and offset, each once.  The Avro datums are written by the test's own encoder (the specification's
zig-zag longs and length-prefixed strings), not by the library that reads them."""

from __future__ import annotations

import json
import re
import struct

import numpy as np
import pytest

from protocol.config import ConfigError, load_config
from protocol.output import read_tables
from tests.kafka import create, now_ms, produce, reference, settings, stream, values
from tests.runs import run_cluster, toml_value

IDS = ("views_vid", "buys_bid")
COLUMNS = {"views": "vid", "buys": "bid"}


def csv_values(s: dict, id_column: str) -> list[bytes]:
    """CSV lines in the order of `settings`' schema: id, user, at, page."""
    return [f"{i},{u},{t},/p{i % 7}".encode() for i, u, t in zip(s["id"].tolist(), s["user"], s["at"].tolist())]


def avro_long(v: int) -> bytes:
    v = (v << 1) ^ (v >> 63)
    out = bytearray()
    while v > 0x7F:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def avro_string(text: str) -> bytes:
    raw = text.encode()
    return avro_long(len(raw)) + raw


def avro_schema(id_column: str) -> dict:
    return {
        "type": "record",
        "name": "Event",
        "fields": [
            {"name": id_column, "type": "long"},
            {"name": "user", "type": "string"},
            {"name": "at", "type": "long"},
            {"name": "page", "type": ["null", "string"]},
            {"name": "weight", "type": "double"},  # not declared: left out
        ],
    }


def avro_values(s: dict, header: bytes) -> list[bytes]:
    """Datums of avro_schema: the page null for every fifth record."""
    return [
        header
        + avro_long(i)
        + avro_string(u)
        + avro_long(t)
        + (avro_long(0) if i % 5 == 0 else avro_long(1) + avro_string(f"/p{i % 7}"))
        + struct.pack("<d", i / 2)
        for i, u, t in zip(s["id"].tolist(), s["user"], s["at"].tolist())
    ]


def fill(broker: str, topic: str, s: dict, records: list[bytes]) -> np.ndarray:
    create(broker, topic, 4)
    return produce(broker, topic, s["partition"], records)


def joined_without(tmp_path, cfg: dict, views: dict, buys: dict, bad: list[int]):
    """The run of `cfg`, checked: exactly the reference join and lateness of the views but `bad` and the buys."""
    run = run_cluster(tmp_path, 3, cfg)
    assert run.returncode == 0, run.stderr
    good = np.setdiff1d(np.arange(len(views["id"])), bad)
    kept = {k: (np.asarray(v)[good] if k != "user" else [v[i] for i in good]) for k, v in views.items()}
    pairs, late, _ = reference(kept, buys)
    assert len(pairs) > 500
    np.testing.assert_array_equal(run.pairs(IDS), pairs)
    np.testing.assert_array_equal(run.late_ids(IDS, ("views", "buys")), late)
    return run


def listed(run) -> list[tuple]:
    t = read_tables(run.out / "rejected")
    if t is None:
        return []
    return sorted(zip(*(t[c].to_pylist() for c in ("topic", "partition", "offset", "reason"))))


def test_csv_lines_join_exactly_and_bad_lines_are_set_aside_with_their_reason(tmp_path, broker):
    """Both topics hold CSV lines (cells in the schema's order); in views one line has a cell too few, one a
    time that is not a number, one an empty key: each is listed once with its reason, the rest join exactly."""
    rng = np.random.default_rng(41)
    t0 = now_ms()
    views, buys = stream(rng, 3000, 0, 4, t0, 0.01), stream(rng, 2000, 100_000, 4, t0, 0.01)
    topics = {name: f"{name}-{tmp_path.name}" for name in COLUMNS}
    records = csv_values(views, "vid")
    bad = {500: b"500,u1,7", 1500: "1500,u2,soon,/p1".encode(), 2500: f"2500,,{t0},/p1".encode()}
    for i, v in bad.items():
        records[i] = v
    offsets = fill(broker, topics["views"], views, records)
    fill(broker, topics["buys"], buys, csv_values(buys, "bid"))
    cfg = settings(broker, topics)
    for name in COLUMNS:
        cfg[f"streams.{name}.kafka"]["format"] = "csv"
    run = joined_without(tmp_path, cfg, views, buys, list(bad))
    reasons = ["not CSV", "wrong type", "missing column"]
    want = sorted(
        (topics["views"], int(views["partition"][i]), int(offsets[i]), r) for i, r in zip(bad, reasons, strict=True)
    )
    assert listed(run) == want
    results = read_tables(run.out / "results")
    assert results["views_page"].to_pylist() == [f"/p{i % 7}" for i in results["views_vid"].to_pylist()]


@pytest.mark.parametrize("header", [False, True])
def test_avro_datums_join_exactly_with_their_own_types_and_a_bad_datum_is_set_aside(tmp_path, broker, header):
    """Both topics hold Avro datums of a record schema (with the Schema Registry's 5-byte header, or none); a
    nullable union field becomes a nullable column, a field not declared is left out; one views record is cut
    short (not Avro) and, with the header, one lacks it: each is listed once, the rest join exactly."""
    rng = np.random.default_rng(42 + header)
    t0 = now_ms()
    views, buys = stream(rng, 3000, 0, 4, t0, 0.01), stream(rng, 2000, 100_000, 4, t0, 0.01)
    topics = {name: f"{name}-{tmp_path.name}" for name in COLUMNS}
    prefix = b"\x00\x00\x00\x00\x07" if header else b""
    records = avro_values(views, prefix)
    bad = {700: records[700][:-9]}
    if header:
        bad[1700] = records[1700][5:]
    for i, v in bad.items():
        records[i] = v
    offsets = fill(broker, topics["views"], views, records)
    fill(broker, topics["buys"], buys, avro_values(buys, prefix))
    cfg = settings(broker, topics, **{"streams.views.payload": ["page", "@offset"]})
    for name, column in COLUMNS.items():
        schema_file = tmp_path / f"{name}.avsc"
        schema_file.write_text(json.dumps(avro_schema(column)))
        cfg[f"streams.{name}.kafka"] |= {"format": "avro", "avro_schema": str(schema_file), "registry_header": header}
    run = joined_without(tmp_path, cfg, views, buys, list(bad))
    assert listed(run) == sorted(
        (topics["views"], int(views["partition"][i]), int(offsets[i]), "not Avro") for i in bad
    )
    results = read_tables(run.out / "results")
    vid = results["views_vid"].to_numpy()
    assert results["views_page"].to_pylist() == [None if i % 5 == 0 else f"/p{i % 7}" for i in vid.tolist()]
    assert (results["views_@offset"].to_numpy() == offsets[vid]).all()


def test_both_streams_in_one_topic_are_told_apart_by_a_column_and_the_rest_is_listed_once(tmp_path, broker):
    """Views and buys written into one topic of 4 partitions (JSON with a `type` field), interleaved as they
    come; two records of a type no stream takes and one that is not JSON: each is listed once (by R), every
    view and buy joins exactly as from two topics."""
    rng = np.random.default_rng(43)
    t0 = now_ms()
    views, buys = stream(rng, 3000, 0, 4, t0, 0.01), stream(rng, 2000, 100_000, 4, t0, 0.01)
    topic = f"events-{tmp_path.name}"
    tagged = [
        (p, json.dumps({**json.loads(v), "type": kind}).encode())
        for s, kind, column in ((views, "view", "vid"), (buys, "buy", "bid"))
        for p, v in zip(s["partition"].tolist(), values(s, column))
    ]
    order = np.argsort(np.r_[np.arange(3000) / 3000, np.arange(2000) / 2000], kind="stable")  # mixed, each in order
    tagged = [tagged[i] for i in order] + [(1, b'{"type": "refund", "vid": 1}'), (2, b'{"type": "x"'), (3, b"{}")]
    create(broker, topic, 4)
    offsets = produce(broker, topic, np.array([p for p, _ in tagged]), [v for _, v in tagged])
    cfg = settings(broker, {"views": topic, "buys": topic})
    for name, kind in (("views", "view"), ("buys", "buy")):
        cfg[f"streams.{name}.kafka"]["select"] = {"column": "type", "value": kind}
    run = run_cluster(tmp_path, 3, cfg)
    assert run.returncode == 0, run.stderr
    pairs, late, _ = reference(views, buys)
    np.testing.assert_array_equal(run.pairs(IDS), pairs)
    np.testing.assert_array_equal(run.late_ids(IDS, ("views", "buys")), late)
    n = len(tagged)
    assert listed(run) == sorted(
        [
            (topic, 1, int(offsets[n - 3]), "no stream"),
            (topic, 2, int(offsets[n - 2]), "not JSON"),
            (topic, 3, int(offsets[n - 1]), "no stream"),
        ]
    )
    assert run.summary["live_streams"]["views"]["rows"] == 3000 and run.summary["live_streams"]["buys"]["rows"] == 2000


@pytest.mark.parametrize(
    "change, words",
    [
        ({"streams.views.kafka.format": "protobuf"}, "streams.views.kafka.format: one of 'json', 'csv', 'avro'"),
        ({"streams.views.kafka.format": "avro"}, "streams.views.kafka.avro_schema: the writer's schema file"),
        ({"streams.views.kafka.registry_header": True}, 'true only with format = "avro"'),
        ({"streams.views.kafka.select": {"column": "type", "value": "v"}}, "only when both streams read the same"),
        ({"streams.buys.kafka.topic": "v"}, "kafka.select: both streams read 'v'"),
        (
            {
                "streams.buys.kafka.topic": "v",
                "streams.views.kafka.select": {"column": "type", "value": "a"},
                "streams.buys.kafka.select": {"column": "type", "value": "a"},
            },
            "the same column as streams.views's, with another value",
        ),
        (
            {"streams.views.kafka.format": "csv", "streams.views.kafka.select": {"column": "type", "value": "a"}},
            'not with format = "csv"',
        ),
        ({"streams.views.kafka.pattern": "v.*"}, "streams.views.kafka.topic: give it a topic or a list of topics, or"),
        ({"streams.views.kafka.topic": "", "streams.views.kafka.pattern": "(v"}, "pattern: not a regular expression"),
    ],
)
def test_value_format_and_select_mistakes_are_refused_naming_the_key(change, words):
    base = settings("127.0.0.1:1", {"views": "v", "buys": "b"})
    cfg = {**base}
    for key, value in change.items():
        if key.startswith("streams.views.kafka.") or key.startswith("streams.buys.kafka."):
            stream_key, inner = key.rsplit(".kafka.", 1)
            cfg[f"{stream_key}.kafka"] = {**cfg[f"{stream_key}.kafka"], inner: value}
    with pytest.raises(ConfigError, match=re.escape(words)):
        load_config(None, [f"{k}={toml_value(v)}" for k, v in cfg.items()])


def test_a_client_setting_read_from_the_environment_reaches_the_client_and_stays_out_of_the_output(tmp_path, broker):
    """`kafka.config` values as `${env:NAME}` and `${file:PATH}` are read by the master as it starts the client
    (a refused value would stop the run), never written: the summary shows `***`, and a variable not set stops
    the start naming the setting and the variable, exit 2."""
    rng = np.random.default_rng(44)
    t0 = now_ms()
    views, buys = stream(rng, 600, 0, 2, t0), stream(rng, 400, 100_000, 2, t0)
    topics = {name: f"{name}-{tmp_path.name}" for name in COLUMNS}
    fill(broker, topics["views"], views, values(views, "vid"))
    fill(broker, topics["buys"], buys, values(buys, "bid"))
    (tmp_path / "wait").write_text("50\n")
    cfg = settings(broker, topics)
    cfg["streams.views.kafka"]["config"] = {
        "client.id": "${env:SJ_CLIENT}",
        "fetch.wait.max.ms": f"${{file:{tmp_path / 'wait'}}}",
    }
    run = run_cluster(tmp_path / "a", 3, cfg, env={"SJ_CLIENT": "secret-client-name"})
    assert run.returncode == 0, run.stderr
    assert run.summary["config"]["streams"]["views"]["kafka"]["config"] == {
        "client.id": "***",
        "fetch.wait.max.ms": "***",
    }
    assert "secret-client-name" not in run.stderr + (run.out / "summary.json").read_text()
    assert len(run.pairs(IDS)) == len(reference(views, buys)[0])
    missing = run_cluster(tmp_path / "b", 3, cfg)
    assert (
        missing.returncode == 2
        and "streams.views.kafka.config.client.id: the environment variable SJ_CLIENT is not set" in missing.stderr
    )


def test_a_topic_pattern_reads_every_topic_it_matches_at_the_start_and_none_matching_stops_it(tmp_path, broker):
    """`kafka.pattern` instead of `topic`: the views stream reads its topic and a second, empty one that matches
    too (8 partitions in all, the log names both), not a third that does not; the join is exact.  A pattern
    matching no topic stops the start naming it (exit 2)."""
    rng = np.random.default_rng(45)
    t0 = now_ms()
    views, buys = stream(rng, 800, 0, 4, t0), stream(rng, 500, 100_000, 4, t0)
    tag = tmp_path.name.replace("_", "-")
    topics = {"views": f"pv-{tag}-main", "buys": f"pb-{tag}"}
    fill(broker, topics["views"], views, values(views, "vid"))
    fill(broker, topics["buys"], buys, values(buys, "bid"))
    create(broker, f"pv-{tag}-empty", 4)
    create(broker, f"pvx-{tag}-other", 4)
    cfg = settings(broker, topics)
    cfg["streams.views.kafka"] = {**cfg["streams.views.kafka"], "topic": "", "pattern": f"pv-{tag}-.*"}
    run = run_cluster(tmp_path / "a", 3, cfg)
    assert run.returncode == 0, run.stderr
    assert f"matches pv-{tag}-empty, pv-{tag}-main" in run.stderr
    assert run.summary["live_streams"]["views"]["partitions"] == 8
    np.testing.assert_array_equal(run.pairs(IDS), reference(views, buys)[0])
    cfg["streams.views.kafka"]["pattern"] = f"nothing-{tag}-.*"
    none = run_cluster(tmp_path / "b", 3, cfg)
    assert none.returncode == 2 and f"streams.views.kafka.pattern: no topic at {broker} matches" in none.stderr
