"""Kafka topics as declared streams (`[streams.NAME] kafka`), against a real Kafka-protocol broker (noida-db, started
by the fixture on a free port): the cluster fed by topics of several partitions, out of order across partitions,
compared with the reference join of the records as produced, lateness judged per partition; bad records set
aside with their partition and offset; record timestamps as event time; a left join; an empty partition; an
unbounded topic stopped by a signal; a partition read far ahead paused and resumed; the clicks example's Kafka
form."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pytest

from protocol import checkpoint
from protocol.config import ConfigError, load_config
from protocol.plan import compile_plan
from protocol.output import read_tables
from tests.reference import late_flags, micros, reference_outer
from tests.kafka import (
    CLICKS_COLUMNS,
    MAX_DELAY,
    assert_committed,
    assert_recovered_exactly,
    checkpointed,
    clicks_example,
    clicks_reference,
    create,
    now_ms,
    produce,
    reference,
    settings,
    stopped_when,
    stream,
    two_topics,
    values,
    written_while_running,
)
from tests.runs import run_cluster, soak, toml_value

ROOT = Path(__file__).resolve().parent.parent.parent
IDS = ("views_vid", "buys_bid")
SUPERVISE = [sys.executable, "-m", "control.supervise", "--backoff", "0.1", "--restarts", "3", "--"]


def test_two_topics_of_four_partitions_give_the_reference_join_with_lateness_per_partition(tmp_path, broker):
    """Two topics of 4 partitions, keys spread over them, each partition in order but 4 s apart from the next
    (read partition after partition, a stream-level rule would find whole partitions late: the test below shows
    it), with 1% of the rows late within their own partition: 1 master + 3 slaves give exactly the reference
    pairs, and exactly the rows late within their partition are late; the records' own partition and offset are
    payload columns, the librdkafka settings are passed through."""
    rng = np.random.default_rng(11)
    t0 = now_ms()
    views, buys = stream(rng, 6000, 0, 4, t0, 0.01), stream(rng, 4000, 100_000, 4, t0, 0.01)
    topics = two_topics(tmp_path, broker, views, buys)
    cfg = settings(broker, topics, **{"streams.views.payload": ["page", "@partition", "@offset"]})
    cfg["streams.views.kafka"]["config"] = {"client.id": "streamjoin-test", "fetch.wait.max.ms": 50}
    run = run_cluster(tmp_path, 4, cfg)
    assert run.returncode == 0, run.stderr
    pairs, late, _ = reference(views, buys)
    assert len(pairs) > 2000 and 50 < len(late) < 200
    np.testing.assert_array_equal(run.pairs(IDS), pairs)
    np.testing.assert_array_equal(run.late_ids(IDS, ("views", "buys")), late)
    results = read_tables(run.out / "results")
    vid = results["views_vid"].to_numpy()
    assert (results["views_@partition"].to_numpy() == views["partition"][vid]).all()
    assert (results["views_@offset"].to_numpy() == views["offset"][vid]).all()
    assert results["views_page"].to_pylist() == [f"/p{i % 7}" for i in vid.tolist()]
    assert run.summary["config"]["streams"]["views"]["kafka"]["config"] == {
        "client.id": "***",
        "fetch.wait.max.ms": "***",
    }
    kafka = run.summary["live_streams"]["views"]
    assert kafka["partitions"] == 4 and kafka["records"] == kafka["rows"] == 6000 and kafka["rejected_by_reason"] == {}


def test_bad_records_are_set_aside_with_partition_and_offset_and_the_rest_join_exactly(tmp_path, broker):
    """One record in a thousand is bad (not JSON, a text field holding a number, the key missing), and one repeats
    an earlier record's id in its partition: each is listed in rejected/ with its topic, partition, offset and
    reason, counted in the summary, and the good ones join exactly."""
    rng = np.random.default_rng(12)
    t0 = now_ms()
    views, buys = stream(rng, 6000, 0, 4, t0), stream(rng, 3000, 100_000, 4, t0)
    topics = {"views": f"views-{tmp_path.name}", "buys": f"buys-{tmp_path.name}"}
    records = values(views, "vid")
    bad = np.arange(999, 6000, 1000)
    kinds = ["not JSON", "wrong type", "missing column"]
    for i, k in zip(bad.tolist(), range(len(bad))):
        records[i] = {
            0: b'{"vid": 1, "user": ',
            1: json.dumps({"vid": i, "user": 7, "at": 1}).encode(),
            2: json.dumps({"vid": i, "at": int(views["at"][i])}).encode(),
        }[k % 3]
    first, again = np.flatnonzero(views["partition"] == views["partition"][10])[[0, -1]]  # the last repeats it
    records[again] = json.dumps({"vid": int(first), "user": "u1", "at": int(views["at"][again])}).encode()
    for name in topics:
        create(broker, topics[name], 4)
    offsets = produce(broker, topics["views"], views["partition"], records)
    produce(broker, topics["buys"], buys["partition"], values(buys, "bid"))
    run = run_cluster(tmp_path, 3, settings(broker, topics))
    assert run.returncode == 0, run.stderr
    good = np.setdiff1d(np.arange(6000), np.r_[bad, again])
    pairs, late, _ = reference(
        {k: (np.asarray(v)[good] if k != "user" else [v[i] for i in good]) for k, v in views.items()}, buys
    )
    np.testing.assert_array_equal(run.pairs(IDS), pairs)
    np.testing.assert_array_equal(run.late_ids(IDS, ("views", "buys")), late)
    listed = read_tables(run.out / "rejected").sort_by([("partition", "ascending"), ("offset", "ascending")])
    reasons = [kinds[k % 3] for k in range(6)] + [f"duplicate id {first}"]
    expected = sorted(zip(views["partition"][np.r_[bad, again]].tolist(), offsets[np.r_[bad, again]].tolist(), reasons))
    got = zip(*(listed[c].to_pylist() for c in ("partition", "offset", "reason")))
    assert [(p, o, r.split(" (first seen")[0]) for p, o, r in got] == expected
    assert set(listed["topic"].to_pylist()) == {topics["views"]} and listed["value"][0].as_py()
    assert run.summary["live_streams"]["views"]["rejected_by_reason"] == {**{k: 2 for k in kinds}, "duplicate id": 1}
    assert run.summary["rejected"] == 7


def test_a_left_join_on_record_timestamps_ends_with_an_empty_partition(tmp_path, broker):
    """Both streams take each record's timestamp as event time (`time = "@timestamp"`, the values carry none);
    views' topic has a third partition that stays empty, which holds nothing back: the bounded run ends, every
    pair and every view without a partner written once (a left join)."""
    rng = np.random.default_rng(13)
    t0 = now_ms()
    views, buys = stream(rng, 3000, 0, 2, t0), stream(rng, 1000, 100_000, 2, t0)
    topics = {"views": f"views-{tmp_path.name}", "buys": f"buys-{tmp_path.name}"}
    create(broker, topics["views"], 3)
    create(broker, topics["buys"], 2)
    produce(broker, topics["views"], views["partition"], values(views, "vid", False), views["at"])
    produce(broker, topics["buys"], buys["partition"], values(buys, "bid", False), buys["at"])
    cfg = settings(broker, topics, **{"join.type": "left"})
    for name, id_column in (("views", "vid"), ("buys", "bid")):
        cfg[f"streams.{name}.time"] = "@timestamp"
        cfg[f"streams.{name}.schema"] = {id_column: "int64", "user": "string", "page": "string"}
    run = run_cluster(tmp_path, 3, cfg)
    assert run.returncode == 0, run.stderr
    pairs, late, on_time = reference(views, buys)
    pairs, lone_views, _ = reference_outer(pairs, on_time[0], on_time[1], "left")
    np.testing.assert_array_equal(run.pairs(IDS), pairs)
    np.testing.assert_array_equal(run.alone("r", IDS), lone_views)
    assert len(lone_views) > 100 and not len(late)
    results = read_tables(run.out / "results")
    at = pc.cast(results["views_@timestamp"], "int64").to_numpy()  # microseconds
    assert (at == micros(views["at"][results["views_vid"].to_numpy()] * 1000)).all()
    assert run.summary["live_streams"]["views"]["positions"][f"{topics['views']}/2"] == 0


def test_an_unbounded_topic_runs_until_a_stop_signal(tmp_path, broker):
    """Unbounded topics: once every record is in (the progress line says so), SIGTERM to the launcher stops the run
    cleanly (exit 0) with the reference join of them all; the partitions at their end and then the streams
    quiet for their idle_timeout hold nothing back."""
    rng = np.random.default_rng(14)
    t0 = now_ms()
    views, buys = stream(rng, 2000, 0, 2, t0), stream(rng, 1000, 100_000, 2, t0)
    topics = {"views": f"views-{tmp_path.name}", "buys": f"buys-{tmp_path.name}"}
    for name, s, id_column in (("views", views, "vid"), ("buys", buys, "bid")):
        create(broker, topics[name], 2)
        produce(broker, topics[name], s["partition"], values(s, id_column))
    cfg = settings(broker, topics, **{"output.progress": 0.2})
    for name in topics:
        cfg[f"streams.{name}.kafka"]["bounded"] = False
        cfg[f"streams.{name}.idle_timeout"] = "1s"

    def all_in(line: str) -> bool:  # the progress line counts every record in
        return bool((m := re.search(r"\] in ([\d,]+) ", line)) and int(m[1].replace(",", "")) == 3000)

    run = stopped_when(tmp_path, cfg, 3, all_in)
    assert run.summary["stopped_by_signal"] is True
    pairs, late, _ = reference(views, buys)
    np.testing.assert_array_equal(run.pairs(IDS), pairs)
    assert not len(late) and not len(run.late_ids(IDS, ("views", "buys")))


def test_a_partition_far_ahead_waits_is_paused_and_resumed_without_a_record_lost_or_repeated(
    tmp_path, broker, monkeypatch
):
    """Views' partition 0 is 100 s ahead of partition 1, and taken from the client in small batches: its rows wait
    for partition 1's (handed on as read, partition 1's would all be late behind them), so past the pending limit
    it is paused (the client drops what it fetched of it) and resumed once partition 1 is the one ahead; every
    record comes out once (a repeat would be a duplicate id), none late by the stream-level rule the master
    applies."""
    from master.sources import kafka_input, open_source, partitions
    from tests.cluster.test_streams import drain

    monkeypatch.setattr(partitions, "PENDING_LIMIT", 1000)
    monkeypatch.setattr(kafka_input, "CONSUME_BATCH", 500)
    rng = np.random.default_rng(15)
    t0 = now_ms()
    n = 20_000
    views = {
        "id": np.arange(n),
        "user": [f"u{u}" for u in rng.integers(0, 9, n)],
        "partition": np.arange(n) % 2,
        "at": t0 + np.arange(n) // 20 + 100_000 * (np.arange(n) % 2 == 0),
    }
    buys = {
        "id": np.arange(10) + 100_000,
        "user": ["u1"] * 10,
        "partition": np.zeros(10, np.int64),
        "at": t0 + 200_000 + np.arange(10),
    }
    topics = {"views": f"views-{tmp_path.name}", "buys": f"buys-{tmp_path.name}"}
    for name, s, id_column, parts in (("views", views, "vid", 2), ("buys", buys, "bid", 1)):
        create(broker, topics[name], parts)
        produce(broker, topics[name], s["partition"], values(s, id_column))
    cfg = load_config(
        None,
        [f"{k}={toml_value(v)}" for k, v in {**settings(broker, topics), "output.path": str(tmp_path / "out")}.items()],
    )
    src = open_source(compile_plan(cfg))
    got = drain(src)
    summary = src.finish()["live_streams"]["views"]
    assert summary["records"] == summary["rows"] == n and summary["rejected_by_reason"] == {}
    assert not late_flags(got.ts[got.stream == 0], MAX_DELAY).any()
    assert summary["partitions_paused"] > 0 and summary["held_peak_rows"] < n


def test_a_bounded_topic_ends_at_the_offsets_read_when_it_is_opened(tmp_path, broker):
    """Records written after the stream was opened are past its end: not read, and the stream ends."""
    from master.sources import open_source
    from tests.cluster.test_streams import drain

    rng = np.random.default_rng(16)
    views, buys = stream(rng, 500, 0, 2, now_ms()), stream(rng, 100, 100_000, 2, now_ms())
    topics = {"views": f"views-{tmp_path.name}", "buys": f"buys-{tmp_path.name}"}
    for name, s, id_column in (("views", views, "vid"), ("buys", buys, "bid")):
        create(broker, topics[name], 2)
        produce(broker, topics[name], s["partition"], values(s, id_column))
    src = open_source(
        compile_plan(
            load_config(
                None,
                [
                    f"{k}={toml_value(v)}"
                    for k, v in {**settings(broker, topics), "output.path": str(tmp_path / "out")}.items()
                ],
            )
        )
    )
    later = stream(rng, 300, 1000, 2, now_ms())
    produce(broker, topics["views"], later["partition"], values(later, "vid"))
    got = drain(src)
    summary = src.finish()["live_streams"]["views"]
    assert (got.stream == 0).sum() == summary["records"] == summary["rows"] == 500
    assert sorted(summary["positions"].values()) == sorted(np.bincount(views["partition"]).tolist())


def test_bounded_topics_read_ahead_of_the_master_recover_with_what_was_merged_and_not_taken(tmp_path, broker):
    """Bounded topics of 4 partitions, out of order across partitions by seconds, 1% late within their partition,
    text keys and payload columns, taken at 4,000 tuples/s with checkpoints every 0.2 s: the streams are read and
    merged far ahead of the master, so a checkpoint holds the merged rows it has not taken (and the end offsets).
    The master is killed as it begins its fourth checkpoint; restarted from the third, the results are exactly the
    reference join and lateness, and the group's committed offsets are the last complete checkpoint's."""
    rng = np.random.default_rng(31)
    t0 = now_ms()
    views, buys = stream(rng, 6000, 0, 4, t0, 0.01), stream(rng, 4000, 100_000, 4, t0, 0.01)
    topics = two_topics(tmp_path, broker, views, buys)
    cfg = checkpointed(broker, topics, **{"source.rate": 4000.0})
    fired = tmp_path / "fault-fired"
    run = run_cluster(
        tmp_path, 3, cfg, wrapper=SUPERVISE, timeout=120, env={"STREAMJOIN_FAULT": f"0:checkpoint:4:{fired}"}
    )
    assert run.returncode == 0, run.stderr
    assert fired.exists() and "restart 1 of 3" in run.stderr, run.stderr
    assert run.summary["checkpoints"]["recovered_from"] == 3, run.stderr
    pairs, late, _ = reference(views, buys)
    np.testing.assert_array_equal(run.pairs(IDS), pairs)
    np.testing.assert_array_equal(run.late_ids(IDS, ("views", "buys")), late)
    results = read_tables(run.out / "results")
    vid = results["views_vid"].to_numpy()
    assert (results["views_@offset"].to_numpy() == views["offset"][vid]).all()
    assert results["views_page"].to_pylist() == [f"/p{i % 7}" for i in vid.tolist()]
    assert run.summary["live_streams"]["views"]["rows"] == 6000
    at_resume = checkpoint.load_manifest(run.out / "checkpoints" / checkpoint.name_of(3))["master"]["source"]
    assert at_resume["accepted"] < sum(place["row"] for place in at_resume["streams"])  # merged, not taken
    _, manifest = checkpoint.latest_complete(run.out / "checkpoints")
    places = manifest["master"]["source"]["streams"]
    for place, s in zip(places, (views, buys)):
        assert len(place["offsets"]) == 4 and sum(place["offsets"]) > 0
        assert (np.array(place["offsets"]) <= np.bincount(s["partition"], minlength=4)).all()
    assert_committed(broker, topics, places)


def test_a_source_sought_to_its_checkpointed_place_goes_on_with_the_same_tuples_codes_and_payload(tmp_path, broker):
    """In-process: two topics with text keys, read far ahead of what is taken; at 1,200 tuples taken the source's
    place is kept (`position` and its arrays), the source runs to its end, and a fresh source sought to the place
    gives exactly the same tuples after it -- stream rows, times, key codes -- while the payload log holds each
    row's own columns (the segments written after the place by the first source are replaced)."""
    from common.chunks import concat
    from master.sources import open_source
    from protocol.payload import payload_reader

    rng = np.random.default_rng(15)
    t0 = now_ms()
    views, buys = stream(rng, 2000, 0, 4, t0, 0.01), stream(rng, 1500, 100_000, 4, t0, 0.01)
    topics = two_topics(tmp_path, broker, views, buys)
    values = {**checkpointed(broker, topics), "output.path": str(tmp_path / "out")}
    cfg = load_config(None, [f"{k}={toml_value(v)}" for k, v in values.items()])

    def take(source, n: int | None = None):
        chunks, got = [], 0
        while (n is None or got < n) and (c := source.next_chunk(100 if n is None else min(100, n - got))) is not None:
            chunks.append(c)
            got += len(c.ts)
        return concat(chunks)

    first = open_source(compile_plan(cfg))
    before = take(first, 1200)
    where = {**first.position(), "records": first.records()}
    assert where["accepted"] == 1200 and sum(p["row"] for p in where["streams"]) > 1200  # merged ahead
    rest = take(first)
    first.finish()
    second = open_source(compile_plan(cfg))
    second.seek(
        json.loads(json.dumps({k: v for k, v in where.items() if k != "records"})) | {"records": where["records"]}
    )
    again = take(second)
    second.finish()
    for column, a, b in zip(rest._fields, rest, again):
        np.testing.assert_array_equal(a, b, err_msg=column)
    whole = concat([before, again])
    reader = payload_reader(compile_plan(cfg))
    for side, (column, s) in enumerate(zip(IDS, (views, buys))):
        ids = reader.gather(side, whole.id[whole.stream == side])[column].to_numpy()
        assert sorted(ids.tolist()) == s["id"].tolist()


