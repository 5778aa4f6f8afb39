"""The command line as a user meets it: clear errors before start, a clean stop on Ctrl-C."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from deploy.launch import mpi_env, mpirun_command
from common.workload import generate_all
from protocol.plan import load_plan
from tests.runs import Run
from tests.reference import reference_pairs

ROOT = Path(__file__).resolve().parent.parent.parent


def run_master(args: list[str], ranks: int = 3) -> subprocess.CompletedProcess:
    return subprocess.run(mpirun_command(ranks, args), env=mpi_env(), capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--set", "join.windw=2"], "unknown key join.windw"),
        (["--set", "join.window=-1"], "join.window: must be >= 0"),
        (["--set", "join.window=soon"], "join.window: expected a number"),
        (["--set", "partitioning.partitions=1"], "partitioning.partitions: must be >= the number of slaves (2)"),
        (
            ["--set", "source.kind=file", "--set", "source.path=/nonexistent/in.csv"],
            "'/nonexistent/in.csv' does not exist",
        ),
        (["--config", "/nonexistent/run.toml"], "config file '/nonexistent/run.toml' does not exist"),
    ],
)
def test_user_mistakes_stop_before_start_with_one_clear_message(tmp_path, args, needle):
    proc = run_master(args + ["--set", f"output.path={tmp_path}/out"])
    assert proc.returncode != 0
    assert needle in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out" / "summary.json").exists()


def test_single_process_explains_how_to_launch():
    proc = subprocess.run(
        [sys.executable, "-m", "master"], cwd=ROOT, env=mpi_env(), capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2
    assert "mpirun -n" in proc.stderr and "Traceback" not in proc.stderr


def test_ctrl_c_stops_cleanly_with_every_result_of_the_accepted_prefix(tmp_path):
    settings = [
        "generator.duration=60",
        "generator.rate=2000",
        "generator.keys=2048",
        "join.window=0.5",
        "join.max_delay=0.2",
        "generator.disorder=0.1",
        "source.rate=4000",
    ]
    out = tmp_path / "out"
    args = [f"--set={s}" for s in settings] + [
        f"--set=output.path={out}",
        "--set=output.progress=0.5",
        "--set=metrics.endpoint=127.0.0.1:0",
    ]  # tests run side by side
    proc = subprocess.Popen(
        [sys.executable, "-m", "deploy.launch", "-n", "4", "--", *args],
        cwd=ROOT,
        env=mpi_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while "results" not in proc.stderr.readline():  # wait for the first progress line
        assert time.monotonic() < deadline and proc.poll() is None
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped_by_signal"] is True
    taken = summary["input_total"] + summary["late"]
    assert 0 < taken < 240000  # stopped early, not at the end of the input
    data = generate_all(load_plan(None, settings).generator)
    expected, _ = reference_pairs(data.stream[:taken], data.id[:taken], data.ts[:taken], data.key[:taken], 0.5, 0.2)
    run = Run(out, subprocess.CompletedProcess([], 0, "", err))
    assert np.array_equal(run.pairs(), expected)


@pytest.fixture
def short_tmp():
    """A folder under /tmp with a short path: a socket's path has at most 107 bytes (pytest's are longer)."""
    folder = Path(tempfile.mkdtemp(prefix="sj", dir="/tmp"))
    yield folder
    shutil.rmtree(folder)


def test_a_killed_mpiruns_leftover_sockets_do_not_stop_the_next_launch(short_tmp):
    """A killed mpirun leaves its PMIx rendezvous sockets in $TMPDIR/ompi.<pid>/; an mpirun that later got the
    same pid could not bind them ("listener thread failed to start", exit 213: it failed a CI run).  Leftovers
    planted for the next pids in the user's TMPDIR must not matter: each launch has a folder of its own."""
    with open("/proc/sys/kernel/pid_max") as f:
        pid_max = int(f.read())
    nxt = os.getpid()
    for pid in {(nxt + i) % pid_max for i in range(1, 1500)}:
        folder = short_tmp / f"ompi.{pid}"
        folder.mkdir()
        for name in (f"pmix.vm.tool.{pid}", "pmix.vm.tool", f"pmix.vm.tool.prterun-vm-{pid}@0"):
            s = socket.socket(socket.AF_UNIX)
            s.bind(str(folder / name))
            s.close()
    proc = subprocess.run(
        [sys.executable, "-m", "deploy.launch", "-n", "2", "--module", "platform"],
        cwd=ROOT,
        env={**os.environ, "TMPDIR": str(short_tmp)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-1500:]
    assert len(proc.stdout.splitlines()) == 2  # both ranks ran
    assert sorted(p.name for p in short_tmp.iterdir() if not p.name.startswith("ompi.")) == []  # and cleaned up


@pytest.mark.parametrize("exported", [None, "self,sm"])
def test_a_bare_mpirun_leaves_out_the_transports_that_only_slow_the_start(tmp_path, exported):
    """Under a bare `mpirun -n 2 python -m master` the ranks choose Open MPI's transports themselves, as
    deploy.launch does (protocol.startup.BTL: libfabric's probe waits about a second in MPI_Init); a value the
    user exported wins.  Open MPI's own log of the components it loads tells."""
    from deploy.launch import find_mpirun

    env = {k: v for k, v in mpi_env().items() if k != "OMPI_MCA_btl"}
    env |= {"OMPI_MCA_btl_base_verbose": "100", **({"OMPI_MCA_btl": exported} if exported else {})}
    cmd = [find_mpirun(), "--oversubscribe", "-n", "2", sys.executable, "-P", "-m", "master"]
    cmd += ["--set", "generator.duration=0.2", "--set", f"output.path={tmp_path}/out"]
    cmd += ["--set", "metrics.endpoint=127.0.0.1:0"]  # not the default port: another test's run may hold it
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    opened = "components_open: found loaded component"
    loaded = {line.split()[-1] for line in proc.stderr.splitlines() if opened in line}
    assert loaded == ({"self", "sm", "tcp"} if exported is None else {"self", "sm"}), loaded
