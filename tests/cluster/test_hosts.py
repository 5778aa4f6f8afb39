"""Several hosts for real: three network namespaces with their own addresses, host names and links
(deploy.testbed), Open MPI's daemons started on them through an rsh agent.  Ranks go where the hostfile's
slots say and the results are exact; a host cut off, a frozen slave or a lost rank 0 ends the job within the
heartbeat timeout with the rank and host named and nothing left running; the supervisor finishes the run
exactly once on the hosts that remain and takes a host back once it answers.  Faults fire on events the
run prints (a checkpoint complete, a progress line with results), not on wall time."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from deploy.testbed import TestBed, TestBedError
from protocol.lifetime import START_FAILED
from protocol.startup import PLACED_HOSTS
from tests.runs import BedJob, Run, run_cluster
from tests.cluster.test_cluster import SMALL, reference_for

TIMEOUT = 3.0  #: cluster.heartbeat_timeout in these tests
#: a paced run of 8 s: 2 x 2500 tuples/s of event time for 8 s, fed at 5000 tuples/s
PACED = dict(
    SMALL,
    **{
        "generator.duration": 8.0,
        "generator.rate": 2500.0,
        "source.rate": 5000.0,
        "cluster.heartbeat_timeout": TIMEOUT,
        "output.progress": 0.5,
        "cluster.network": "10.77.0.0/24",
    },
)
SUPERVISE = [sys.executable, "-m", "control.supervise", "--backoff", "0.1", "--restarts", "3", "--"]


@pytest.fixture
def bed():
    try:
        with TestBed(3) as made:
            yield made
    except TestBedError as e:
        pytest.skip(f"no network namespaces here: {e}")


def with_results(line: str) -> bool:
    """A progress line once results come."""
    return line.startswith("[") and "| results " in line and "| results 0 |" not in line


def assert_exact(run: Run, settings: dict) -> None:
    expected, expected_late, n = reference_for(settings)
    got = run.pairs()
    assert len(np.unique(got)) == len(got), "a result was emitted twice"
    assert np.array_equal(np.sort(got), np.sort(expected)), (
        f"{len(np.setdiff1d(expected, got))} missing, {len(np.setdiff1d(got, expected))} extra of {len(expected)}"
    )
    assert np.array_equal(run.late_ids(), expected_late)
    assert run.summary["input_total"] + run.summary["late"] == n


def nothing_left(bed: TestBed, hosts, within: float) -> None:
    """No process runs on `hosts` any more within `within` seconds (ranks, Open MPI's daemons)."""
    end = time.monotonic() + within
    while any(bed.pids(i) for i in hosts) and time.monotonic() < end:
        time.sleep(0.2)
    left = {bed.name(i): bed.pids(i) for i in hosts if bed.pids(i)}
    assert not left, f"still running after {within}s: {left}"


def listening(bed: TestBed, host: int) -> set[int]:
    """The TCP ports listened on on `host`, but on loopback."""
    out = subprocess.run(["ip", "netns", "exec", bed.ns(host), "ss", "-Hltn"], capture_output=True, text=True).stdout
    local = [line.split()[3] for line in out.splitlines()]
    return {int(a.rsplit(":", 1)[1]) for a in local if not a.startswith(("127.", "[::1]"))}


def test_ranks_go_where_the_slots_say_the_join_is_exact_and_open_mpi_listens_on_its_ports(bed, tmp_path):
    settings = dict(PACED, **{"generator.duration": 6.0, "cluster.ports": "46000-46199"})
    job = BedJob(bed, tmp_path, 5, [2, 2, 1], settings)
    job.wait_for(with_results)
    ports = {host: listening(bed, host) for host in range(3)}
    run = job.finish()
    assert all(ports.values()) and all(46000 <= p <= 46199 for found in ports.values() for p in found), ports
    assert run.returncode == 0, run.stderr
    assert "placement: 10.77.0.1: ranks 0-1; 10.77.0.2: ranks 2-3; 10.77.0.3: rank 4" in run.stderr
    assert run.summary["hosts"] == {"h1": [0, 1], "h2": [2, 3], "h3": [4]}
    assert {r: v["host"] for r, v in run.summary["slaves"].items()} == {"1": "h1", "2": "h2", "3": "h2", "4": "h3"}
    assert_exact(run, settings)


def test_more_ranks_than_slots_are_spread_by_slots_and_said(bed, tmp_path):
    settings = dict(PACED, **{"generator.duration": 2.0, "source.rate": 0.0})
    run = BedJob(bed, tmp_path, 7, [2, 2, 1], settings).finish()
    assert run.returncode == 0, run.stderr
    assert "10.77.0.1: ranks 0-2, 1 over its 2 slots: oversubscribed" in run.stderr
    assert run.summary["hosts"] == {"h1": [0, 1, 2], "h2": [3, 4, 5], "h3": [6]}


@pytest.mark.parametrize("fault", ["cut", "stop"])
def test_a_slaves_host_cut_off_or_a_frozen_slave_ends_the_job_naming_it(bed, tmp_path, fault):
    job = BedJob(bed, tmp_path, 5, [2, 2, 1], PACED)
    job.wait_for(with_results)
    if fault == "cut":
        bed.cut(2)
    else:
        signal_rank(bed, 2, signal.SIGSTOP)  # host 3 runs rank 4 alone
    began = time.monotonic()
    run = job.finish()
    took = time.monotonic() - began
    assert run.returncode == 4, run.stderr
    assert "rank 4 (slave, host h3) is lost" in run.stderr
    assert took < TIMEOUT + 10, f"the loss ended the job only after {took:.1f}s"
    bed.mend(2)
    nothing_left(bed, range(3), within=10)


def signal_rank(bed: TestBed, host: int, sig: int) -> None:
    """Send `sig` to one rank on `host` (a python process there, not Open MPI's daemon)."""
    import psutil

    ranks = [
        p
        for p in map(psutil.Process, bed.pids(host))
        if p.name().startswith("python") and "master" in " ".join(p.cmdline())
    ]
    assert ranks, f"no rank runs on {bed.name(host)}"
    ranks[0].send_signal(sig)


def test_rank_0s_host_cut_off_every_slave_exits_by_itself(bed, tmp_path):
    job = BedJob(bed, tmp_path, 5, [2, 2, 1], PACED)
    job.wait_for(with_results)
    bed.cut(0)
    began = time.monotonic()
    nothing_left(bed, [1, 2], within=TIMEOUT + 10)
    assert time.monotonic() - began < TIMEOUT + 10
    run = job.finish()
    assert run.returncode == 4, run.stderr


def test_sigterm_to_the_launcher_while_a_host_is_cut_off_ends_it_within_seconds(bed, tmp_path):
    job = BedJob(bed, tmp_path, 5, [2, 2, 1], dict(PACED, **{"cluster.heartbeat_timeout": 5.0}))
    job.wait_for(with_results)
    bed.cut(2)
    launcher = [p for p in bed.pids(0) if "deploy.launch" in open(f"/proc/{p}/cmdline").read().replace("\0", " ")]
    began = time.monotonic()
    for pid in launcher:
        subprocess.run(["kill", "-TERM", str(pid)])
    run = job.finish()
    assert time.monotonic() - began < 15, run.stderr
    assert run.returncode == 4, run.stderr  # the stop waits for the cut slave, which the heartbeats find lost
    bed.mend(2)
    nothing_left(bed, range(3), within=10)


def test_the_supervisor_finishes_on_the_hosts_that_remain_and_takes_a_host_back(bed, tmp_path):
    settings = dict(PACED, **{"checkpoint.interval": 2, "generator.duration": 10.0, "generator.seed": 11})
    job = BedJob(bed, tmp_path, 5, [2, 2, 1], settings, wrapper=SUPERVISE)
    job.wait_for("checkpoint 2 complete")
    bed.cut(2)
    job.wait_for("restarting on 10.77.0.1, 10.77.0.2 with 3 slaves (left out, not answering: 10.77.0.3)")
    bed.mend(2)
    job.wait_for("checkpoint 4 complete")  # the restarted run on two hosts takes checkpoints on
    signal_rank(bed, 1, signal.SIGKILL)
    job.wait_for("restarting on 10.77.0.1, 10.77.0.2, 10.77.0.3 with 4 slaves")
    run = job.finish()
    assert run.returncode == 0, run.stderr
    # a start that failed (Open MPI's daemons, seconds after the host came back: exit START_FAILED) is tried again
    restarts = [r for r in run.summary["restarts"] if r["after_exit_code"] != START_FAILED]
    assert [(r["left_out"], r["slaves"]) for r in restarts] == [(["10.77.0.3"], 3), ([], 4)]
    assert run.summary["hosts"] == {"h1": [0, 1], "h2": [2, 3], "h3": [4]}
    assert_exact(run, settings)


def test_ranks_on_fewer_hosts_than_placed_end_the_job_as_a_user_mistake(tmp_path):
    """Open MPI not following the launcher's hostfile (all ranks on one host) is an error, not a silent success:
    here one host runs every rank while the launcher says it placed them on three."""
    run = run_cluster(tmp_path, 3, dict(SMALL, **{"generator.duration": 1.0}), env={PLACED_HOSTS: "3"})
    assert run.returncode == 2, run.stderr
    assert "placed the 3 ranks on 3 hosts, but they run on 1" in run.stderr