@pytest.mark.parametrize("victim,point", [(1, "batch-after-checkpoint:6"), soak(0, "checkpoint:6")])
def test_topics_written_while_the_cluster_runs_recover_at_their_checkpointed_offsets_exactly_once(
    tmp_path, broker, victim, point
):
    """Unbounded topics of 4 partitions each, written in waves while the cluster runs with checkpoints (text keys,
    payload columns, 4 records not JSON: tests.kafka.written_while_running); a slave or the master is killed as
    the waves come, and the supervisor restarts the cluster from the last complete checkpoint, whose offsets lie
    inside the topics: each partition is read on from its own offset.  The results are exactly the reference join
    and lateness (no pair lost or repeated, the payload from the right record), each bad record is listed once,
    and the group's committed offsets are the last complete checkpoint's."""
    run, written = written_while_running(tmp_path, broker, 41 + victim, f"{victim}:{point}", {}, 3)
    assert_recovered_exactly(run, *written)
    root = run.out / "checkpoints"
    resumed = run.summary["checkpoints"]["recovered_from"]
    at_resume = checkpoint.load_manifest(root / checkpoint.name_of(resumed))["master"]["source"]["streams"]
    assert 0 < sum(at_resume[0]["offsets"]) < 3000 and 0 < sum(at_resume[1]["offsets"]) < 3000, at_resume
    _, manifest = checkpoint.latest_complete(root)
    topics = {name: f"{name}-{tmp_path.name}" for name in ("views", "buys")}
    assert_committed(broker, topics, manifest["master"]["source"]["streams"])


