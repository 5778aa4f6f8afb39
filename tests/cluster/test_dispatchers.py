"""Several dispatchers (BiStream 3.2.3): ranks 0..k-1 each ingest every k-th tuple and route it; slaves expire
only below every dispatcher's punctuation and check each channel's sequence.  The result set must be the
reference join's whatever the number of dispatchers and the timing of their sends."""

from __future__ import annotations

import numpy as np
import pytest

from protocol.config import ConfigError, load_config, validate
from tests.runs import run_cluster, soak
from tests.cluster.test_balance_cluster import FORCED_CHURN, straggler
from tests.cluster.test_cluster import SMALL, check_exact

# disorder below max_delay: no tuple is late in the whole input, so none is late in any shard either
SHARDED = dict(SMALL, **{"generator.disorder": 0.25, "balance.enabled": False, "generator.skew": 0.8})


@pytest.mark.parametrize("k,ranks,rate", [(1, 3, 0.0), soak(2, 4, 0.0), (3, 5, 8000.0), (2, 5, 8000.0)])
def test_any_number_of_dispatchers_gives_the_reference_result(tmp_path, k, ranks, rate):
    settings = dict(SHARDED, **{"cluster.dispatchers": k, "generator.seed": 40 + k, "source.rate": rate})
    run, expected = check_exact(tmp_path, ranks, settings, env={"STREAMJOIN_JITTER": "0.01"})
    assert run.summary["late"] == 0 and len(expected) > 1000
    processed = [v["tuples_processed"] for v in run.summary["slaves"].values()]
    assert len(processed) == ranks - k and min(processed) > 0


def test_repeated_runs_with_random_send_delays_are_identical(tmp_path):
    settings = dict(SHARDED, **{"cluster.dispatchers": 3, "generator.seed": 47, "generator.duration": 2.0})
    first = None
    for attempt in range(2):
        run, expected = check_exact(tmp_path / str(attempt), 5, settings, env={"STREAMJOIN_JITTER": "0.03"})
        pairs = np.sort(run.pairs())
        first = pairs if first is None else first
        assert np.array_equal(pairs, first)


def test_a_lost_batch_stops_the_job_with_a_message(tmp_path):
    settings = dict(SHARDED, **{"cluster.dispatchers": 2, "generator.seed": 48, "source.rate": 8000.0})
    run = run_cluster(tmp_path, 4, settings, env={"STREAMJOIN_FAULT": f"1:drop:3:{tmp_path / 'dropped'}"})
    assert run.returncode != 0
    assert "from dispatcher 1, expected" in run.stderr and "lost or reordered" in run.stderr


@pytest.mark.parametrize("k,ranks", [(2, 5), soak(3, 6)])
def test_partition_groups_that_move_while_several_dispatchers_route_stay_exact(tmp_path, k, ranks):
    # one slave active at start, and it straggles (FORCED_CHURN; ranks below k dispatch): rank 0 decides the
    # moves, every dispatcher holds the group until its earlier batches are joined, and all route to the new slave
    settings = {
        **SHARDED,
        **FORCED_CHURN,
        "cluster.dispatchers": k,
        "generator.seed": 50 + k,
        "generator.duration": 3.0,
        "generator.rate": 7000.0,  # at half of it a loaded host ended the input before a move
        "balance.enabled": True,
    }
    run, expected = check_exact(tmp_path, ranks, settings, env={"STREAMJOIN_JITTER": "0.005", **straggler(k)})
    moves = run.summary["balance"]["moves"]
    assert len(moves) >= 1 and run.summary["tuples_moved"] > 0, run.stderr
    assert [c["action"] for c in run.summary["balance"]["active_changes"]].count("join") >= 1
    # the groups moved went on being routed to their new slaves by every dispatcher
    processed = [v["tuples_processed"] for v in run.summary["slaves"].values()]
    assert sum(p > 0 for p in processed) >= 2


def test_dispatchers_need_slaves():
    cfg = load_config(None, ["cluster.dispatchers=3", "checkpoint.interval=5", "hotkeys.enabled=true"])
    validate(cfg, slaves=3)
    with pytest.raises(ConfigError, match="besides its 3 dispatcher"):
        validate(cfg, slaves=2)


def test_two_dispatchers_with_their_own_zeromq_sockets_one_fed_by_a_replay(tmp_path, spark):
    # dispatcher i binds source.endpoint's port + i; one gets a producer, the other `control.replay --endpoint`
    import subprocess
    import sys

    import pyarrow as pa
    import pyarrow.parquet as pq

    from deploy.launch import mpi_env
    from tests.runs import write_config
    from tests.reference import reference_pairs
    from tests.runs import free_port
    from tests.cluster.test_zmq_cluster import finish, start

    port = free_port(consecutive=2)
    rng = np.random.default_rng(50)
    n = 6000
    ts = np.sort(rng.random(n) * 2.0) - rng.random(n) * 0.2  # out of order, but never by more than max_delay
    table = pa.table(
        {
            "stream": np.where(rng.random(n) < 0.5, "R", "S"),
            "id": np.arange(n),
            "ts": ts,
            "key": rng.integers(0, 300, n),
            "value": rng.random(n),
        }
    )
    halves = [table.slice(0, n // 2), table.slice(n // 2)]
    for i, half in enumerate(halves):
        pq.write_table(half, tmp_path / f"half-{i}.parquet")
    settings = {
        **SHARDED,
        "cluster.dispatchers": 2,
        "source.kind": "zmq",
        "join.window": 0.3,
        "source.endpoint": f"tcp://127.0.0.1:{port}",
        "source.idle_timeout": 600.0,
    }
    cluster = subprocess.Popen(
        [sys.executable, "-m", "deploy.launch", "-n", "4", "--", "--config", str(write_config(tmp_path, settings))],
        env=mpi_env(),
        stderr=subprocess.PIPE,
        text=True,
    )
    producer = start("control.produce", tmp_path / "half-0.parquet", "--endpoint", f"tcp://127.0.0.1:{port}")
    from control import replay  # in this process, on the tests' Spark session (a JVM of its own costs ~20 s)

    assert (
        replay.main(
            [
                str(tmp_path / "half-1.parquet"),
                "--speed",
                "max",
                "--endpoint",
                f"tcp://127.0.0.1:{port + 1}",
                "--set",
                f"output.path={tmp_path / 'replay-out'}",
            ],
            spark,
        )
        == 0
    )
    finish(producer)
    _, err = cluster.communicate(timeout=300)
    assert cluster.returncode == 0, err
    expected, _ = reference_pairs(
        (table["stream"].to_numpy(zero_copy_only=False) == "S").astype(int),
        table["id"].to_numpy(),
        ts,
        table["key"].to_numpy(),
        0.3,
        SMALL["join.max_delay"],
    )
    from tests.runs import Run

    run = Run(tmp_path / "out", cluster)
    got = np.sort(run.pairs())
    assert len(expected) > 1000 and np.array_equal(got, expected)
    ingest = run.summary["zmq_ingest"]  # both dispatchers' sockets, added up
    assert ingest["endpoints"] == [f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}"]
    assert ingest["tuples"] == n and ingest["producers_ended"] == 2
