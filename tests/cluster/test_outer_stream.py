"""Outer, semi and anti joins on the punctuated result stream: rows without a partner travel with the
pairs, each with its kind and stream time, never below a punctuation already sent, each once; the set equals the
reference (tests/reference.py `reference_outer`).  Producer and subscriber processes as in test_zmq_cluster."""

from __future__ import annotations

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from protocol.output import LEFT_MATCHED, LEFT_UNMATCHED, MATCHED, RIGHT_UNMATCHED
from tests.runs import free_port, run_cluster
from tests.reference import encode_pairs, micros, reference_outer, reference_pairs
from tests.cluster.test_balance_cluster import FORCED_CHURN, straggler
from tests.cluster.test_cluster import SMALL
from tests.cluster.test_hotkeys import hot_then_cold
from tests.cluster.test_outer_cluster import check_outer
from tests.cluster.test_zmq_cluster import finish, make_input, start, stream_settings, write_input


def check_rows(
    sub: dict, path, want: tuple, join_type: str, window: float, ordered: bool, merged: bool = False
) -> None:
    """The subscriber's view of a join other than inner: its checks passed, every row's stream time at or
    above the punctuation it came after, each kind's rows exactly the reference's, each once, with the stream
    time the contract gives it."""
    assert sub["ended"] and sub["gaps"] == 0 and sub["non_monotone"] == 0 and sub["covered"] == 0, sub
    assert sub["punctuations"] > 2
    t = pq.read_table(path)
    time, before = t["time"].to_numpy(), t["punctuation_before"].to_numpy()
    assert (time >= before).all()
    assert merged or (before[1:] >= before[:-1]).all()
    if ordered:
        assert (np.diff(time) >= 0).all(), "ordered mode published rows out of stream-time order"
    kind = t["kind"].to_numpy(zero_copy_only=False)
    pair, lone_r = kind == MATCHED, kind == (LEFT_MATCHED if join_type == "semi" else LEFT_UNMATCHED)
    lone_s = kind == RIGHT_UNMATCHED
    assert (pair | lone_r | lone_s).all() and sub["results"] == t.num_rows
    assert sub["kinds"] == {k: int((kind == k).sum()) for k in set(kind.tolist())}
    r_null, s_null = (pc.is_null(t[c]).to_numpy(zero_copy_only=False) for c in ("r_id", "s_id"))
    assert (r_null == lone_s).all() and (s_null == lone_r).all()
    r_ts, s_ts = (micros(t[c].fill_null(0.0).to_numpy()) for c in ("r_ts", "s_ts"))
    w = micros(window)
    stream_time = micros(time)
    assert (stream_time[pair] == np.maximum(r_ts, s_ts)[pair]).all()
    if join_type == "semi":  # its first pair's later ts: a partner within the window, at or after r
        assert ((stream_time[lone_r] >= r_ts[lone_r]) & (stream_time[lone_r] <= r_ts[lone_r] + w)).all()
    else:  # final a window after its ts
        assert (stream_time[lone_r] == r_ts[lone_r] + w).all() and (stream_time[lone_s] == s_ts[lone_s] + w).all()
    got = (
        encode_pairs(t["r_id"].filter(pair).to_numpy(), t["s_id"].filter(pair).to_numpy()),
        np.sort(t["r_id"].filter(lone_r).to_numpy()),
        np.sort(t["s_id"].filter(lone_s).to_numpy()),
    )
    for name, g, expected in zip(("pairs", "R rows", "S rows"), got, want):
        assert len(np.unique(g)) == len(g), f"{name}: some received twice"
        np.testing.assert_array_equal(g, expected, err_msg=name)


def subscriber(tmp_path, port: int, *args):
    return start(
        "control.subscribe",
        "--endpoint",
        f"tcp://127.0.0.1:{port}",
        "--out",
        tmp_path / "sub.parquet",
        "--progress",
        0,
        *args,
    )