@pytest.mark.parametrize(
    "change, words",
    [
        ({"streams.views.schema": {"vid": "int64"}}, "missing user, at"),
        (
            {"streams.views.schema": {"@offset": "int64", "vid": "int64", "user": "string", "at": "int64"}},
            "@offset is the record's own column",
        ),
        (
            {"streams.views.path": "x.csv"},
            "give it one of path (files), endpoint (live producers) or kafka (a topic), not path and kafka",
        ),
        ({"streams.views.kafka.config.group.id": "mine"}, "streams.views.kafka.config.group.id: set by the stream"),
        (
            {"streams.views.kafka.config.auto.offset.reset": "earliest"},
            "streams.views.kafka.config.auto.offset.reset: set by the stream",
        ),
        ({"streams.views.kafka.on_lost": "ignore"}, "streams.views.kafka.on_lost: one of 'stop', 'skip', got 'ignore'"),
    ],
)
def test_config_mistakes_of_kafka_streams_are_refused_naming_the_key(change, words):
    base = settings("127.0.0.1:1", {"views": "v", "buys": "b"})
    with pytest.raises(ConfigError, match=re.escape(words)):
        load_config(None, [f"{k}={toml_value(v)}" for k, v in {**base, **change}.items()])


def test_checkpoints_with_a_kafka_stream_beside_a_stream_of_files_are_refused():
    """With checkpoints both streams must be topics: a recovery goes on from the topic's offsets, while files would
    be read again from their start."""
    base = settings("127.0.0.1:1", {"views": "v", "buys": "b"})
    base = {k: v for k, v in base.items() if k not in ("streams.buys.kafka", "streams.buys.schema")}
    change = {"checkpoint.interval": 5, "streams.buys.path": "b.csv"}
    with pytest.raises(
        ConfigError, match="streams.views.kafka: with checkpoint.interval, not beside a stream of files"
    ):
        load_config(None, [f"{k}={toml_value(v)}" for k, v in {**base, **change}.items()])
    load_config(
        None,
        [
            f"{k}={toml_value(v)}"
            for k, v in {**settings("127.0.0.1:1", {"views": "v", "buys": "b"}), "checkpoint.interval": 5}.items()
        ],
    )


