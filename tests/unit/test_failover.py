"""The pure parts of running on several hosts and surviving one's loss, fed events in-process: the failure
detector's state, the reading of Open MPI's reports, the placement, the rescale of a checkpoint and the
supervisor's restart on the hosts that answer."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from control.supervise import Hosts, supervise
from deploy.hosts import Host, HostfileError, describe, place, read_hostfile
from deploy.job import JobWatch
from protocol import checkpoint
from protocol.lifetime import CRASH, INPUT_LOST, LOST, START_FAILED
from protocol.liveness import Liveness, heartbeat_interval
from protocol.plan import load_plan


# -- the failure detector -------------------------------------------------------------------------------------
def test_the_default_timeout_is_5s_or_20_epochs_and_beats_come_at_least_once_an_epoch():
    timeout = lambda *settings: load_plan(overrides=list(settings)).cluster.heartbeat_timeout
    assert timeout("epochs.distribution=0.25") == 5.0
    assert timeout("epochs.distribution=1.0") == 20.0
    assert timeout("cluster.heartbeat_timeout=2.0", "epochs.distribution=1.0") == 2.0
    assert heartbeat_interval(5.0, 0.25) == 0.25 and heartbeat_interval(2.0, 1.0) == 0.4


def test_a_peer_silent_past_the_timeout_is_lost_and_one_that_spoke_is_not():
    live = Liveness([1, 2], timeout=5.0, interval=1.0, now=0.0)
    for t in np.arange(0.5, 5.1, 0.5):
        live.on_heard(1, t)
        assert live.lost(t) == []
    live.on_heard(1, 5.5)
    assert live.lost(5.5) == [(2, 5.5)]


def test_heartbeats_are_due_once_per_interval():
    live = Liveness([1, 2], timeout=5.0, interval=1.0, now=0.0)
    assert live.due(0.0) == [1, 2] and live.due(0.5) == [] and live.due(1.0) == [1, 2]


def test_a_peer_that_said_its_last_word_is_no_longer_watched():
    live = Liveness([1, 2], timeout=5.0, interval=1.0, now=0.0)
    live.forget(2)
    for t in range(1, 10):
        live.on_heard(1, t)
        assert live.lost(t) == []
    assert live.due(10.0) == [1]


def test_a_process_that_itself_stood_still_does_not_blame_its_peers():
    live = Liveness([1], timeout=5.0, interval=1.0, now=0.0)
    assert live.lost(1.0) == []
    assert live.lost(60.0) == []  # SIGSTOP for a minute: the silence was its own
    assert live.lost(62.0) == [] and live.lost(64.0) == [] and live.lost(65.5) == [(1, 5.5)]


# -- Open MPI's reports --------------------------------------------------------------------------------------
DASH = "-" * 74 + "\n"
STARTED = "started: 1 master + 4 slaves on 3 hosts (h1: 0-1; h2: 2-3; h3: 4); heartbeat_timeout 5s\n"


def watched(*lines: str) -> JobWatch:
    w = JobWatch()
    for line in "".join(lines).splitlines(keepends=True):
        w.feed(line, 1.0)
    return w


def test_a_ranks_abort_gives_its_code():
    w = watched(
        STARTED,
        DASH,
        "MPI_ABORT was invoked on rank 0 in communicator MPI COMM 3 DUP FROM 0\n",
        "  Proc: [[36896,1],0]\n",
        "  Errorcode: 4\n",
        DASH,
    )
    assert w.aborted == (0, 4) and w.outcome(-9, []) == (4, "")


def test_a_rank_killed_by_a_signal_is_a_lost_rank_named_with_its_host():
    w = watched(
        STARTED,
        DASH,
        "prterun noticed that process rank 3 with PID 9440 on node h2 exited on\n",
        "signal 9 (Killed).\n",
        DASH,
    )
    code, why = w.outcome(137, [])
    assert code == LOST and "rank 3 on host h2 was killed by signal 9 (SIGKILL)" in why


def test_a_lost_daemon_is_a_lost_rank_even_when_mpirun_says_0():
    w = watched(
        STARTED,
        DASH,
        "PRTE has lost communication with a remote daemon.\n",
        "\n",
        "  HNP daemon   : [prterun-h1-9950@0,0] on node h1\n",
        "  Remote daemon: [prterun-h1-9950@0,2] on node h3\n",
        DASH,
    )
    code, why = w.outcome(0, [])
    assert code == LOST and "host h3 (ranks 4)" in why


def test_open_mpis_own_codes_become_documented_ones():
    assert watched(STARTED).outcome(14, [])[0] == LOST  # "Socket closed" under a rank that ran
    failed = watched(
        "ssh: connect to host 10.77.0.3 port 22: Connection timed out\n",
        DASH,
        "A daemon failed to report back after being spawned.\n",
        "  Remote host:   10.77.0.3\n",
        DASH,
    )
    code, why = failed.outcome(255, [])
    assert code == START_FAILED and "host 10.77.0.3 did not answer" in why
    assert watched(STARTED).outcome(3, []) == (3, "")  # a rank's own code passes
    assert (
        watched(STARTED, DASH, "MPI_ABORT was invoked on rank 2 ... Errorcode: 77\n", DASH).outcome(1, [])[0] == CRASH
    )


def test_a_second_stop_signal_ends_with_its_number():
    assert watched(STARTED).outcome(-15, [15, 2]) == (130, "")


# -- placement --------------------------------------------------------------------------------------------
def test_the_hostfile_is_read_as_open_mpi_reads_it(tmp_path):
    f = tmp_path / "hosts"
    f.write_text("# cluster\nnode1 slots=4 max_slots=8\nnode2   # no slots\nnode1 slots=2\n")
    assert read_hostfile(f) == [Host("node1", 6, True), Host("node2", 1, False)]
    f.write_text("node1 slots=x\n")
    with pytest.raises(HostfileError, match="line 1"):
        read_hostfile(f)
    f.write_text("# nothing\n")
    with pytest.raises(HostfileError, match="names no host"):
        read_hostfile(f)


def test_ranks_fill_hosts_in_order_and_spread_beyond_their_slots_by_slots():
    hosts = [Host("a", 2), Host("b", 2), Host("c", 1)]
    assert [n for _, n in place(hosts, 5)] == [2, 2, 1]
    assert [(h.name, n) for h, n in place(hosts, 3)] == [("a", 2), ("b", 1)]
    assert [n for _, n in place(hosts, 7)] == [3, 3, 1]
    assert [n for _, n in place(hosts, 17)] == [7, 7, 3]
    assert describe(place(hosts, 7)) == (
        "placement: a: ranks 0-2, 1 over its 2 slots: oversubscribed; "
        "b: ranks 3-5, 1 over its 2 slots: oversubscribed; c: rank 6"
    )


# -- a checkpoint on another slave count --------------------------------------------------------------------
def test_on_the_same_slaves_the_partition_map_stays():
    m = np.array([1, 2, 3, 1, 1, -1])
    assert np.array_equal(checkpoint.reassign(m, [1, 2, 3], [1, 2, 3]), m)


def test_groups_of_a_slave_gone_go_to_the_others_and_new_slaves_get_their_share():
    m = np.array([1, 2, 3, 4] * 5 + [-1, -1])
    fewer = checkpoint.reassign(m, [1, 2], [1, 2, 3, 4])
    assert np.array_equal(fewer[m == 1], m[m == 1]) and np.array_equal(fewer[m == 2], m[m == 2])
    assert sorted(np.bincount(fewer[fewer >= 0])[1:].tolist()) == [10, 10] and (fewer[-2:] == -1).all()
    more = checkpoint.reassign(np.array([1, 2] * 6), [1, 2, 3, 4], [1, 2])
    assert np.bincount(more)[1:].tolist() == [3, 3, 3, 3]


def test_each_slave_reads_the_parts_that_hold_its_groups():
    manifest = {
        "slaves": 2,
        "config": {"cluster": {"dispatchers": 1}},
        "master": {"controller": {"partition_map": [1, 2, 1, 2]}},
    }
    assert checkpoint.slave_assignment(manifest, [1, 2]) == {
        "1": [["slave-001.state", None]],
        "2": [["slave-002.state", None]],
    }
    assert checkpoint.slave_assignment(manifest, [1]) == {
        "1": [["slave-001.state", [0, 2]], ["slave-002.state", [1, 3]]]
    }


# -- the supervisor ---------------------------------------------------------------------------------------
def hosted(tmp_path) -> Hosts:
    (tmp_path / "hosts").write_text("a slots=2\nb slots=2\nc slots=1\n")
    cmd = [
        "python",
        "-m",
        "deploy.launch",
        "-n",
        "5",
        "--hostfile",
        str(tmp_path / "hosts"),
        "--",
        "--set",
        "cluster.dispatchers=1",
    ]
    work = tmp_path / "work"
    work.mkdir()
    return Hosts(cmd, work)


def test_a_restart_leaves_out_the_ranks_of_a_silent_host_and_takes_it_back_later(tmp_path):
    hosts = hosted(tmp_path)
    cmd, used = hosts.for_restart({"a", "b"}, min_slaves=1)
    assert used == {"hosts": ["a", "b"], "left_out": ["c"], "slaves": 3}
    assert cmd[cmd.index("-n") + 1] == "4" and cmd[-3:] == ["--", "--set", "cluster.dispatchers=1"]
    assert (tmp_path / "work" / cmd[cmd.index("--hostfile") + 1]).read_text() == "a slots=2\nb slots=2\n"
    cmd, used = hosts.for_restart({"a", "b", "c"}, min_slaves=1)
    assert used["left_out"] == [] and cmd[cmd.index("-n") + 1] == "5"


def test_too_few_slaves_left_is_no_restart(tmp_path):
    cmd, used = hosted(tmp_path).for_restart({"c"}, min_slaves=2)
    assert cmd is None and used["slaves"] == 0


def test_restarts_back_off_exponentially():
    waits, said = [], []
    assert (
        supervise(
            [sys.executable, "-c", "raise SystemExit(4)"], 4, 0.5, log=said.append, max_backoff=3.0, sleep=waits.append
        )
        == 4
    )
    assert waits == [0.5, 1.0, 2.0, 3.0]


def test_records_deleted_before_they_were_read_are_no_restart():
    """Exit 8 (a Kafka stream's records deleted below its position): a restart would meet the same hole."""
    waits = []
    command = [sys.executable, "-c", f"raise SystemExit({INPUT_LOST})"]
    assert supervise(command, 4, 0.5, log=lambda _: None, sleep=waits.append) == INPUT_LOST and waits == []
