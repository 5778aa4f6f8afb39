"""The typed plan (protocol.plan): each concern compiled once from the validated config, durations in
microseconds, the TOML form and the SQL form meaning the same plan, and a plan that crosses ranks whole."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from protocol.config import load_config
from protocol.plan import compile_plan, load_plan

STREAMS = """
[streams.trades]
path = "trades.csv"
key = "symbol"
time = "exec_time"
max_delay = "250ms"
[streams.quotes]
path = "quotes.csv"
key = "symbol"
time = "quote_ts"
"""


def _toml(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "c.toml"
    p.write_text(text)
    return p


def test_defaults_compile_to_microseconds_and_resolved_values():
    p = load_plan()
    assert (p.join.lower, p.join.upper, p.join.open) == (-1_000_000, 1_000_000, (False, False))
    assert p.join.max_delay == 500_000 and p.join.bounds == (-1_000_000, 1_000_000) and p.join.reach == 1_000_000
    assert p.cluster.heartbeat_timeout == 5.0  # 0 = the larger of 5 s and 20 epochs of 0.25 s
    assert not p.checkpoint.enabled and p.checkpoint.root == Path("out") / "checkpoints"
    assert p.query is None and p.streams == () and not p.aggregate.enabled
    assert [s.side for s in p.inputs] == ["R", "S"] and p.inputs[0].prefix == "r_"


def test_each_concern_reads_its_keys():
    p = load_plan(
        overrides=[
            "checkpoint.interval=4",
            "checkpoint.path=ck",
            "join.lower=-0.5",
            "join.upper=2",
            "epochs.distribution=1",
            "balance.gamma=3",
            "hotkeys.enabled=true",
            "output.path=o",
        ]
    )
    assert p.checkpoint.enabled and p.checkpoint.interval == 4 and p.checkpoint.root == Path("ck")
    assert p.join.bounds == (-500_000, 2_000_000) and p.cluster.heartbeat_timeout == 20.0
    assert p.balance.gamma == 3.0 and p.hotkeys.enabled and p.output.path == Path("o")


def test_declared_streams_are_typed_with_their_own_max_delay(tmp_path):
    p = load_plan(_toml(tmp_path, STREAMS))
    (t, q) = p.streams
    assert (t.name, t.side, t.key, t.time, t.max_delay) == ("trades", "R", ("symbol",), "exec_time", 250_000)
    assert (q.name, q.side, q.max_delay, q.prefix, q.kafka) == ("quotes", "S", 500_000, "quotes_", None)
    assert p.inputs == p.streams and p.source.kind == "streams"


def _query(tmp_path: Path, time: str) -> Path:
    """A query file joining trades and quotes on the symbol with the time condition `time`."""
    p = tmp_path / "q.sql"
    p.write_text(f"SELECT * FROM trades t JOIN quotes q ON t.symbol = q.symbol AND {time}")
    return p


def test_sql_and_toml_forms_mean_the_same_join(tmp_path):
    sql = _query(tmp_path, "q.quote_ts BETWEEN t.exec_time - INTERVAL 2 SECONDS AND t.exec_time")
    by_sql = load_plan(_toml(tmp_path, STREAMS), sql=sql)
    by_toml = load_plan(_toml(tmp_path, STREAMS + "[join]\nlower = -2.0\nupper = 0.0\n"))
    assert by_sql.join == by_toml.join and by_sql.streams == by_toml.streams
    assert by_sql.query is not None and by_toml.query is None
    assert by_sql.shape.keys == by_toml.shape.keys == (("symbol", "symbol"),)


def test_open_bound_is_moved_inside_and_kept_open(tmp_path):
    sql = _query(tmp_path, "q.quote_ts > t.exec_time - INTERVAL 1 SECOND AND q.quote_ts <= t.exec_time")
    p = load_plan(_toml(tmp_path, STREAMS), sql=sql)
    assert (p.join.lower, p.join.upper, p.join.open) == (-999_999, 0, (True, False))


def test_plan_crosses_ranks_whole_and_is_frozen():
    p = load_plan(overrides=["aggregate.enabled=true"])
    again = pickle.loads(pickle.dumps(p))
    assert again == p and again.aggregate.enabled and again.aggregate.view.groups == ("r_key",)
    with pytest.raises(AttributeError):
        p.join.type = "left"  # type: ignore[misc]


def test_run_start_values_replace_plan_and_document_alike():
    cfg = load_config(overrides=["output.kafka.topic=t", "output.kafka.bootstrap=127.0.0.1:9092"])
    p = compile_plan(cfg).with_sink("run-1", True)
    assert (p.output.kafka.run, p.output.kafka.complete) == ("run-1", True)
    assert p.document["output"]["kafka"]["run"] == "run-1" and cfg["output"]["kafka"]["run"] == ""