def test_a_topic_that_does_not_exist_or_a_refused_setting_stops_the_start_without_showing_its_value(tmp_path, broker):
    from common.chunks import InputError
    from master.sources import open_source

    create(broker, f"buys-{tmp_path.name}", 1)
    topics = {"views": f"nothing-{tmp_path.name}", "buys": f"buys-{tmp_path.name}"}
    cfg = lambda **extra: load_config(
        None,
        [
            f"{k}={toml_value(v)}"
            for k, v in {**settings(broker, topics), "output.path": str(tmp_path / "out"), **extra}.items()
        ],
    )
    with pytest.raises(InputError, match=re.escape(f"streams.views.kafka.topic: {topics['views']!r} cannot be read")):
        open_source(compile_plan(cfg()))
    with pytest.raises(ConfigError, match="librdkafka refuses the setting security.protocol") as e:
        open_source(compile_plan(cfg(**{"streams.views.kafka.config.security.protocol": "hunter2"})))
    assert "hunter2" not in str(e.value)


def test_the_clicks_examples_kafka_form_equals_duckdbs_join_of_its_files(tmp_path, broker):
    """examples/clicks as the README's Kafka form runs it: make_data.py's files produced into two topics by
    to_kafka.py, clicks-kafka.toml joins them; every pair and its payload is DuckDB's interval join of the files."""
    settings, _, data = clicks_example(tmp_path, broker)
    run = run_cluster(tmp_path, 3, settings)
    assert run.returncode == 0, run.stderr
    assert run.summary["late"] == 0 and run.summary["rejected"] == 0
    got = read_tables(run.out / "results").to_pandas()
    want = clicks_reference(data)
    columns = CLICKS_COLUMNS
    got = got[columns].sort_values([columns[0], columns[2]]).reset_index(drop=True)
    assert len(want) > 1000 and len(got) == len(want)
    assert (got.to_numpy() == want.to_numpy()).all()


