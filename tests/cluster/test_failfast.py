"""Failures end the whole job, loudly and within a time bound: an exception on any rank, a mistake in the
arguments or the configuration.  Each case hung before: the other ranks waited for the failed one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import zmq.auth

from deploy.launch import find_mpirun, mpi_env
from tests.runs import run_cluster
from tests.cluster.test_cluster import SMALL

ROOT = Path(__file__).resolve().parent.parent.parent
BOUND = 120  #: seconds: a hang is a failure, not a slow pass (subprocess.TimeoutExpired)
#: a small paced run with late tuples (the master writes late files) and several result files per slave
RUN = dict(
    SMALL, **{"generator.duration": 3.0, "source.rate": 6000.0, "output.flush_rows": 2000, "generator.disorder": 0.6}
)


def crashed(tmp_path, ranks: int, injected: str, settings=RUN):
    """Run with the fault `injected` ("rank:point:n:error", protocol.faults.fail); it must end the job."""
    run = run_cluster(tmp_path, ranks, settings, timeout=BOUND, env={"STREAMJOIN_RAISE": injected})
    assert run.returncode not in (0, 2), run.stderr  # a crash, which the supervisor restarts
    assert run.summary is None
    return run


def one_error_line(stderr: str) -> str:
    """The failed rank's message (mpirun may print its own abort banner right after it, on the same line)."""
    assert stderr.count("error: rank ") == 1, stderr
    return stderr[stderr.index("error: rank ") :].split("; aborting the job")[0]


def test_a_full_disk_in_a_slaves_write_aborts_the_job_naming_the_rank_and_the_file(tmp_path):
    run = crashed(tmp_path, 4, "2:write:2:ENOSPC")
    line = one_error_line(run.stderr)
    assert line.startswith("error: rank 2 (slave) failed: OSError: ")
    assert f"cannot write {tmp_path}/out/results/slave-002-000001.parquet" in line
    assert "No space left on device" in line and "protocol/output.py" in line
    assert "Traceback" not in run.stderr  # the environment's fault, not a bug: one line says it all
    assert not list((tmp_path / "out" / "results").glob(".*.tmp"))  # no half-written file left behind


def test_a_real_full_disk_aborts_the_job(tmp_path):
    """The same on a real file system of 256 KiB (a tmpfs: needs root; skipped elsewhere)."""
    out = tmp_path / "out"
    out.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(out)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        run = run_cluster(tmp_path, 3, dict(RUN, **{"output.flush_rows": 20000}), timeout=BOUND)
    finally:
        subprocess.run(["umount", "-l", str(out)])
    assert run.returncode not in (0, 2), run.stderr
    line = one_error_line(run.stderr)
    assert "No space left on device" in line and f"cannot write {out}/" in line, line


def test_a_slaves_memory_error_aborts_the_job(tmp_path):
    run = crashed(tmp_path, 3, "1:batch:3:MemoryError")
    line = one_error_line(run.stderr)
    assert line.startswith("error: rank 1 (slave) failed: MemoryError: ") and "slave/run.py" in line


def test_a_librarys_panic_which_is_no_exception_aborts_the_job(tmp_path):
    run = crashed(tmp_path, 3, "1:batch:3:panic")
    line = one_error_line(run.stderr)
    assert line.startswith("error: rank 1 (slave) failed: Panic: injected at batch") and "Traceback" in run.stderr


def test_a_failure_on_the_master_aborts_the_job(tmp_path):
    run = crashed(tmp_path, 3, "0:write:1:EROFS")
    line = one_error_line(run.stderr)
    assert line.startswith("error: rank 0 (master) failed: OSError: ") and "Read-only file system" in line
    assert f"{tmp_path}/out/late/" in line or f"{tmp_path}/out/metrics/" in line  # its first write: late or metrics


def test_a_failure_on_a_further_dispatcher_aborts_the_job(tmp_path):
    run = crashed(tmp_path, 4, "1:write:1:EIO", dict(RUN, **{"cluster.dispatchers": 2}))
    assert one_error_line(run.stderr).startswith("error: rank 1 (dispatcher) failed: OSError: ")


@pytest.mark.parametrize(
    "args,needle",
    [(["--set", "join.window", "30"], "unrecognized arguments: 30"), (["--bogus"], "unrecognized arguments: --bogus")],
)
def test_a_bad_argument_ends_every_rank_with_exit_2_and_one_usage(tmp_path, args, needle):
    run = run_cluster(tmp_path, 4, {}, timeout=BOUND, extra_args=args)
    assert run.returncode == 2, run.stderr
    assert run.stderr.count(needle) == 1 and run.stderr.count("usage: python -m master") == 1
    assert "Traceback" not in run.stderr and "MPI_ABORT" not in run.stderr


def test_a_public_key_as_the_servers_certificate_is_a_config_error(tmp_path):
    public, _ = zmq.auth.create_certificates(tmp_path, "server")
    clients = tmp_path / "clients"
    clients.mkdir()
    zmq.auth.create_certificates(clients, "client")
    settings = {"source.kind": "zmq", "security.server_key": str(public), "security.client_keys": str(clients)}
    run = run_cluster(tmp_path, 3, settings, timeout=BOUND)
    assert run.returncode == 2, run.stderr
    assert f"security.server_key: '{public}' holds only a public key" in run.stderr
    assert "Traceback" not in run.stderr


def test_a_config_error_ends_every_rank_with_exit_2(tmp_path):
    """Rank 0 explains; the other ranks exit 2 as well (each rank's own exit code, seen through a shell)."""
    script = f'{sys.executable} -m master "$@"; code=$?; echo "rank $OMPI_COMM_WORLD_RANK exit $code" >&2; exit $code'
    cmd = [
        find_mpirun(),
        "--oversubscribe",
        "-n",
        "3",
        "bash",
        "-c",
        script,
        "-",
        "--set",
        "join.window=-1",
        "--set",
        f"output.path={tmp_path}/out",
    ]
    proc = subprocess.run(cmd, env=mpi_env(), capture_output=True, text=True, timeout=BOUND, cwd=ROOT)
    assert proc.returncode == 2
    # mpirun ends the job at the first non-zero exit, so not every rank may get to report its own
    codes = {line.split()[1]: line.split()[3] for line in proc.stderr.splitlines() if line.startswith("rank ")}
    assert set(codes.values()) == {"2"} and set(codes) - {"0"}, proc.stderr
    assert proc.stderr.count("join.window: must be >= 0") == 1


def test_a_disk_full_at_the_start_is_a_crash_which_the_supervisor_restarts(tmp_path):
    """The output's file system full before the job starts (a tmpfs of 256 KiB filled beside the output folder):
    the environment's fault, not a mistake -- exit 1 (a crash, restarted), not 2, which the supervisor gives up
    on; it met a recovery after the nemesis soak's full disk (tests/nemesis.py) and ended a supervised run."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        subprocess.run(["dd", "if=/dev/zero", f"of={disk / 'fill'}", "bs=4k"], capture_output=True)
        run = run_cluster(tmp_path, 3, dict(RUN, **{"output.path": str(disk / "out")}), timeout=BOUND)
    finally:
        subprocess.run(["umount", "-l", str(disk)])
    assert run.returncode == 1, run.stderr
    line = one_error_line(run.stderr)
    assert line.startswith("error: rank 0 (master) failed: OSError: ") and "No space left on device" in line, line