@pytest.mark.parametrize("join_type,ordered", [("left", False), ("semi", True)])
def test_rows_alone_from_producers_are_punctuated_with_the_pairs(tmp_path, join_type, ordered):
    # one producer pausing randomly between messages; out-of-order input with late tuples
    rng = np.random.default_rng(51)
    stream, ids, ts, keys = make_input(rng, 8000, 600, disorder=0.4)
    write_input(tmp_path / "in.csv", stream, ids, ts, keys)
    ingest, results = free_port(), free_port()
    sub = subscriber(tmp_path, results)
    prod = start(
        "control.produce",
        tmp_path / "in.csv",
        "--endpoint",
        f"tcp://127.0.0.1:{ingest}",
        "--batch",
        400,
        "--jitter",
        0.05,
        "--seed",
        51,
    )
    run = run_cluster(
        tmp_path,
        3,
        stream_settings(
            ingest,
            results,
            **{
                "join.type": join_type,
                "join.window": 0.3,
                "join.max_delay": 0.2,
                "output.ordered": ordered,
                "output.result_chunk_rows": 100,
            },
        ),
    )
    assert run.returncode == 0, run.stderr
    assert finish(prod)["tuples_sent"] == 8000
    pairs, late = reference_pairs(stream, ids, ts, keys, 0.3, 0.2)
    on = ~np.isin(stream * 2**40 + ids, late)
    want = reference_outer(pairs, ids[on & (stream == 0)], ids[on & (stream == 1)], join_type)
    assert len(late) > 0 and len(want[1]) > 300 and (join_type == "semi" or len(want[0]) > 300)
    assert run.summary["result_stream"]["results"] == run.summary["results"]
    check_rows(finish(sub), tmp_path / "sub.parquet", want, join_type, 0.3, ordered)


def test_full_join_rows_alone_stay_above_the_punctuation_while_groups_move(tmp_path):
    # held tuples of moving groups reach their new slave after it has seen later watermarks, and a moved group's
    # undecided rows land on a slave that decides by a higher one
    results = free_port()
    sub = subscriber(tmp_path, results)
    settings = dict(
        SMALL,
        **{
            **FORCED_CHURN,
            "join.type": "full",
            "generator.duration": 3.0,
            "generator.rate": 4000.0,
            "generator.disorder": 0.2,
            "generator.seed": 41,
            "tuning.block_size": 8,
            "tuning.theta_min": 2,
            "tuning.theta_max": 8,
            "output.zmq_endpoint": f"tcp://127.0.0.1:{results}",
            "output.ordered": True,
            "output.wait_subscribers": 1,
        },
    )
    run, want = check_outer(tmp_path, 3, settings, env=straggler(1))
    assert len(run.summary["balance"]["moves"]) >= 1 and all(len(w) > 100 for w in want)
    check_rows(finish(sub), tmp_path / "sub.parquet", want, "full", 0.5, ordered=True)


def test_anti_join_of_two_dispatchers_is_one_ordered_stream(tmp_path):
    # each dispatcher's stream carries the rows its own batches decided (the last STOP's: all left undecided)
    results = free_port(consecutive=2)
    sub = subscriber(tmp_path, results, "--dispatchers", 2, "--ordered")
    settings = dict(
        SMALL,
        **{
            "join.type": "anti",
            "cluster.dispatchers": 2,
            "generator.duration": 2.0,
            "generator.disorder": 0.25,
            "generator.seed": 36,
            "source.rate": 6000.0,
            "output.zmq_endpoint": f"tcp://127.0.0.1:{results}",
            "output.ordered": True,
            "output.wait_subscribers": 1,
        },
    )
    run, want = check_outer(tmp_path, 5, settings, env={"STREAMJOIN_JITTER": "0.01"})
    assert len(run.summary["result_stream"]["endpoints"]) == 2 and len(want[1]) > 100
    check_rows(finish(sub), tmp_path / "sub.parquet", want, "anti", 0.5, ordered=True, merged=True)


def test_left_join_rows_alone_through_a_hot_keys_split_and_merge(tmp_path):
    # R spread over the grid, each with its matched flag: its rows move into sub-groups that decided by other
    # watermarks, and back
    (stream, ids, ts, keys), settings = hot_then_cold(tmp_path, "left")
    results = free_port()
    sub = subscriber(tmp_path, results)
    settings.update({"output.zmq_endpoint": f"tcp://127.0.0.1:{results}", "output.wait_subscribers": 1})
    run = run_cluster(tmp_path, 4, settings)
    assert run.returncode == 0, run.stderr
    assert [h["event"] for h in run.summary["hot_keys"]] == ["split", "merge"]
    pairs, late = reference_pairs(stream, ids, ts, keys, 0.1, 0.05)
    on = ~np.isin(stream * 2**40 + ids, late)
    want = reference_outer(pairs, ids[on & (stream == 0)], ids[on & (stream == 1)], "left")
    check_rows(finish(sub), tmp_path / "sub.parquet", want, "left", 0.1, ordered=False)