def test_lag_records_and_bytes_are_counted_per_partition_in_the_source_metrics_and_log(tmp_path, broker):
    """Before a record is read each partition lags by what it holds; read to the end, by nothing; records and value
    bytes per partition as produced: from the source itself, then from a run's final exposition and metrics log."""
    import pyarrow.parquet as pq

    from master.sources import open_source
    from tests.cluster.test_metrics import browse, chromium, dashboard_of, parse, shown
    from tests.cluster.test_streams import drain

    rng = np.random.default_rng(17)
    views, buys = stream(rng, 900, 0, 3, now_ms()), stream(rng, 200, 100_000, 1, now_ms())
    topics = {"views": f"views-{tmp_path.name}", "buys": f"buys-{tmp_path.name}"}
    want = {}
    for name, s, id_column, parts in (("views", views, "vid", 3), ("buys", buys, "bid", 1)):
        create(broker, topics[name], parts)
        sent = values(s, id_column)
        produce(broker, topics[name], s["partition"], sent)
        sizes = np.array([len(v) for v in sent])
        for p in range(parts):
            want[name, p] = (int((s["partition"] == p).sum()), int(sizes[s["partition"] == p].sum()))
    cfg = {**settings(broker, topics), "output.path": str(tmp_path / "src"), "metrics.endpoint": "127.0.0.1:0"}
    src = open_source(compile_plan(load_config(None, [f"{k}={toml_value(v)}" for k, v in cfg.items()])))
    seen = lambda rows: {(r["stream"], r["partition"]): (r["records"], r["bytes"], r["lag"]) for r in rows}  # noqa: E731
    assert seen(src.partitions()) == {k: (0, 0, n) for k, (n, _) in want.items()}
    drain(src)
    src.finish()
    assert seen(src.partitions()) == {k: (n, b, 0) for k, (n, b) in want.items()}  # kept after the client closed
    run = run_cluster(tmp_path, 3, {**cfg, "output.path": str(tmp_path / "out"), "metrics.log_interval": 1.0})
    assert run.returncode == 0, run.stderr
    final = parse((run.out / "metrics.prom").read_text())
    for (name, p), (n, b) in want.items():
        labels = (("partition", str(p)), ("stream", name), ("topic", topics[name]))
        assert final[("streamjoin_kafka_records_total", labels)] == n
        assert final[("streamjoin_kafka_bytes_total", labels)] == b
        assert final[("streamjoin_kafka_lag_records", labels)] == 0
    log = pq.read_table(run.out / "metrics").to_pylist()
    assert seen(max(log, key=lambda r: r["seq"])["kafka_partitions"]) == {k: (n, b, 0) for k, (n, b) in want.items()}
    with dashboard_of(run.out) as url:  # the page after the run, in a real browser: a row per partition
        dom = browse(chromium(), url, "--dump-dom")
    assert shown(dom, "kafka-info") == "lag 0 records in all" and 'id="kafka-section" hidden' not in dom
    assert [shown(dom, f"kafka-lag-{name}-{p}") for name, p in want] == ["0"] * len(want)
