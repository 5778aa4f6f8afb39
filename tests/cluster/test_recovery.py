"""Crashes under the supervisor: a slave is SIGKILLed (at a batch, while writing a checkpoint, in the middle
of a partition-group move, or from outside at a random moment) and the recovered cluster's result set is
exactly the reference join over the whole input -- nothing lost, nothing twice."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import numpy as np
import psutil
import pyarrow.parquet as pq
import pytest

from control.checkpoints import scan
from protocol import checkpoint

from deploy.launch import mpi_env
from tests.runs import Run, run_cluster, soak, write_config
from tests.cluster.test_balance_cluster import FORCED_CHURN, straggler
from protocol.output import read_tables
from tests.cluster.test_cluster import SMALL, check_exact, reference_for, write_generated

# paced so the run spans many checkpoints: 3 s of event time, 2 x 3000 tuples/s, fed at 6000 tuples/s
CKPT = dict(
    SMALL, **{"generator.duration": 3.0, "source.rate": 6000.0, "checkpoint.interval": 2, "epochs.distribution": 0.1}
)
SUPERVISE = [sys.executable, "-m", "control.supervise", "--backoff", "0.1", "--restarts", "3", "--"]


def crash_run(tmp_path, ranks, settings, fault=None, env_extra=None, **kw):
    env = {"STREAMJOIN_FAULT": f"{fault}:{tmp_path / 'fault-fired'}"} if fault else None
    if env_extra:
        env = {**(env or {}), **env_extra}
    run, expected = check_exact(tmp_path, ranks, settings, wrapper=SUPERVISE, env=env, **kw)
    if fault:
        assert (tmp_path / "fault-fired").exists(), "the fault never fired: the test tested nothing"
        assert "restart 1 of 3" in run.stderr
        assert run.summary["checkpoints"]["recovered_from"] is not None, run.stderr
    return run, expected


@pytest.mark.parametrize("rank,batch", [soak(1, 1), (2, 3)])
def test_slave_killed_at_a_batch(tmp_path, rank, batch):
    run, _ = crash_run(
        tmp_path, 3, dict(CKPT, **{"generator.seed": batch}), fault=f"{rank}:batch-after-checkpoint:{batch}"
    )
    # the resumed run goes on taking checkpoints (how many depends on the host: each waits for quiet, which a
    # loaded host gives less often; two CPU hogs beside the suite left one)
    assert run.summary["checkpoints"]["written"] >= 1


def test_a_slave_fault_late_in_a_short_input_fires_on_batches_without_tuples(tmp_path):
    """A few hundred tuples, taken in one or two batches, and a fault at slave 1's 40th batch after a complete
    checkpoint: only the batches without tuples that the master sends while it holds the input's end for the
    pending fault (master.sources.HeldEnd) bring it; before them the end was held for a minute and the fault
    never fired."""
    settings = dict(
        SMALL,
        **{
            "generator.duration": 0.4,
            "generator.rate": 300.0,
            "generator.seed": 23,
            "checkpoint.interval": 2,
            "epochs.distribution": 0.1,
        },
    )
    run, expected = crash_run(tmp_path, 3, settings, fault="1:batch-after-checkpoint:40")
    assert 0 < run.summary["input_total"] < 400 and len(expected) > 0


def test_slave_killed_while_writing_a_checkpoint_resumes_from_the_one_before(tmp_path):
    run, _ = crash_run(tmp_path, 3, dict(CKPT, **{"generator.seed": 5}), fault="2:checkpoint:4")
    assert "ckpt-000004: " in run.stderr and "not completed" in run.stderr  # the half-written one is skipped
    assert run.summary["checkpoints"]["recovered_from"] == 3


def test_slave_killed_in_the_middle_of_a_partition_group_move(tmp_path):
    # one slave at start, and it straggles: it supplies groups to joining slaves (see FORCED_CHURN)
    # a checkpoint every 4 distribution epochs (0.2 s) and the 4th move (0.6 s or later): one is complete by then
    settings = {**CKPT, **FORCED_CHURN, "generator.seed": 7, "checkpoint.interval": 4, "generator.rate": 8000.0}
    run, _ = crash_run(tmp_path, 4, settings, fault="1:move:4", env_extra=straggler(1))
    assert len(run.summary["balance"]["moves"]) > 0


def test_slave_killed_from_outside_at_a_random_moment(tmp_path):
    rng = np.random.default_rng()
    delay = float(rng.uniform(1.5, 3.0))
    victims: list[int] = []

    def kill_a_slave():  # SIGKILL one slave rank (not the master) of the running job, like a failed host
        deadline = time.time() + delay
        while time.time() < deadline or not victims:
            time.sleep(0.05)
            if time.time() < deadline:
                continue
            for p in psutil.process_iter(["cmdline", "environ"]):
                try:
                    if (
                        "master" in (p.info["cmdline"] or [])
                        and str(tmp_path) in " ".join(p.info["cmdline"])
                        and (p.info["environ"] or {}).get("OMPI_COMM_WORLD_RANK") not in (None, "0")
                    ):
                        p.kill()
                        victims.append(p.pid)
                        return
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
            if time.time() > deadline + 10:
                return

    killer = threading.Thread(target=kill_a_slave, daemon=True)
    killer.start()
    run, _ = crash_run(tmp_path, 4, dict(CKPT, **{"generator.seed": 11, "generator.duration": 5.0}))
    killer.join()
    assert victims, f"no slave was found to kill after {delay:.1f}s"
    assert "restart 1 of 3" in run.stderr


def test_corrupt_newest_checkpoint_is_skipped_with_a_message(tmp_path):
    settings = dict(CKPT, **{"generator.seed": 13})
    first = run_cluster(tmp_path, 3, settings, env={"STREAMJOIN_FAULT": f"1:batch:6:{tmp_path / 'fired'}"})
    assert first.returncode != 0
    ckpts = sorted((tmp_path / "out" / "checkpoints").glob("ckpt-*"))
    assert len(ckpts) == 2  # checkpoint.keep
    part = ckpts[-1] / "slave-002.state"
    part.write_bytes(part.read_bytes()[:-8])  # lost its tail
    run, _ = check_exact(tmp_path, 3, settings, extra_args=["--recover"])
    assert f"skipping checkpoint {ckpts[-1].name}" in run.stderr and "manifest says" in run.stderr
    assert run.summary["checkpoints"]["recovered_from"] == int(ckpts[0].name.split("-")[1])


def test_the_archive_holds_exactly_the_accepted_input(tmp_path):
    run, _ = crash_run(tmp_path, 3, dict(CKPT, **{"generator.seed": 17}), fault="1:batch-after-checkpoint:2")
    archive = pq.ParquetDataset(tmp_path / "out" / "archive").read()
    s = run.summary
    assert archive.num_rows == s["input_total"] + s["late"]
    assert (
        len(np.unique(archive["id"].to_numpy() * 2 + (archive["stream"].to_numpy(zero_copy_only=False) == "S")))
        == archive.num_rows
    )


@pytest.mark.parametrize("victim,point", [(3, "batch-after-checkpoint:2"), soak(2, "checkpoint:3")])
def test_several_dispatchers_checkpoint_a_consistent_cut_and_recover(tmp_path, victim, point):
    # 2 dispatchers with random delays before every send: each snapshots its share and sends its marker, and a
    # slave writes its state only with both markers in; a slave dies at a batch or while writing a checkpoint
    settings = dict(CKPT, **{"cluster.dispatchers": 2, "generator.seed": 60 + victim})
    run, _ = crash_run(tmp_path, 5, settings, fault=f"{victim}:{point}", env_extra={"STREAMJOIN_JITTER": "0.005"})
    directory, manifest = checkpoint.latest_complete(tmp_path / "out" / "checkpoints")
    assert {"master.state", "master-d1.state", "slave-002.state", "slave-004.state"} <= set(manifest["parts"])
    assert set(manifest["commit"]["archive"]) == {"input-d0", "input-d1"}
    # the archive holds each dispatcher's share exactly once across the crash
    archive = pq.ParquetDataset(tmp_path / "out" / "archive").read()
    assert archive.num_rows == run.summary["input_total"] + run.summary["late"]


@pytest.mark.parametrize("dispatchers,ranks", [soak(1, 3), (2, 5)])
def test_a_file_source_resumes_at_its_row_and_lists_each_bad_row_once(tmp_path, dispatchers, ranks):
    # Parquet in row groups of 500 rows: the resumed run skips the row groups before the checkpoint's row
    # (rejected rows are listed in files of 2 rows, so some are written after the last checkpoint before the crash)
    settings = dict(
        CKPT, **{"generator.seed": 23 + dispatchers, "cluster.dispatchers": dispatchers, "output.flush_rows": 2}
    )
    path = tmp_path / "in.parquet"
    inserted = write_generated(path, settings, row_group=500, bad_every=700)
    settings.update({"source.kind": "file", "source.path": str(path)})
    run, _ = crash_run(tmp_path, ranks, settings, fault=f"{ranks - 1}:batch-after-checkpoint:2")
    _, manifest = checkpoint.latest_complete(tmp_path / "out" / "checkpoints")
    assert manifest["master"]["source"]["row"] > 0
    rows = read_tables(tmp_path / "out" / "rejected").column("row").to_pylist()
    assert len(rows) == len(set(rows)) == inserted == run.summary["rejected"]


def test_fresh_start_removes_an_older_runs_checkpoints(tmp_path):
    settings = dict(CKPT, **{"generator.seed": 19, "generator.duration": 1.5})
    run_cluster(tmp_path, 2, settings)
    old = sorted((tmp_path / "out" / "checkpoints").glob("ckpt-*"))
    assert old
    marker = old[-1] / "from-the-old-run"
    marker.touch()
    run_cluster(tmp_path, 2, settings)
    assert not marker.exists()


def test_checkpoint_verify_with_spark_finds_a_false_claim(tmp_path, spark):
    run_cluster(tmp_path, 3, dict(CKPT, **{"generator.seed": 23, "generator.duration": 1.5}))
    directory, manifest = checkpoint.latest_complete(tmp_path / "out" / "checkpoints")
    assert scan(spark, directory, manifest) == []
    assert sum(p["tuples"] for p in manifest["parts"].values()) > 0
    manifest["parts"]["slave-002.state"]["tuples"] += 1
    assert scan(spark, directory, manifest) == [
        f"slave-002.state: holds {manifest['parts']['slave-002.state']['tuples'] - 1} tuples, "
        f"the manifest says {manifest['parts']['slave-002.state']['tuples']}"
    ]


def test_launch_through_a_hostfile_with_localhost_slots(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("# one host here; hosts.example shows several\nlocalhost slots=4\n")
    settings = dict(SMALL, **{"generator.seed": 29})
    expected, _, _ = reference_for(settings)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "deploy.launch",
            "-n",
            "3",
            "--hostfile",
            str(hosts),
            "--",
            "--config",
            str(write_config(tmp_path, settings)),
        ],
        env=mpi_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr
    got = Run(tmp_path / "out", proc).pairs()
    assert len(got) == len(expected) and np.array_equal(np.sort(got), expected)


def test_aggregation_after_a_crash_equals_the_reference_aggregation(tmp_path):
    # partials written after the last checkpoint are staged and replaced; published ones are never recounted
    from protocol.output import read_tables
    from tests.cluster.test_spark_control import assert_view, reference_view
    from tests.unit.test_aggregate_logic import file_spec, merged_partials

    settings = dict(
        CKPT,
        **{
            "generator.seed": 31,
            "aggregate.enabled": True,
            "aggregate.window": 0.5,
            "aggregate.flush_interval": 0.05,
            "output.result_chunk_rows": 50,
        },
    )  # batches in chunks
    run, _ = crash_run(tmp_path, 3, settings, fault="2:batch-after-checkpoint:2")
    assert run.summary["result_chunks"]["chunked_batches"] > 0
    staged = tmp_path / "out" / checkpoint.PENDING_AGGREGATES
    assert not staged.exists() or not any(staged.iterdir())  # all published at the end
    spec = file_spec("aggregate.window=0.5")
    view = merged_partials([read_tables(tmp_path / "out" / "aggregates")], spec)
    assert_view(view, reference_view(settings, "key", "r_value", 0.5), spec)


def test_a_slave_that_stops_answering_ends_the_job_with_what_the_master_waits_for(tmp_path):
    # slave 2 never answers its 5th batch: the stall watch ends the job (bounded, non-zero, named) instead of the
    # progress line repeating forever
    settings = dict(CKPT, **{"generator.seed": 41, "master.stall_timeout": 2.0})
    started = time.time()
    run = run_cluster(
        tmp_path, 3, settings, timeout=120, env={"STREAMJOIN_FAULT": f"2:hang-batch:5:{tmp_path / 'fired'}"}
    )
    assert (tmp_path / "fired").exists() and run.returncode not in (0, 2)
    assert "stalled:" in run.stderr and "waiting for the report of slave(s) [2]" in run.stderr, run.stderr
    assert time.time() - started < 60


def test_a_slave_joining_a_long_batch_is_not_taken_for_a_stalled_one(tmp_path):
    # a hot key's batch may take longer than the stall watch's bound: its results come in chunks (here 0.5 s
    # each, 2.5 s or more in all against a 2 s bound: a loaded host may take more than 1 s over one chunk) and
    # the slave says once an epoch that it is still joining
    settings = dict(
        SMALL,
        **{
            "generator.duration": 1.0,
            "generator.distribution": "uniform",
            "generator.keys": 16,
            "generator.seed": 3,
            "output.result_chunk_rows": 40000,
            "master.stall_timeout": 2.0,
            "output.progress": 0.2,
        },
    )
    run, expected = check_exact(tmp_path, 2, settings, env={"STREAMJOIN_SLOW_CHUNKS": "1:0.5"})
    # a batch of 5 chunks or more: 2.5 s of writing or more, longer than the bound and than LONG_BATCH
    assert run.summary["result_chunks"]["largest_batch_results"] > 4 * 40000, run.summary["result_chunks"]
    assert "| slave 1 still joining one batch after " in run.stderr, run.stderr  # the progress line says why


def test_a_stalled_cluster_with_hot_keys_is_restarted_by_the_supervisor_and_stays_exact(tmp_path):
    # a recovered cluster with hot keys drains every tuple; a stall ends the run, the supervisor restarts
    # it from the newest checkpoint (the fault fires once), and the result is the reference's
    settings = dict(
        CKPT,
        **{
            "generator.seed": 43,
            "generator.rate": 1500.0,  # half, paced at half: the same wall time, a quarter of the hot pairs
            "source.rate": 3000.0,
            "generator.hot_share": 0.3,
            "generator.keys": 65536,
            "hotkeys.enabled": True,
            "hotkeys.threshold": 0.15,
            "epochs.reorganization": 0.3,
            "master.stall_timeout": 2.0,
        },
    )
    run, _ = crash_run(tmp_path, 4, settings, fault="3:hang-batch-after-checkpoint:2")
    assert "stalled:" in run.stderr
    # the key was split in the stalled run or the restarted one (a split made before the checkpoint the restart
    # resumes from is in its state, not in its summary's log)
    assert "split out of partition-group" in run.stderr, run.stderr


@pytest.mark.parametrize("dispatchers", [soak(1), 2])
def test_a_zmq_run_killed_under_the_supervisor_loses_nothing_the_producer_sent(tmp_path, dispatchers):
    """SIGKILL of a slave with the ZeroMQ source: the producer CLI keeps what no checkpoint holds, resends it to
    the restarted cluster (its ACKs name a new run), and the master drops what it already has: the result set is
    exactly the reference join over everything the producer sent (it used to lose what came after the checkpoint).
    With 2 dispatchers each has its own producer, endpoint and acknowledgements (port + i), and learns from rank
    0 when a checkpoint holding its part is complete (they used to be refused).  The disorder stays below
    max_delay there: each dispatcher judges lateness on its own share, which the whole-input reference does not."""
    from tests.runs import free_port
    from tests.cluster.test_zmq_cluster import finish, make_input, start, write_input
    from tests.reference import reference_pairs

    rng = np.random.default_rng(53)
    stream, ids, ts, keys = make_input(rng, 9000, 300, disorder=0.2 if dispatchers == 1 else 0.15)
    ingest, acks = free_port(dispatchers), free_port(dispatchers)
    producers = []
    for i in range(dispatchers):  # each dispatcher's producer sends every k-th row
        mine = np.arange(i, 9000, dispatchers)
        write_input(tmp_path / f"in-{i}.csv", stream[mine], ids[mine], ts[mine], keys[mine])
        producers.append(
            start(
                "control.produce",
                tmp_path / f"in-{i}.csv",
                "--endpoint",
                f"tcp://127.0.0.1:{ingest + i}",
                "--batch",
                300,
                "--ack-endpoint",
                f"tcp://127.0.0.1:{acks + i}",
                "--name",
                f"feed-{i}",
                "--timeout",
                120,
            )
        )
    settings = {
        "source.kind": "zmq",
        "source.endpoint": f"tcp://127.0.0.1:{ingest}",
        "source.idle_timeout": 60.0,
        "source.ack_endpoint": f"tcp://127.0.0.1:{acks}",
        "source.rate": 6000.0 / dispatchers,
        "checkpoint.interval": 2,
        "epochs.distribution": 0.1,
        "join.window": 0.3,
        "join.max_delay": 0.2,
        "cluster.dispatchers": dispatchers,
    }
    victim = dispatchers  # the first slave
    run = run_cluster(
        tmp_path,
        dispatchers + 2,
        settings,
        wrapper=SUPERVISE,
        timeout=150,
        env={"STREAMJOIN_FAULT": f"{victim}:checkpoint:2:{tmp_path / 'fault-fired'}"},
    )
    sent = [finish(p) for p in producers]
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "fault-fired").exists() and "restart 1 of 3" in run.stderr
    assert run.summary["checkpoints"]["recovered_from"] is not None, run.stderr
    assert all(s["tuples_sent"] == 9000 // dispatchers and s["confirmed"] for s in sent), sent
    assert sum(s["tuples_resent"] for s in sent) > 0, sent
    expected, expected_late = reference_pairs(stream, ids, ts, keys, 0.3, 0.2)
    np.testing.assert_array_equal(run.pairs(), expected)
    np.testing.assert_array_equal(run.late_ids(), expected_late)
    z = run.summary["zmq_ingest"]
    assert z["lost_tuples"] == 0 and z["producers"] == {f"feed-{i}": 9000 // dispatchers for i in range(dispatchers)}
    # every dispatcher published every checkpoint of the final run (the others as rank 0 told them: COMMITTED)
    assert z["checkpoints_acknowledged"] == dispatchers * run.summary["checkpoints"]["written"], z
    assert run.summary["input_total"] + run.summary["late"] == 9000
